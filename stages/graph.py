"""The pipelines' stage graphs, declared once: each stage's node (task-run name, content key, the check of a cached
result) and the order in which a run takes them, on which upstream results, up to which phase.

`distill` and `preference` walk their graph through a `Runner`, `run(node, **inputs) -> result`, and set each
result on `out` as it comes (a failed run keeps what finished). Who runs a node decides what a run is:
flows/distill.py and flows/preference.py run each node as its cached Prefect task (tasks/: one task per node,
named and keyed by it); tasks/cached.py looks each node's record up and verifies it, without Prefect. `PHASES`
are what `until` may name (the CLI, the flows' parameter, the serve form). Adding a stage: its node here and its
line in the graph function; a task over it in tasks/ and that task in the flow's table. No Prefect, no MLflow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import stages.evaluate
import stages.export
import stages.pairs
import stages.preference_evaluate
import stages.preference_train
import stages.prefix
import stages.reference
import stages.student
import stages.teacher
import stages.tokenize
import stages.train
from schemas.config import RunConfig
from schemas.manifests import Manifest
from stages.keys import StageKey, outputs_problem

Phase = Literal["tokenize", "teacher", "train", "evaluate", "export"]
PHASES: tuple[str, ...] = get_args(Phase)  # preference runs: tokenize = pairs + student, teacher = reference

Verify = Callable[[RunConfig, Mapping[str, Any], Any], "str | None"]


def check_until(until: str) -> str:
    """`until` when it names a phase; ValueError naming the phases otherwise."""
    if until not in PHASES:
        raise ValueError(f"until {until!r}: must be one of {', '.join(PHASES)}")
    return until


def reaches(phase: Phase, until: str) -> bool:
    """Whether a run up to `until` includes `phase`."""
    return PHASES.index(phase) <= PHASES.index(check_until(until))


def verify_outputs(cfg: RunConfig, inputs: Mapping[str, Any], result: Any) -> str | None:
    """The default check of a cached result: the files its manifest lists (stages.keys.outputs_problem)."""
    return outputs_problem(cfg, result) if isinstance(result, Manifest) else None


@dataclass(frozen=True)
class Node:
    """One stage of a graph. run_name: its task runs' name, a str.format template over its inputs. key: its content
    key (None: not cached, nothing recorded). key_inputs: what the key folds in, from the inputs (default: the
    inputs themselves). verify: the check of a cached result before it is reused."""

    run_name: str
    key: StageKey | None
    key_inputs: Callable[[RunConfig, Mapping[str, Any]], Mapping[str, Any]] | None = None
    verify: Verify = verify_outputs

    @property
    def stage(self) -> str:
        """The stage's name in record and folder keys (its StageKey's)."""
        return self.key.stage if self.key is not None else self.run_name

    def name(self, inputs: Mapping[str, Any]) -> str:
        """This node's task-run name for `inputs`."""
        return self.run_name.format(**inputs)

    def content_key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        """The content key '<stage>-<sha256>' of this node on `inputs`."""
        if self.key is None:
            raise ValueError(f"{self.run_name}: not a cached stage")
        return self.key.key(cfg, self.key_inputs(cfg, inputs) if self.key_inputs is not None else inputs)


class Runner(Protocol):
    """Runs (or looks up) one node on its inputs and returns its result."""

    def __call__(self, node: Node, /, **inputs: Any) -> Any: ...


def _shard_problem(cfg: RunConfig, inputs: Mapping[str, Any], cached: Any) -> str | None:
    return stages.teacher.shard_problem(cfg, inputs["plan"], inputs["shard"])


def _teacher_plan_inputs(cfg: RunConfig, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return stages.teacher.key_inputs(cfg, inputs["tokens"])


def _reference_inputs(cfg: RunConfig, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    return stages.reference.key_inputs(cfg, inputs["student"], inputs["pairs"])


def _preference_eval_inputs(cfg: RunConfig, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    given = (inputs.get(name) for name in ("student", "pairs", "reference", "checkpoint"))
    return stages.preference_evaluate.key_inputs(cfg, *given)


# ---- distillation ---------------------------------------------------------------------------------------------
TOKENIZE = Node("tokenize", stages.tokenize.KEY)
STUDENT = Node("student", stages.student.KEY)
TEACHER_PLAN = Node("teacher-plan", stages.teacher.KEY, _teacher_plan_inputs)
TEACHER_RAY = Node("teacher-ray", None)  # teacher.runner=ray: the missing shards as Ray tasks, then recorded below
TEACHER_SHARD = Node("teacher-shard-{shard.shard}", stages.teacher.SHARD_KEY, verify=_shard_problem)
PREFIX = Node("prefix-cache-block-{layer}", stages.prefix.KEY)
TRAIN = Node("train-epoch-{epoch}", stages.train.KEY)
BASELINE = Node("evaluate-baseline", stages.evaluate.BASELINE_KEY)
EVALUATE = Node("evaluate-epoch-{checkpoint.epoch}", stages.evaluate.CHECKPOINT_KEY)
EXPORT = Node("export", stages.export.KEY)
MERGED = Node("evaluate-merged", stages.evaluate.MERGED_KEY)


def distill(cfg: RunConfig, until: str, run: Runner, out: Any) -> None:
    """tokenize -> student -> teacher top-k (plan, shards) -> (prefix cache) -> train epochs -> evaluate -> select
    -> export (-> evaluate the merged GGUF), up to `until`. Sets on `out`: tokens, student, teacher, prefix,
    checkpoints, baseline, evals, best, exported, merged."""
    out.tokens, out.student = run(TOKENIZE), run(STUDENT)
    if reaches("teacher", until):
        out.teacher = teacher_topk(cfg, run, out.tokens)
    upstream = {"student": out.student, "tokens": out.tokens, "teacher": out.teacher}
    if reaches("train", until) and (layer := stages.prefix.layer(cfg)):  # train/evaluate find it by its key
        out.prefix = run(PREFIX, student=out.student, tokens=out.tokens, layer=layer)
    if reaches("train", until):
        out.checkpoints = [run(TRAIN, **upstream, epoch=epoch) for epoch in range(cfg.train.epochs)]
    if reaches("evaluate", until):
        out.baseline = run(BASELINE, **upstream)
        out.evals = [run(EVALUATE, **upstream, checkpoint=c) for c in out.checkpoints]
        out.best = stages.evaluate.select_best(cfg, out.evals)
    if reaches("export", until):
        out.exported = run(EXPORT, student=out.student, checkpoint=out.checkpoints[out.best])
        if out.exported.merged is not None:
            out.merged = run(MERGED, merged=out.exported.merged, tokens=out.tokens, teacher=out.teacher)


def teacher_topk(cfg: RunConfig, run: Runner, tokens: Any) -> Any:
    """The teacher stage: the plan, (teacher.runner=ray: the missing shards on Ray,) every shard in order, then
    the plan with its shards' records."""
    plan = run(TEACHER_PLAN, tokens=tokens)
    if cfg.teacher.runner == "ray":
        run(TEACHER_RAY, tokens=tokens, plan=plan)
    try:
        shards = [run(TEACHER_SHARD, tokens=tokens, plan=plan, shard=s) for s in plan.shards]
    finally:
        stages.teacher.release_teacher()
    return stages.teacher.finish(cfg, plan, shards)


# ---- preference tuning (run.task: dpo) -----------------------------------------------------------------------
PAIRS = Node("pairs", stages.pairs.KEY)
REFERENCE = Node("reference", stages.reference.KEY, key_inputs=_reference_inputs)
DPO_EPOCH = Node("dpo-epoch-{epoch}", stages.preference_train.KEY)
PREFERENCE_EVALUATE = Node("evaluate-{label}", stages.preference_evaluate.KEY, key_inputs=_preference_eval_inputs)


def preference(cfg: RunConfig, until: str, run: Runner, out: Any) -> None:
    """pairs -> student -> reference log-probs (not when reference_free) -> DPO epochs -> evaluate -> select ->
    export, up to `until`. Sets on `out`: pairs, student, reference, checkpoints, baseline, evals, best, exported."""
    out.pairs, out.student = run(PAIRS), run(STUDENT)
    if reaches("teacher", until) and not cfg.preference.reference_free:
        out.reference = run(REFERENCE, student=out.student, pairs=out.pairs)
    upstream = {"student": out.student, "pairs": out.pairs, "reference": out.reference}
    if reaches("train", until):
        out.checkpoints = [run(DPO_EPOCH, **upstream, epoch=epoch) for epoch in range(cfg.train.epochs)]
    if reaches("evaluate", until):
        out.baseline = run(PREFERENCE_EVALUATE, **upstream, checkpoint=None, label="baseline")
        out.evals = [
            run(PREFERENCE_EVALUATE, **upstream, checkpoint=c, label=f"epoch-{c.epoch}") for c in out.checkpoints
        ]
        out.best = stages.preference_evaluate.select_best(out.evals)
    if reaches("export", until):
        out.exported = run(EXPORT, student=out.student, checkpoint=out.checkpoints[out.best])
