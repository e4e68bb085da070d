"""The step schedule: optimizer steps per epoch, and the learning rate (linear warmup, then cosine / linear /
constant)."""

from __future__ import annotations

import math

from schemas.config import RunConfig


def steps_per_epoch(cfg: RunConfig, n_items: int) -> int:
    """Optimizer steps in one epoch over `n_items` training items (train.sequences_per_step per step, at most
    train.max_steps_per_epoch)."""
    steps = max(1, math.ceil(n_items / cfg.train.sequences_per_step))
    return min(steps, cfg.train.max_steps_per_epoch or steps)


# ---- schedule ---------------------------------------------------------------------------------------------
def learning_rate(cfg: RunConfig, step: int, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warmup, then cosine / linear / constant to min_lr_ratio."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    if o.schedule == "constant":
        return o.lr
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if o.schedule == "cosine" else 1 - frac
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * decay)
