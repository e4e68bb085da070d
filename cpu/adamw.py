"""AdamW over one flat float32 parameter array, the semantics of gpu/ops/adamw.py + adamw_*.wgsl in numpy.

Global grad-norm clipping (scale = min(1, max_norm / (norm + 1e-6)), off when max_norm <= 0), decoupled weight
decay, bias corrections folded into the step size in float64 on the host; a step whose loss or grad norm is not
finite leaves parameters and moments untouched and reports skipped. Updates run in place, in float32.
"""

from __future__ import annotations

import math

import numpy as np

from schemas.optim import AdamWConfig, StepStats


class NumpyAdamW:
    """Moments m, v [n] float32 and one update per call of step()."""

    def __init__(self, n_params: int, cfg: AdamWConfig) -> None:
        if n_params <= 0:
            raise ValueError(f"AdamW: n_params={n_params} must be positive")
        self.n, self.cfg = n_params, cfg
        self.m = np.zeros(n_params, np.float32)
        self.v = np.zeros(n_params, np.float32)
        self._g = np.empty(n_params, np.float32)
        self._t = np.empty(n_params, np.float32)

    def hyper(self, step: int, lr: float) -> np.ndarray:
        """(lr, b1, b2, eps, 1 - lr wd, lr / bc1, 1 / sqrt(bc2)) for 1-based `step`, as adamw_update.wgsl's Hp."""
        c = self.cfg
        bc1, bc2 = 1.0 - c.beta1**step, 1.0 - c.beta2**step
        vals = [lr, c.beta1, c.beta2, c.eps, 1.0 - lr * c.weight_decay, lr / bc1, 1.0 / math.sqrt(bc2)]
        return np.array(vals, dtype=np.float32)

    def step(self, params: np.ndarray, grads: np.ndarray, step: int, lr: float, loss: float) -> StepStats:
        """Update params in place from grads (both float32 [n]); `step` is 1-based and counts applied updates."""
        if step < 1:
            raise ValueError(f"AdamW.step: step={step} must be >= 1 (bias correction)")
        norm = float(np.sqrt(np.dot(grads.astype(np.float64), grads.astype(np.float64))))
        scale = 1.0
        if self.cfg.max_grad_norm > 0:
            scale = min(1.0, self.cfg.max_grad_norm / (norm + 1e-6))
        if not (math.isfinite(norm) and math.isfinite(loss)):
            return StepStats(norm, 0.0, True, loss)
        _, b1, b2, eps, decay, step_size, inv_sqrt_bc2 = self.hyper(step, lr)
        one = np.float32(1.0)
        g, t = self._g, self._t
        np.multiply(grads, np.float32(scale), out=g)
        self.m *= b1  # m = b1 m + (1 - b1) g
        np.multiply(g, one - b1, out=t)
        self.m += t
        self.v *= b2  # v = b2 v + (1 - b2) g^2
        np.multiply(g, one - b2, out=t)
        t *= g
        self.v += t
        np.sqrt(self.v, out=t)  # p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        t *= inv_sqrt_bc2
        t += eps
        np.divide(self.m, t, out=t)
        t *= step_size
        params *= decay
        params -= t
        return StepStats(norm, scale, False, loss)
