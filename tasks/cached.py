"""A fully cached run, answered without Prefect: the flow's stages walked in its order over the results cached
under <workdir>/.prefect/results, each verified (its files' sizes and sha256s) before it counts.

`cached_run(cfg, until)` returns the summary of the run that produced those results — its report, its MLflow
run, reused rather than duplicated — when every stage is a verified hit and that run's summary was remembered;
None otherwise. The CLI asks before it starts Prefect at all (a cached rerun in ~2 s), the flow before it opens
an MLflow run (a cached deployment run logs nothing new). `remember` stores a finished run's summary under its
result key: the config, `until` and every stage's record key; the flow calls it at the end of each run.
Nothing here imports Prefect or MLflow. The walk mirrors flows.distill.distill; tests/test_pipeline.py checks
that both name the same stages and records.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import stages.evaluate
import stages.export
import stages.prefix
import stages.student
import stages.teacher
import stages.tokenize
import stages.train
from schemas.config import RunConfig, dump_config
from stages.keys import StageKey, outputs_problem
from stages.layout import workdir
from tasks.records import BadRecord, read_manifest_record

STAGES = ("tokenize", "teacher", "train", "evaluate", "export")
RESULTS = Path(".prefect") / "results"
INDEX = Path(".cache") / "runs"
RECORD_FORMAT = "typed"  # tasks.caching.RECORD_FORMAT (not imported: that module imports Prefect)


class Miss(Exception):
    """A stage has no cached result, or its files do not verify."""


def record_key(stage: str, key: str) -> str:
    """tasks.caching.record_key: the result record of a stage's content key."""
    return f"{stage}-{RECORD_FORMAT}-{key.rsplit('-', 1)[-1]}"


def read_record(path: Path) -> Any:
    """The manifest of a Prefect JSON result record (tasks.records: only JSON manifests of a known schema are
    read, nothing is deserialized any other way). Miss when absent or not such a record."""
    try:
        return read_manifest_record(path)
    except BadRecord as exc:
        raise Miss(str(exc)) from None


@dataclass
class Walk:
    """The stages of one run looked up in order: (task run name, record key) of each, and their results."""

    cfg: RunConfig
    root: Path
    records: list[tuple[str, str]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)

    def hit(
        self,
        name: str,
        spec: StageKey,
        inputs: Mapping[str, Any],
        verify: Callable[[Any], str | None] | None = None,
    ) -> Any:
        """The verified cached result of stage `name`, or Miss."""
        key = record_key(spec.stage, spec.key(self.cfg, inputs))
        value = read_record(self.root / RESULTS / key)
        problem = verify(value) if verify is not None else outputs_problem(self.cfg, value)
        if problem is not None:
            raise Miss(f"{name}: {problem}")
        self.records.append((name, key))
        return value

    def result_key(self, until: str) -> str:
        """What identifies this run's results: the config, `until` and every stage's record key."""
        text = json.dumps([dump_config(self.cfg), until, self.records], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def walk(cfg: RunConfig, until: str = "export") -> Walk:
    """Every stage up to `until` as flows.distill runs it, each a verified cache hit; Miss at the first that
    is not. The results are the walk's `values`."""
    w = Walk(cfg, workdir(cfg))
    v = w.values

    def reaches(stage: str) -> bool:
        return STAGES.index(stage) <= STAGES.index(until)

    v["tokens"] = w.hit("tokenize", stages.tokenize.KEY, {})
    v["student"] = w.hit("student", stages.student.KEY, {})
    if reaches("teacher"):
        plan = w.hit("teacher-plan", stages.teacher.KEY, {"tokens": v["tokens"]})
        shards = [
            w.hit(
                f"teacher-shard-{s.shard}",
                stages.teacher.SHARD_KEY,
                {"plan": plan, "shard": s},
                verify=lambda _, s=s: stages.teacher.shard_problem(cfg, plan, s),
            )
            for s in plan.shards
        ]
        v["teacher"] = plan.model_copy(update={"shards": tuple(shards)})
    upstream = {k: v[k] for k in ("student", "tokens", "teacher") if k in v}
    if reaches("train") and (layer := stages.prefix.layer(cfg)):
        inputs = {"student": v["student"], "tokens": v["tokens"], "layer": layer}
        v["prefix"] = w.hit(f"prefix-cache-block-{layer}", stages.prefix.KEY, inputs)
    if reaches("train"):
        v["checkpoints"] = [
            w.hit(f"train-epoch-{e}", stages.train.KEY, {**upstream, "epoch": e}) for e in range(cfg.train.epochs)
        ]
    if reaches("evaluate"):
        v["baseline"] = w.hit("evaluate-baseline", stages.evaluate.BASELINE_KEY, upstream)
        v["evals"] = [
            w.hit(f"evaluate-epoch-{c.epoch}", stages.evaluate.CHECKPOINT_KEY, {**upstream, "checkpoint": c})
            for c in v["checkpoints"]
        ]
        v["best"] = stages.evaluate.select_best(cfg, v["evals"])
    if reaches("export"):
        best = v["checkpoints"][v["best"]]
        exported = w.hit("export", stages.export.KEY, {"student": v["student"], "checkpoint": best})
        if exported.merged is not None:
            w.hit(
                "evaluate-merged",
                stages.evaluate.MERGED_KEY,
                {"merged": exported.merged, "tokens": v["tokens"], "teacher": v["teacher"]},
            )
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
