"""Prefect tasks of preference tuning (run.task: dpo): pairs, reference log-probs, DPO epochs, evaluation.

Each wraps its stage as its node in stages/graph.py says (name, run name, content key: the reference and
evaluation keys fold in the reference GGUF's sha256, derived from the student manifest or preference.reference),
as the distillation tasks do.
"""

from __future__ import annotations

from prefect import task

import stages.pairs
import stages.preference_evaluate
import stages.preference_train
import stages.reference
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest
from schemas.preferences import PairsManifest, PreferenceEvalManifest, ReferenceManifest
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar
from tasks.train import logged_epoch


@task(**stage_options(graph.PAIRS))
def pairs(cfg: RunConfig) -> PairsManifest:
    """Tokenize the preference pairs of cfg.data with the student's chat template."""
    with prefect_logs():
        return stages.pairs.run(cfg)


@task(**stage_options(graph.REFERENCE))
def reference(cfg: RunConfig, student: StudentManifest, pairs: PairsManifest) -> ReferenceManifest:
    """Summed response log-probs of every pair under the frozen reference."""
    with prefect_logs():
        return stages.reference.run(cfg, student, pairs, bar)


@task(**stage_options(graph.DPO_EPOCH))
def dpo_epoch(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    epoch: int,
    mlflow_run_id: str | None = None,
) -> CheckpointManifest:
    """Train epoch `epoch` (0-based) of preference steps; returns its epoch-end checkpoint."""
    return logged_epoch(
        cfg,
        mlflow_run_id,
        lambda on_step: stages.preference_train.run_epoch(cfg, student, pairs, reference, epoch, on_step, bar),
    )


@task(**stage_options(graph.PREFERENCE_EVALUATE))
def evaluate(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    checkpoint: CheckpointManifest | None,
    label: str,
) -> PreferenceEvalManifest:
    """Held-out preference metrics with the checkpoint's adapter (None: the baseline without adapter)."""
    with prefect_logs():
        return stages.preference_evaluate.run(cfg, student, pairs, reference, checkpoint, bar)
