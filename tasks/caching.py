"""Content-hash cache keys for the pipeline's Prefect tasks.

A stage's key is the sha256 of: the stage name and its code version, the config fields the stage reads
(schemas.config_fingerprint), the sha256 of the model files it reads (memoised by path, size and mtime in
<workdir>/.cache/sha256.json), the dataset fingerprint when it reads the data, and the content of its upstream
manifests (locations and run-time measurements dropped, so only hashes, counts and values count).
Never Prefect's DEFAULT policy (it includes the run id) and never a bare Path (Prefect would hash the string).

Results are persisted as JSON (tasks return small manifests as dicts) into the storage the flow runs with,
which flows.distill puts under the run's workdir. A policy may also name an `outputs_problem` check: when a
cached result exists but the files it names are gone or corrupt, compute_key returns None and the task runs
again (rebuilding them, deterministically) instead of returning a manifest that no longer matches the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from data.records import dataset_fingerprint
from schemas.config import RunConfig, config_fingerprint
from schemas.manifests import sha256_file

MEMO_FILE = Path(".cache") / "sha256.json"
# Never part of a key: locations (paths, dirs), and what a checkpoint records about the run that wrote it
# (metrics with timings, the state JSON holding them, the optimizer moments): a checkpoint counts by its
# adapter.
IGNORED_KEYS = frozenset({"path", "dir", "metrics", "state", "optimizer"})
_memo_lock = threading.Lock()


def as_config(cfg: RunConfig | Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a RunConfig or its JSON dict (a deployment passes the dict)."""
    return cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)


def workdir(cfg: RunConfig) -> Path:
    """The run's workdir as an absolute path (created)."""
    path = Path(cfg.run.workdir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------- file hashes


def file_sha256(path: str | Path, memo_root: str | Path) -> str:
    """sha256 of a file, memoised in <memo_root>/.cache/sha256.json by (absolute path, size, mtime_ns)."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    memo_path = Path(memo_root) / MEMO_FILE
    entry_key = str(path)
    with _memo_lock:
        memo = _read_memo(memo_path)
        hit = memo.get(entry_key)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            return str(hit["sha256"])
    digest = sha256_file(path)
    with _memo_lock:
        memo = _read_memo(memo_path)
        memo[entry_key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".{memo_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, memo_path)
    return digest


def _read_memo(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------- keys


def content(value: Any) -> Any:
    """JSON-able content of a stage result / manifest / list, for keys: IGNORED_KEYS dropped.

    A stage result {"dir" or "path": ..., "manifest": {...}, other info} counts by its manifest alone (info
    such as upload timings must not change downstream keys).
    """
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, Mapping):
        if "manifest" in value:
            return content(value["manifest"])
        return {str(k): content(v) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list | tuple):
        return [content(v) for v in value]
    if isinstance(value, Path):
        raise TypeError(f"a bare Path ({value}) cannot be part of a cache key: hash the file's content")
    return value


@dataclass
class StageCache(CachePolicy):
    """Cache key of one pipeline stage from content hashes; see the module docstring.

    config_fields: dotted config fields the stage reads (values, never paths).
    files: dotted config fields naming files the stage reads, hashed by content (e.g. "model.student").
    dataset: fold in data.tokens.dataset_fingerprint of cfg.data.
    inputs: task parameters folded in by content (upstream manifests, an epoch number, a shard plan).
    outputs_problem: (cfg, inputs, key) -> None when the outputs a cached result names are on disk (and
        verify), else what is wrong with them: then the task runs again instead of returning the cached
        result.
    """

    stage: str = ""
    version: str = "1"
    config_fields: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    dataset: bool = False
    inputs: tuple[str, ...] = ()
    outputs_problem: Callable[[RunConfig, Mapping[str, Any], str], str | None] | None = field(default=None, repr=False)

    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        """The stage's key: '<stage>-<sha256>'. Inputs named in `inputs` but absent are left out."""
        cfg = as_config(cfg)
        root = workdir(cfg)
        parts: dict[str, Any] = {
            "stage": self.stage,
            "version": self.version,
            "config": config_fingerprint(cfg, self.config_fields),
        }
        for name in self.files:
            parts[f"file:{name}"] = file_sha256(_field(cfg, name), root)
        if self.dataset:
            d = cfg.data
            parts["dataset"] = dataset_fingerprint(d.path, d.format, d.text_field, d.messages_field, d.max_documents)
        for name in self.inputs:
            if name in inputs:
                parts[f"input:{name}"] = content(inputs[name])
        canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=True)
        return f"{self.stage}-{hashlib.sha256(canonical.encode()).hexdigest()}"

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        cfg = as_config(inputs["cfg"])
        key = self.key(cfg, inputs)
        problem = None if self.outputs_problem is None else self.outputs_problem(cfg, inputs, key)
        if problem is None or not _has_record(key):
            return key
        # A cached result names outputs that are gone or corrupt: run again (rebuilding them), no cache hit.
        from prefect import get_run_logger

        get_run_logger().warning("%s: cached result not used, recomputing", problem)
        return None


def _has_record(key: str) -> bool:
    """Whether the current result store holds a cached result under `key`."""
    from prefect.results import get_result_store

    return get_result_store().exists(key)


def _field(cfg: RunConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def located(cfg: RunConfig, path: str | Path) -> Path:
    """A path from a stage result: absolute as is, relative under the run's workdir."""
    p = Path(path)
    return p if p.is_absolute() else workdir(as_config(cfg)) / p


def relative(cfg: RunConfig, path: Path) -> str:
    """How a stage result stores a path: relative to the workdir when under it, else absolute."""
    root = workdir(cfg)
    path = Path(path).resolve()
    return str(path.relative_to(root) if path.is_relative_to(root) else path)


def missing(*paths: Path) -> str | None:
    """An outputs_problem answer: None when every path exists, else which one is gone."""
    gone = [p for p in paths if not p.exists()]
    return None if not gone else f"{gone[0]}: missing"


def stage_dir(cfg: RunConfig, stage: str, key: str) -> Path:
    """<workdir>/<stage>/<first 16 hex digits of the key>: outputs are addressed by their cache key, so a
    config that differs never overwrites the files another config's cached result names."""
    return workdir(cfg) / stage / key.rsplit("-", 1)[-1][:16]


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
