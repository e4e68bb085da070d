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
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar


@task(**stage_options(graph.BASELINE))
def evaluate_baseline(
    cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, teacher: TeacherManifest
) -> EvalManifest:
    """The student without an adapter: the gap distillation starts from."""
    with prefect_logs():
        return stages.evaluate.run(cfg, student, tokens, teacher, bar=bar)


@task(**stage_options(graph.EVALUATE))
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


@task(**stage_options(graph.MERGED))
def evaluate_merged(
    cfg: RunConfig, merged: FileRef, tokens: TokenizeManifest, teacher: TeacherManifest
) -> EvalManifest:
    """The merged GGUF (adapter folded into the weights, requantized) alone."""
    with prefect_logs():
        return stages.evaluate.run_merged(cfg, merged, tokens, teacher, bar)
