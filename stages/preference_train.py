"""preference_train: epochs of DPO-family steps (run.task: dpo), resumable from their checkpoints, with a step log.

Like stages/train.py: checkpoints in <workdir>/preference-train/<key>/ (every input but the epoch), steps
appended to steps.jsonl there before on_step sees them; the same checkpoint files, so stages/export.py exports
the selected one unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import stages.reference
import stages.train
from data.preferences import read_pair_rows
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest
from schemas.preferences import PairsManifest, ReferenceManifest
from stages.keys import StageKey
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar

if TYPE_CHECKING:
    from training.loop import StepRecord
    from training.preference import Reference

log = logging.getLogger(__name__)

FOLDER = "preference-train"
STEPS_FILE = "steps.jsonl"
OBJECTIVE = (
    "preference.beta",
    "preference.loss_type",
    "preference.label_smoothing",
    "preference.reference_free",
    "preference.gamma",
)
KEY = StageKey(
    stage="preference-train",
    version="1",
    config_fields=(*stages.train.EPOCH_FIELDS, *OBJECTIVE),
    inputs=("student", "pairs", "reference", "epoch"),
)


def checkpoint_root(
    cfg: RunConfig, student: StudentManifest, pairs: PairsManifest, reference: ReferenceManifest | None
) -> Path:
    return stage_dir(cfg, FOLDER, KEY.key(cfg, {"student": student, "pairs": pairs, "reference": reference}))


def split_reference(
    cfg: RunConfig, reference: ReferenceManifest | None, split: str, pair_ids: list[int]
) -> Reference | None:
    """The reference log-probs of a split's pairs in row order (None when reference_free)."""
    from training.preference import Reference

    if reference is None:
        return None
    return Reference(*stages.reference.read(cfg, reference, split, pair_ids))


def run_epoch(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    epoch: int,
    on_step: Callable[[StepRecord], None] | None = None,
    bar: BarFactory = no_bar,
) -> CheckpointManifest:
    """Train epoch `epoch` (0-based), resuming from the newest checkpoint; returns the epoch-end checkpoint."""
    from training.loop import epoch_dir
    from training.preference import train_epoch
    from training.schedule import steps_per_epoch

    root = workdir(cfg)
    rows = read_pair_rows(pairs.train.verify(root))
    ref = split_reference(cfg, reference, "train", rows.pair_id)
    ckpt_root = checkpoint_root(cfg, student, pairs, reference)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    with bar(f"dpo epoch {epoch}", steps_per_epoch(cfg, len(rows))) as b, open(ckpt_root / STEPS_FILE, "a") as fh:

        def step(rec: StepRecord) -> None:
            fh.write(json.dumps(dataclasses.asdict(rec)) + "\n")
            fh.flush()
            b.advance(1, loss=f"{rec.loss:.4f}", lr=f"{rec.lr:.2e}")
            if rec.step % 10 == 0 or rec.skipped:
                log.info("step %d loss %.4f grad norm %.3f lr %.2e", rec.step, rec.loss, rec.grad_norm, rec.lr)
            if on_step is not None:
                on_step(rec)

        manifest = train_epoch(
            cfg,
            student_gguf=student.path_in(root),
            rows=rows,
            reference=ref,
            seq_len=pairs.seq_len,
            ckpt_root=ckpt_root,
            epoch=epoch,
            on_step=step,
        )
    log.info("dpo epoch %d done: %s", epoch, manifest.metrics)
    return stages.train.relocated(manifest, epoch_dir(ckpt_root, epoch), root)


def run(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    on_step: Callable[[StepRecord], None] | None = None,
    bar: BarFactory = no_bar,
) -> list[CheckpointManifest]:
    """Every epoch in order: one epoch-end checkpoint per epoch."""
    return [run_epoch(cfg, student, pairs, reference, e, on_step, bar) for e in range(cfg.train.epochs)]
