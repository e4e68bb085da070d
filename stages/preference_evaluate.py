"""preference_evaluate: held-out preference metrics of the student without and with each checkpoint's adapter
(run.task: dpo): preference loss, reward accuracy and margins, mean per-token KL(policy || reference); and the
selection of the best checkpoint (lowest held-out preference loss; ties: the earlier epoch)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from data.checkpoint import load_checkpoint
from data.preferences import read_pair_rows
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest
from schemas.preferences import PairsManifest, PreferenceEvalManifest, ReferenceManifest
from stages.keys import StageKey
from stages.layout import workdir
from stages.preference_train import OBJECTIVE, split_reference
from stages.progress import BarFactory, no_bar
from stages.reference import reference_gguf

log = logging.getLogger(__name__)

KEY = StageKey(
    stage="preference-evaluate",
    version="1",
    config_fields=(*OBJECTIVE, "eval.eval_batches", "train.batch_size", "train.backend", "lora"),
    inputs=("student", "pairs", "reference", "reference_sha256", "checkpoint"),
)


def key_inputs(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    checkpoint: CheckpointManifest | None,
) -> dict:
    return {
        "student": student,
        "pairs": pairs,
        "reference": reference,
        "reference_sha256": reference_gguf(cfg, student)[1],
        "checkpoint": checkpoint,
    }


def run(
    cfg: RunConfig,
    student: StudentManifest,
    pairs: PairsManifest,
    reference: ReferenceManifest | None,
    checkpoint: CheckpointManifest | None = None,
    bar: BarFactory = no_bar,
) -> PreferenceEvalManifest:
    """Metrics of the held-out pairs with the checkpoint's adapter (None: without adapter, the baseline)."""
    from training.preference import evaluate

    root = workdir(cfg)
    rows = read_pair_rows(pairs.eval.verify(root))
    ref = split_reference(cfg, reference, "eval", rows.pair_id)
    gguf, _, kind = reference_gguf(cfg, student)
    adapter = None if checkpoint is None else load_checkpoint(checkpoint.path_in(root))[0]
    label = "baseline (no adapter)" if checkpoint is None else f"epoch {checkpoint.epoch}"
    n = len(rows) if not cfg.eval.eval_batches else min(len(rows), cfg.eval.eval_batches * cfg.train.batch_size)
    with bar(f"evaluate {label}", n) as b:
        metrics = evaluate(
            cfg,
            student_gguf=student.path_in(root),
            rows=rows,
            reference=ref,
            reference_gguf=gguf if kind == "file" else None,
            seq_len=pairs.seq_len,
            adapter=adapter,
            max_batches=cfg.eval.eval_batches,
            on_batch=lambda k: b.advance(k),
        )
    manifest = PreferenceEvalManifest(
        epoch=None if checkpoint is None else checkpoint.epoch,
        step=None if checkpoint is None else checkpoint.step,
        **metrics,
    )
    log.info(
        "%s: loss %.4f, reward accuracy %.1f%%, margin %.4f, KL to reference %.5f on %d pairs",
        label, manifest.loss, 100 * manifest.reward_accuracy, manifest.margin, manifest.kl_reference, manifest.n_pairs,
    )  # fmt: skip
    return manifest


def select_best(evals: Sequence[PreferenceEvalManifest]) -> int:
    """Index of the lowest held-out preference loss (ties: the earlier epoch; never a diverged one)."""
    if not evals:
        raise ValueError("select_best: no evaluated checkpoints")
    values = [e.loss if math.isfinite(e.loss) else math.inf for e in evals]
    return min(range(len(values)), key=lambda i: (values[i], i))
