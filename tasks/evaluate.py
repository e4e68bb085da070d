"""Held-out evaluation tasks over stages.evaluate: the baseline, each epoch's checkpoint, a merged GGUF."""

from __future__ import annotations

from prefect import task

import stages.evaluate
from schemas.config import RunConfig
from schemas.manifests import (
    CheckpointManifest,
    EvalManifest,
    FileRef,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
)
from tasks.caching import StageCache, stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar

BASELINE = StageCache(spec=stages.evaluate.BASELINE_KEY)
EPOCH = StageCache(spec=stages.evaluate.CHECKPOINT_KEY)
MERGED = StageCache(spec=stages.evaluate.MERGED_KEY)


@task(**stage_options(BASELINE, task_run_name="evaluate-baseline"))
def evaluate_baseline(
    cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, teacher: TeacherManifest
) -> EvalManifest:
    """The student without an adapter: the gap distillation starts from."""
    with prefect_logs():
        return stages.evaluate.run(cfg, student, tokens, teacher, bar=bar)


@task(**stage_options(EPOCH, task_run_name="evaluate-epoch-{checkpoint.epoch}"))
def evaluate_checkpoint(
    cfg: RunConfig,
    student: StudentManifest,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    checkpoint: CheckpointManifest,
) -> EvalManifest:
    """The student with a checkpoint's adapter."""
    with prefect_logs():
        return stages.evaluate.run(cfg, student, tokens, teacher, checkpoint, bar)


@task(**stage_options(MERGED, task_run_name="evaluate-merged"))
def evaluate_merged(
    cfg: RunConfig, merged: FileRef, tokens: TokenizeManifest, teacher: TeacherManifest
) -> EvalManifest:
    """The merged GGUF (adapter folded into the weights, requantized) alone."""
    with prefect_logs():
        return stages.evaluate.run_merged(cfg, merged, tokens, teacher, bar)
