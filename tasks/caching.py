"""Prefect cache policy of the pipeline's stages: the stage's content key (stages/keys.py), and a cached result
reused only after the files it names verify.

Never Prefect's DEFAULT policy (it includes the run id) and never a bare Path (Prefect would hash the string).
Results are persisted as JSON (tasks return typed manifests, which Prefect's JSON serializer round-trips) into
the storage the flow runs with, which flows.distill puts under the run's workdir. They are read back only by
tasks.records (ManifestStore): a record that is not a JSON manifest of a known schema (one naming a Python-object
serializer, a plain dict, garbage) is a cache miss with one warning line, never deserialized. Before a cached result is
reused, its manifest's files are checked (stages.keys.outputs_problem: size and sha256 of every output, or a
stage's own check such as a teacher shard's): when one is missing or differs, one warning line says which and
the record is dropped, so the task runs again, rebuilds its files (deterministically) and stores a fresh
record; a stage downstream recomputes when its inputs' content changed (its key changes). Records are written
under a lock (tasks/stage_locks.py): two flow runs at the same stage with the same key compute it once.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.cache_policies import CachePolicy
from prefect.results import ResultStore, get_result_store
from prefect.serializers import JSONSerializer

from schemas.config import RunConfig
from schemas.manifests import Manifest
from stages.graph import Node, Runner
from stages.layout import workdir
from tasks import faults
from tasks.logs import prefect_logs
from tasks.records import BadRecord, read_manifest_record, record_key
from tasks.stage_locks import STAGE_LOCKS


def as_config(cfg: RunConfig | Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a RunConfig or its JSON dict (a deployment passes the dict)."""
    return cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)


@dataclass
class StageCache(CachePolicy):
    """Cache key of one pipeline stage: its graph node's content key (stages/graph.py); a cached result is used only
    when the node's verify (cfg, the task's inputs, the cached result) finds nothing wrong with the files it names."""

    node: Node = field(kw_only=True)

    def __post_init__(self) -> None:
        # one computation per record: a second flow run with the same key waits for the first's, then reads it
        self.isolation_level = "SERIALIZABLE"
        self.lock_manager = STAGE_LOCKS

    @property
    def stage(self) -> str:
        return self.node.stage

    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        """The stage's content key '<stage>-<sha256>' (stages.graph.Node.content_key)."""
        return self.node.content_key(as_config(cfg), inputs)

    def record_key(self, key: str) -> str:
        """The Prefect result record of content key `key`."""
        return record_key(self.stage, key)

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        cfg = as_config(inputs["cfg"])
        record = self.record_key(self.key(cfg, inputs))
        try:
            cached = _load(get_result_store(), record)
        except BadRecord as exc:
            problem: str | None = str(exc)
        else:
            if cached is None:
                return record
            problem = self.node.verify(cfg, inputs, cached)
            if problem is None:
                return record
        from prefect import get_run_logger

        name = getattr(getattr(task_ctx, "task_run", None), "name", None) or self.stage
        get_run_logger().warning(
            "%s: cached result not used (%s): recomputing it and what depends on it", name, problem
        )
        # Drop the stale record so the rerun stores a fresh one under the same key (else: run, cache nothing).
        return record if _drop_record(record) else None


def _load(store: ResultStore, key: str) -> Manifest | None:
    """The manifest recorded under `key` in the store's local folder (tasks.records: JSON manifests only),
    None when there is no record; BadRecord when there is one that is not such a manifest."""
    resolve = getattr(store.result_storage, "_resolve_path", None)
    if resolve is None:
        raise BadRecord(f"record {key}: result storage is not a local folder; only local records are read")
    path = Path(resolve(key))
    return read_manifest_record(path) if path.exists() else None


class ManifestStore(ResultStore):
    """Prefect's result store, reading records only through tasks.records: a record that is not a JSON manifest
    of a known schema does not exist for Prefect (a cache miss), and nothing in it is ever deserialized by the
    serializer it names. Installed for a flow run's tasks by `strict_results`."""

    def _read(self, key: str, holder: str) -> ResultRecord[Any]:
        manifest = _load(self, key)
        if manifest is None:
            raise BadRecord(f"record {key}: missing")  # exists() said yes a moment ago: a concurrent writer
        record = ResultRecord(
            metadata=ResultRecordMetadata(storage_key=key, serializer=JSONSerializer()), result=manifest
        )
        record.mark_persisted()
        return record

    async def _aread(self, key: str, holder: str) -> ResultRecord[Any]:
        return self._read(key, holder)

    def _exists(self, key: str) -> bool:
        try:
            return _load(self, key) is not None
        except BadRecord:
            return False

    async def _aexists(self, key: str) -> bool:
        return self._exists(key)


def strict_results() -> None:
    """Make the current flow run's tasks read cached results through ManifestStore (call first in a flow)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is not None and not isinstance(ctx.result_store, ManifestStore):
        store = ctx.result_store
        ctx.result_store = ManifestStore.model_construct(**{k: getattr(store, k) for k in type(store).model_fields})


def _drop_record(key: str) -> bool:
    """Delete the record `key` from local result storage; False when the storage is not a local folder."""
    store = get_result_store()
    resolve = getattr(store.result_storage, "_resolve_path", None)
    if resolve is None or store.metadata_storage is not None:
        return False
    try:
        Path(resolve(key)).unlink(missing_ok=True)
    except (OSError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------- task options

_log_lock = threading.Lock()
_STATES: dict[str, list[tuple[str, str]]] = {}


def _record_state(task: Any, task_run: Any, state: Any) -> None:
    """Hook: remember (task run name, state name) per flow run: Completed = ran, Cached = reused. A stage that
    ran is a stage boundary for fault injection (DISTILLERY_FAULT=after=<task run name>)."""
    with _log_lock:
        _STATES.setdefault(str(task_run.flow_run_id), []).append((task_run.name, state.name))
    if state.name == "Completed":
        faults.check("after", task_run.name)


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


def stage_options(node: Node, **options: Any) -> dict[str, Any]:
    """Keyword arguments of @task for the cached stage `node`: its name, run name and cache policy, JSON results,
    state bookkeeping."""
    return {
        "name": node.stage,
        "task_run_name": node.run_name,
        "cache_policy": StageCache(node=node),
        "persist_result": True,
        "result_serializer": "json",
        "cache_result_in_memory": False,
        "on_completion": [_record_state],
        "on_failure": [_record_state],
        **options,
    }


def stage_runner(cfg: RunConfig, tasks: Mapping[Node, Any], **extra: Any) -> Runner:
    """A stages.graph Runner that runs each node as its task, `tasks[node](cfg, **inputs)`, adding the `extra`
    keywords the task takes (an epoch task's MLflow run id)."""

    def run(node: Node, /, **inputs: Any) -> Any:
        task = tasks[node]
        takes = inspect.signature(task.fn).parameters
        return task(cfg, **inputs, **{name: value for name, value in extra.items() if name in takes})

    return run


def run_graph(walk: Callable[..., None], cfg: RunConfig, until: str, tasks: Mapping[Node, Any], record: Any) -> Any:
    """In a flow: walk a stage graph (stages.graph.distill / preference) with each node run as its task, results
    set on the flow's MLflow record (`record`, a context manager entered here), the library's log lines in the
    flow run's log; returns the record's summary."""
    with record as r, prefect_logs():
        walk(cfg, until, stage_runner(cfg, tasks, mlflow_run_id=r.id), r)
        return r.finish()


def in_workdir(flow: Any, cfg: RunConfig, until: str) -> Any:
    """Run flow(cfg, until) with Prefect results (the stage cache) stored under <workdir>/.prefect/results."""
    storage = workdir(cfg) / ".prefect" / "results"
    storage.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"result_storage": storage}
    if cfg.run.run_name:
        options["flow_run_name"] = cfg.run.run_name
    return flow.with_options(**options)(cfg, until)
