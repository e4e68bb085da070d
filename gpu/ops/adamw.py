"""AdamW over one flat f32 parameter buffer with deterministic global grad-norm clipping and a non-finite
guard: a step whose loss or grad norm is not finite leaves params and moments untouched and sets a flag."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline
from schemas.optim import AdamWConfig, StepStats

__all__ = ["PER_WORKGROUP", "AdamW", "AdamWConfig", "StepStats"]  # the dataclasses live in schemas/optim.py

PER_WORKGROUP = 256 * 16  # gradient elements per partial sum (grad_norm_partial.wgsl)


class AdamW:
    """Optimizer state (m, v) for n_params f32 parameters, plus the scratch of the grad-norm passes."""

    def __init__(self, dev: Device, n_params: int, cfg: AdamWConfig) -> None:
        if n_params <= 0:
            raise ValueError(f"AdamW: n_params={n_params} must be positive")
        self.dev, self.n, self.cfg = dev, n_params, cfg
        self.m = dev.buffer(4 * n_params, label="adamw m")
        self.v = dev.buffer(4 * n_params, label="adamw v")
        self.n_partials = math.ceil(n_params / PER_WORKGROUP)
        self.partials = dev.buffer(4 * self.n_partials, label="adamw partial norms")
        self.stats = dev.buffer(16, label="adamw stats")  # norm, scale, skipped, loss
        self.hp = dev.buffer(32, label="adamw hyper-parameters")
        self.no_loss = dev.buffer(4, label="adamw zero loss")

    def hyper(self, step: int, lr: float) -> np.ndarray:
        """The Hp vector of adamw_update.wgsl for 1-based `step` (count of applied updates including this one)."""
        c = self.cfg
        bc1 = 1.0 - c.beta1**step
        bc2 = 1.0 - c.beta2**step
        vals = [lr, c.beta1, c.beta2, c.eps, 1.0 - lr * c.weight_decay, lr / bc1, 1.0 / math.sqrt(bc2), 0.0]
        return np.array(vals, dtype=np.float32)

    def step(
        self, params: Any, grads: Any, step: int, *, lr: float | None = None, loss: Any = None, loss_index: int = 0
    ) -> None:
        """Record one update of params from grads (both f32 [n_params]) into the current dev.step().
        `step` is 1-based and counts applied (not skipped) updates; `loss` (a GPU f32 buffer) joins the
        finiteness check. Read the outcome with read_stats()."""
        if step < 1:
            raise ValueError(f"AdamW.step: step={step} must be >= 1 (bias correction)")
        dev, n = self.dev, self.n
        need(params, n, "AdamW params")
        need(grads, n, "AdamW grads")
        loss_buf = self.no_loss if loss is None else loss
        need(loss_buf, loss_index + 1, "AdamW loss")
        dev.write(self.hp, self.hyper(step, self.cfg.lr if lr is None else lr))
        pipe = pipeline(dev, "grad_norm_partial")
        dev.dispatch(pipe, [pack(n, self.n_partials, 0, 0), grads, self.partials], grid(self.n_partials, 1))
        pipe = pipeline(dev, "adamw_finalize")
        params_fin = pack(self.n_partials, loss_index, float(self.cfg.max_grad_norm), 0)
        dev.dispatch(pipe, [params_fin, self.partials, loss_buf, self.stats], 1)
        pipe = pipeline(dev, "adamw_update")
        dev.dispatch(pipe, [pack(n, 0, 0, 0), self.hp, self.stats, grads, params, self.m, self.v], grid(n, 256))

    def read_stats(self) -> StepStats:
        """Wait for the GPU and read (grad_norm, clip_scale, skipped, loss) of the last step."""
        s = self.dev.read(self.stats, np.float32, (4,))
        return StepStats(float(s[0]), float(s[1]), bool(s[2] != 0), float(s[3]))
