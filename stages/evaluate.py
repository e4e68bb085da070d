"""evaluate: held-out metrics of the student (baseline), of each epoch's checkpoint and of a merged GGUF; and
the choice of the best epoch."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from schemas.config import RunConfig
from schemas.manifests import (
    CheckpointManifest,
    EvalManifest,
    FileRef,
    PrefixManifest,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
)
from stages.keys import StageKey
from stages.layout import workdir
from stages.progress import BarFactory, no_bar

log = logging.getLogger(__name__)

# What evaluation reads besides its inputs' content: the batching of the held-out split, the engine and its
# matmul path, and whether the input of the lowest adapted block comes from the float16 prefix cache.
_EVAL_FIELDS = (
    "eval.eval_batches",
    "eval.precision",
    "train.batch_size",
    "train.precision",
    "train.backend",
    "train.prefix_cache",
)
_EVAL_VERSION = "2"  # 2: + ece (the student's top-1 calibration)

BASELINE_KEY = StageKey(
    stage="evaluate-baseline",
    version=_EVAL_VERSION,
    config_fields=_EVAL_FIELDS,
    inputs=("student", "tokens", "teacher"),
)
CHECKPOINT_KEY = StageKey(
    stage="evaluate",
    version=_EVAL_VERSION,
    config_fields=(*_EVAL_FIELDS, "lora"),  # the adapter's layout and alpha/r scale
    inputs=("student", "tokens", "teacher", "checkpoint"),
)
MERGED_KEY = StageKey(
    stage="evaluate-merged", version=_EVAL_VERSION, config_fields=_EVAL_FIELDS, inputs=("merged", "tokens", "teacher")
)


def _evaluate(
    cfg: RunConfig,
    gguf: Path,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    checkpoint: CheckpointManifest | None,
    label: str,
    prefix: PrefixManifest | None,
    bar: BarFactory,
) -> EvalManifest:
    from training.evaluation import evaluate

    root = workdir(cfg)
    n_seq = tokens.eval.n_sequences
    if cfg.eval.eval_batches:
        n_seq = min(n_seq, cfg.eval.eval_batches * cfg.train.batch_size)
    with bar(f"evaluate {label}", n_seq) as b:
        metrics = evaluate(
            cfg,
            student_gguf=gguf,
            token_dir=tokens.path_in(root),
            topk_dir=teacher.path_in(root),
            checkpoint=None if checkpoint is None else checkpoint.path_in(root),
            prefix_dir=None if prefix is None else prefix.path_in(root),
            on_batch=lambda n: b.advance(n),
        )
    manifest = EvalManifest(
        epoch=None if checkpoint is None else checkpoint.epoch,
        step=None if checkpoint is None else checkpoint.step,
        kl=metrics["kl"],
        top1=metrics["top1"],
        ce=metrics["ce"],
        ppl=metrics["ppl"],
        n_positions=int(metrics["tokens"]),
        ece=metrics.get("ece"),
        ece_teacher=metrics.get("ece_teacher"),
    )
    log.info(
        "%s: KL %.4f, top-1 %.1f%%, CE %.4f (ppl %.2f), ECE %s on %d positions",
        label,
        manifest.kl,
        100 * manifest.top1,
        manifest.ce,
        manifest.ppl,
        "–" if manifest.ece is None else f"{manifest.ece:.4f}",
        manifest.n_positions,
    )
    return manifest


def run(
    cfg: RunConfig,
    student: StudentManifest,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    checkpoint: CheckpointManifest | None = None,
    bar: BarFactory = no_bar,
) -> EvalManifest:
    """The student with a checkpoint's adapter, or without one (checkpoint None: the baseline, the gap
    distillation starts from); from the frozen-prefix cache when it applies (stages/prefix.py)."""
    import stages.prefix

    label = "baseline (no adapter)" if checkpoint is None else f"epoch {checkpoint.epoch}"
    prefix = stages.prefix.cache(cfg, student, tokens)
    return _evaluate(cfg, student.path_in(workdir(cfg)), tokens, teacher, checkpoint, label, prefix, bar)


def run_merged(
    cfg: RunConfig, merged: FileRef, tokens: TokenizeManifest, teacher: TeacherManifest, bar: BarFactory = no_bar
) -> EvalManifest:
    """A merged GGUF (adapter folded into the weights, requantized) alone: the whole forward (its blocks below
    the adapted ones were requantized too, so the student's prefix cache does not apply)."""
    return _evaluate(cfg, merged.resolve(workdir(cfg)), tokens, teacher, None, "merged GGUF", None, bar)


KEEPS_TOO_LITTLE = 0.5  # a merged GGUF keeping less of its adapter's held-out KL gain than this is warned about


def gain_kept(baseline_kl: float, adapter_kl: float, merged_kl: float) -> float | None:
    """The fraction of the adapter's held-out KL gain the merged GGUF keeps: (baseline - merged) / (baseline -
    adapter); None when the adapter gained nothing (nothing to keep)."""
    gain = baseline_kl - adapter_kl
    if not gain > 0:
        return None
    return (baseline_kl - merged_kl) / gain


def gain_note(kept: float | None, lora_kind: str) -> str | None:
    """One line for the report and the console: the gain a merged GGUF keeps, with a warning below half."""
    if kept is None:
        return None
    line = f"The merged GGUF keeps {100 * kept:.0f}% of the adapter's held-out KL gain."
    if kept < KEEPS_TOO_LITTLE:
        hint = (
            "re-quantizing W + BA rounds most of a LoRA update away: train with lora.kind mergeable, whose update "
            "folds exactly into the quantized blocks, or merge into 8 bits (distillery merge --quant Q8_0)"
            if lora_kind == "plain"
            else "look for a bug: a mergeable adapter's fold is exact up to f16 rounding"
        )
        line += f" Warning: less than {100 * KEEPS_TOO_LITTLE:.0f}%; {hint}."
    return line


def select_best(cfg: RunConfig, evals: Sequence[EvalManifest]) -> int:
    """Index of the best evaluation by cfg.eval.best_metric (ties: the earlier epoch; never a diverged one)."""
    if not evals:
        raise ValueError("select_best: no evaluated checkpoints")
    sign = -1.0 if cfg.eval.higher_is_better else 1.0
    values = [sign * e.metric(cfg.eval.best_metric) for e in evals]
    values = [v if math.isfinite(v) else math.inf for v in values]
    return min(range(len(values)), key=lambda i: (values[i], i))
