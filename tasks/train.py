"""train_epoch: one Prefect task per epoch over stages.train.run_epoch, resumable from its checkpoints.

Each optimizer step (already in steps.jsonl) is logged live to MLflow, shown on a progress bar, and offered
to the fault hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prefect import task

import stages.train
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest, TeacherManifest, TokenizeManifest
from stages import graph
from tasks import faults
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar
from tasks.tracking import step_logger


@task(**stage_options(graph.TRAIN))
def train_epoch(
    cfg: RunConfig,
    student: StudentManifest,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    epoch: int,
    mlflow_run_id: str | None = None,
) -> CheckpointManifest:
    """Train epoch `epoch` (0-based); returns its epoch-end checkpoint."""
    return logged_epoch(
        cfg, mlflow_run_id, lambda on_step: stages.train.run_epoch(cfg, student, tokens, teacher, epoch, on_step, bar)
    )


def logged_epoch(
    cfg: RunConfig, mlflow_run_id: str | None, run: Callable[[Callable[[Any], None]], CheckpointManifest]
) -> CheckpointManifest:
    """Run an epoch stage (`run(on_step)`) with its steps logged to MLflow, the train.step fault point and the
    stage's log lines in Prefect's run log."""
    mlflow_steps = step_logger(cfg, mlflow_run_id)

    def on_step(rec: Any) -> None:
        mlflow_steps.log(dataclasses.asdict(rec))
        faults.check("train.step", rec.step)

    try:
        with prefect_logs():
            return run(on_step)
    finally:
        mlflow_steps.flush()
