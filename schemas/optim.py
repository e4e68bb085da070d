"""The optimizer's hyper-parameters and the outcome of one step, shared by both engines (cpu/adamw.py,
gpu/ops/adamw.py) and whatever drives them; plain dataclasses, so importing them needs no GPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters (PyTorch AdamW names); max_grad_norm <= 0 disables clipping."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class StepStats:
    """What the finalize pass wrote: the pre-clip grad norm, the clip scale, whether the step was skipped."""

    grad_norm: float
    clip_scale: float
    skipped: bool
    loss: float
