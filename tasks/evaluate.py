"""Held-out evaluation tasks (baseline, each epoch's checkpoint, a merged GGUF) and best-epoch selection."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, EvalManifest
from tasks.caching import StageCache, as_config, located, stage_options
from tasks.student import student_path

# What evaluation reads besides its inputs' content: the batching of the held-out split and the matmul path.
_EVAL_FIELDS = ("eval.eval_batches", "train.batch_size", "train.precision")

BASELINE = StageCache(
    stage="evaluate-baseline",
    version="1",
    config_fields=_EVAL_FIELDS,
    inputs=("student", "tokens", "teacher"),
)
EPOCH = StageCache(
    stage="evaluate",
    version="1",
    config_fields=(*_EVAL_FIELDS, "lora"),  # the adapter's layout and alpha/r scale
    inputs=("student", "tokens", "teacher", "checkpoint"),
)
MERGED = StageCache(
    stage="evaluate-merged", version="1", config_fields=_EVAL_FIELDS, inputs=("merged", "tokens", "teacher")
)


def _evaluate(
    cfg: RunConfig, gguf: Path, tokens: dict, teacher: dict, checkpoint: dict | None, label: str
) -> dict[str, Any]:
    from training.evaluation import evaluate

    ckpt = None if checkpoint is None else CheckpointManifest.model_validate(checkpoint["manifest"])
    metrics = evaluate(
        cfg,
        student_gguf=gguf,
        token_dir=located(cfg, tokens["dir"]),
        topk_dir=located(cfg, teacher["dir"]),
        checkpoint=None if checkpoint is None else located(cfg, checkpoint["dir"]),
    )
    manifest = EvalManifest(
        epoch=None if ckpt is None else ckpt.epoch,
        step=None if ckpt is None else ckpt.step,
        kl=metrics["kl"],
        top1=metrics["top1"],
        ce=metrics["ce"],
        ppl=metrics["ppl"],
        n_positions=int(metrics["tokens"]),
    )
    get_run_logger().info(
        "%s: KL %.4f, top-1 %.1f%%, CE %.4f (ppl %.2f) on %d positions",
        label,
        manifest.kl,
        100 * manifest.top1,
        manifest.ce,
        manifest.ppl,
        manifest.n_positions,
    )
    return manifest.model_dump(mode="json")


@task(**stage_options(BASELINE, task_run_name="evaluate-baseline"))
def evaluate_baseline(cfg: RunConfig, student: dict, tokens: dict, teacher: dict) -> dict[str, Any]:
    """The student without an adapter: the gap distillation starts from. Returns EvalManifest JSON."""
    cfg = as_config(cfg)
    return _evaluate(cfg, student_path(cfg, student), tokens, teacher, None, "baseline (no adapter)")


@task(**stage_options(EPOCH, task_run_name="evaluate-epoch-{checkpoint[manifest][epoch]}"))
def evaluate_checkpoint(cfg: RunConfig, student: dict, tokens: dict, teacher: dict, checkpoint: dict) -> dict[str, Any]:
    """The student with a checkpoint's adapter. Returns EvalManifest JSON."""
    cfg = as_config(cfg)
    epoch = checkpoint["manifest"]["epoch"]
    return _evaluate(cfg, student_path(cfg, student), tokens, teacher, checkpoint, f"epoch {epoch}")


@task(**stage_options(MERGED, task_run_name="evaluate-merged"))
def evaluate_merged(cfg: RunConfig, merged: dict, tokens: dict, teacher: dict) -> dict[str, Any]:
    """The merged GGUF (adapter folded into the weights, requantized) alone. Returns EvalManifest JSON."""
    cfg = as_config(cfg)
    return _evaluate(cfg, located(cfg, merged["path"]), tokens, teacher, None, "merged GGUF")


def select_best(cfg: RunConfig, evals: list[dict[str, Any]]) -> int:
    """Index of the best evaluation by cfg.eval.best_metric (ties: the earlier epoch)."""
    if not evals:
        raise ValueError("select_best: no evaluated checkpoints")
    metric = cfg.eval.best_metric
    sign = -1.0 if cfg.eval.higher_is_better else 1.0
    values = [sign * EvalManifest.model_validate(e).metric(metric) for e in evals]
    values = [v if math.isfinite(v) else math.inf for v in values]  # a diverged epoch is never the best
    return min(range(len(values)), key=lambda i: (values[i], i))
