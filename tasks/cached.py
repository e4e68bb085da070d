"""A fully cached run, answered without Prefect: the flow's stages walked in its order over the results cached
under <workdir>/.prefect/results, each verified (its files' sizes and sha256s) before it counts.

`cached_run(cfg, until)` returns the summary of the run that produced those results — its report, its MLflow
run, reused rather than duplicated — when every stage is a verified hit and that run's summary was remembered;
None otherwise. The CLI asks before it starts Prefect at all (a cached rerun in ~2 s), the flow before it opens
an MLflow run (a cached deployment run logs nothing new). `remember` stores a finished run's summary under its
result key: the config, `until` and every stage's record key; the flow calls it at the end of each run.
Nothing here imports Prefect or MLflow. The walk is stages/graph.py's `distill`, the flow's own graph, with
each node looked up instead of run; tests/test_pipeline.py checks that both name the same stages and records.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.config import RunConfig, dump_config
from stages import graph
from stages.layout import workdir
from tasks.records import BadRecord, read_manifest_record, record_key

RESULTS = Path(".prefect") / "results"
INDEX = Path(".cache") / "runs"


class Miss(Exception):
    """A stage has no cached result, or its files do not verify."""


def read_record(path: Path) -> Any:
    """The manifest of a Prefect JSON result record (tasks.records: only JSON manifests of a known schema are
    read, nothing is deserialized any other way). Miss when absent or not such a record."""
    try:
        return read_manifest_record(path)
    except BadRecord as exc:
        raise Miss(str(exc)) from None


@dataclass
class Results:
    """What stages.graph.distill sets as it walks: the stages' results."""

    tokens: Any = None
    student: Any = None
    teacher: Any = None
    prefix: Any = None
    checkpoints: list[Any] = field(default_factory=list)
    baseline: Any = None
    evals: list[Any] = field(default_factory=list)
    best: int | None = None
    exported: Any = None
    merged: Any = None


@dataclass
class Walk:
    """The stages of one run looked up in order: (task run name, record key) of each, and their results."""

    cfg: RunConfig
    root: Path
    records: list[tuple[str, str]] = field(default_factory=list)
    values: Results = field(default_factory=Results)

    def hit(self, node: graph.Node, /, **inputs: Any) -> Any:
        """The verified cached result of `node` on `inputs` (a stages.graph Runner), or Miss; None for a node
        that is not cached (nothing recorded)."""
        if node.key is None:
            return None
        name = node.name(inputs)
        key = record_key(node.stage, node.content_key(self.cfg, inputs))
        value = read_record(self.root / RESULTS / key)
        problem = node.verify(self.cfg, inputs, value)
        if problem is not None:
            raise Miss(f"{name}: {problem}")
        self.records.append((name, key))
        return value

    def result_key(self, until: str) -> str:
        """What identifies this run's results: the config, `until` and every stage's record key."""
        text = json.dumps([dump_config(self.cfg), until, self.records], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def walk(cfg: RunConfig, until: str = "export") -> Walk:
    """Every stage of stages.graph.distill up to `until`, each a verified cache hit; Miss at the first that is
    not. The results are the walk's `values`."""
    w = Walk(cfg, workdir(cfg))
    graph.distill(cfg, until, w.hit, w.values)
    return w


def _index_path(root: Path, result_key: str) -> Path:
    return root / INDEX / f"{result_key}.json"


def remember(cfg: RunConfig, until: str, summary: Mapping[str, Any]) -> Path | None:
    """Store a finished run's summary under its result key (None when its stages do not all verify now)."""
    try:
        w = walk(cfg, until)
    except Miss:
        return None
    path = _index_path(w.root, w.result_key(until))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary, indent=1, allow_nan=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def cached_run(cfg: RunConfig, until: str = "export") -> dict[str, Any] | None:
    """The summary of the remembered run whose results every stage up to `until` reuses after verification
    (stages: all cached, nothing ran); None when a stage must run or no run was remembered."""
    started = time.perf_counter()
    try:
        w = walk(cfg, until)
    except Miss:
        return None
    try:
        summary = json.loads(_index_path(w.root, w.result_key(until)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    summary["stages"] = {"ran": [], "cached": [name for name, _ in w.records]}
    summary["seconds"] = time.perf_counter() - started
    summary["reused"] = True
    if summary.get("registered_model"):
        summary["registered_model"] = {**summary["registered_model"], "new": False}
    return summary
