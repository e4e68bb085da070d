"""LoRA adapter (PEFT convention) forward and backward on the GPU:
forward t = x A^T [T, r], y += s t B^T; backward dB = s dy^T t, dt = s dy B, dA = dt^T x, dx += dt A.
All products go through strided_matmul (fixed-order sums; the reductions over T run tile by tile)."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.strided_matmul import row_major, strided_matmul, transposed


def lora_forward(
    dev: Device, x: Any, a: Any, b: Any, t_out: Any, y: Any, n_tokens: int, d_in: int, d_out: int, r: int, scale: float
) -> None:
    """t_out [T, r] = x [T, in] . A^T (A [r, in]; kept for the backward), then y [T, out] += scale t . B^T
    (B [out, r]); y already holds the base projection x W^T."""
    strided_matmul(dev, row_major(x, d_in), transposed(a, d_in), t_out, n_tokens, r, d_in)
    strided_matmul(dev, row_major(t_out, r), transposed(b, r), y, n_tokens, d_out, r, alpha=scale, accumulate=True)


def lora_backward(
    dev: Device,
    dy: Any,
    x: Any,
    a: Any,
    b: Any,
    t: Any,
    da: Any,
    db: Any,
    dx: Any,
    dt: Any,
    n_tokens: int,
    d_in: int,
    d_out: int,
    r: int,
    scale: float,
    *,
    accumulate_grads: bool = False,
) -> None:
    """dB [out, r] = scale dy^T t; dt [T, r] (scratch) = scale dy B; dA [r, in] = dt^T x; dx [T, in] += dt A.
    accumulate_grads=True adds into dA / dB instead of overwriting them (gradient accumulation)."""
    acc = accumulate_grads
    strided_matmul(dev, transposed(dy, d_out), row_major(t, r), db, d_out, r, n_tokens, alpha=scale, accumulate=acc)
    strided_matmul(dev, row_major(dy, d_out), row_major(b, r), dt, n_tokens, r, d_out, alpha=scale)
    strided_matmul(dev, transposed(dt, r), row_major(x, d_in), da, r, d_in, n_tokens, accumulate=acc)
    strided_matmul(dev, row_major(dt, r), row_major(a, d_in), dx, n_tokens, d_in, r, accumulate=True)
