"""Prefect tasks of preference tuning (run.task: dpo): pairs, reference log-probs, DPO epochs, evaluation.

Each wraps its stage with a StageCache over the stage's content key, as the distillation tasks do; the reference
and evaluation keys fold in the reference GGUF's sha256 (derived from the student manifest or
preference.reference), so their policies compute the key from the task's inputs through the stage's helper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from prefect import task

import stages.pairs
import stages.preference_evaluate
import stages.preference_train
import stages.reference
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest
from schemas.preferences import PairsManifest, PreferenceEvalManifest, ReferenceManifest
from tasks.caching import StageCache, as_config, stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar
from tasks.train import logged_epoch


@dataclasses.dataclass
class _ReferenceCache(StageCache):
    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        return stages.reference.key(as_config(cfg), inputs["student"], inputs["pairs"])


@dataclasses.dataclass
class _EvaluateCache(StageCache):
    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        cfg = as_config(cfg)
        given = stages.preference_evaluate.key_inputs(
            cfg, inputs["student"], inputs["pairs"], inputs.get("reference"), inputs.get("checkpoint")
        )
        return self.spec.key(cfg, given)


PAIRS = StageCache(spec=stages.pairs.KEY)
REFERENCE = _ReferenceCache(spec=stages.reference.KEY)
TRAIN = StageCache(spec=stages.preference_train.KEY)
EVALUATE = _EvaluateCache(spec=stages.preference_evaluate.KEY)


@task(**stage_options(PAIRS, task_run_name="pairs"))
def pairs(cfg: RunConfig) -> PairsManifest:
    """Tokenize the preference pairs of cfg.data with the student's chat template."""
    with prefect_logs():
        return stages.pairs.run(cfg)


@task(**stage_options(REFERENCE, task_run_name="reference"))
def reference(cfg: RunConfig, student: StudentManifest, pairs: PairsManifest) -> ReferenceManifest:
    """Summed response log-probs of every pair under the frozen reference."""
    with prefect_logs():
        return stages.reference.run(cfg, student, pairs, bar)


@task(**stage_options(TRAIN, task_run_name="dpo-epoch-{epoch}"))
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


@task(**stage_options(EVALUATE, task_run_name="evaluate-{label}"))
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
