"""Prefect cache policy of the pipeline's stages: the stage's content key (stages/keys.py), and a check that
the files a cached result names are still there.

Never Prefect's DEFAULT policy (it includes the run id) and never a bare Path (Prefect would hash the string).
Results are persisted as JSON (tasks return typed manifests, which Prefect's JSON serializer round-trips) into
the storage the flow runs with, which flows.distill puts under the run's workdir. A policy may also name an
`outputs_problem` check: when a cached result exists but the files it names are gone or corrupt, compute_key
returns None and the task runs again (rebuilding them, deterministically) instead of returning a manifest that
no longer matches the disk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from schemas.config import RunConfig
from stages.keys import StageKey

# Records are stored as '<stage>-typed-<sha256>': the manifests a task returns now, never the plain dicts that
# earlier versions stored under '<stage>-<sha256>'. The sha256 (and so every stage folder) is the content key.
RECORD_FORMAT = "typed"


def as_config(cfg: RunConfig | Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a RunConfig or its JSON dict (a deployment passes the dict)."""
    return cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)


@dataclass
class StageCache(CachePolicy):
    """Cache key of one pipeline stage: its content key (`spec`), checked against the disk.

    outputs_problem: (cfg, inputs, content key) -> None when the outputs a cached result names are on disk
        (and verify), else what is wrong with them: then the task runs again instead of returning the cached
        result.
    """

    spec: StageKey = field(kw_only=True)
    outputs_problem: Callable[[RunConfig, Mapping[str, Any], str], str | None] | None = field(
        default=None, repr=False, kw_only=True
    )

    @property
    def stage(self) -> str:
        return self.spec.stage

    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        """The stage's content key '<stage>-<sha256>' (stages.keys.StageKey.key)."""
        return self.spec.key(as_config(cfg), inputs)

    def record_key(self, key: str) -> str:
        """The Prefect result record of content key `key`."""
        return f"{self.stage}-{RECORD_FORMAT}-{key.rsplit('-', 1)[-1]}"

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        cfg = as_config(inputs["cfg"])
        key = self.key(cfg, inputs)
        record = self.record_key(key)
        problem = None if self.outputs_problem is None else self.outputs_problem(cfg, inputs, key)
        if problem is None or not _has_record(record):
            return record
        # A cached result names outputs that are gone or corrupt: run again (rebuilding them), no cache hit.
        from prefect import get_run_logger

        get_run_logger().warning("%s: cached result not used, recomputing", problem)
        return None


def _has_record(key: str) -> bool:
    """Whether the current result store holds a cached result under `key`."""
    from prefect.results import get_result_store

    return get_result_store().exists(key)


def missing(*paths: Path) -> str | None:
    """An outputs_problem answer: None when every path exists, else which one is gone."""
    gone = [p for p in paths if not p.exists()]
    return None if not gone else f"{gone[0]}: missing"


# ---------------------------------------------------------------------------------------------- task options

_log_lock = threading.Lock()
_STATES: dict[str, list[tuple[str, str]]] = {}


def _record_state(task: Any, task_run: Any, state: Any) -> None:
    """Hook: remember (task run name, state name) per flow run: Completed = ran, Cached = reused."""
    with _log_lock:
        _STATES.setdefault(str(task_run.flow_run_id), []).append((task_run.name, state.name))


def stage_states(flow_run_id: str) -> list[tuple[str, str]]:
    """(task run name, state name) of every stage task of a flow run in this process, in order."""
    with _log_lock:
        return list(_STATES.get(str(flow_run_id), []))


class _QuietStateHook(logging.Filter):
    """Drop Prefect's two INFO lines per task about running the bookkeeping hook above."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "_record_state" not in msg


logging.getLogger("prefect.task_runs").addFilter(_QuietStateHook())


def stage_options(policy: StageCache, **options: Any) -> dict[str, Any]:
    """Keyword arguments of @task for a cached stage: the policy, JSON results, state bookkeeping."""
    return {
        "name": policy.stage,
        "cache_policy": policy,
        "persist_result": True,
        "result_serializer": "json",
        "cache_result_in_memory": False,
        "on_completion": [_record_state],
        "on_failure": [_record_state],
        **options,
    }
