"""LoRA adapter (PEFT convention) forward and backward on the GPU:
forward t = x A^T [T, r], y += s t B^T; backward dB = s dy^T t, dt = s dy B, dA = dt^T x, dx += dt A.
The products run on LoRA's own kernels (gpu/ops/lora_matmul.py): the reductions over d and over the T tokens
split over many workgroups and summed in a fixed order (deterministic), the rank-r expansions 64 outputs wide."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.lora_matmul import lora_matmul
from gpu.ops.strided_matmul import row_major, transposed
from gpu.profile import scope


def lora_forward(
    dev: Device, x: Any, a: Any, b: Any, t_out: Any, y: Any, n_tokens: int, d_in: int, d_out: int, r: int, scale: float
) -> None:
    """t_out [T, r] = x [T, in] . A^T (A [r, in]; kept for the backward), then y [T, out] += scale t . B^T
    (B [out, r]); y already holds the base projection x W^T."""
    with scope(dev, "lora"):
        lora_matmul(dev, row_major(x, d_in), transposed(a, d_in), t_out, n_tokens, r, d_in)
        lora_matmul(dev, row_major(t_out, r), transposed(b, r), y, n_tokens, d_out, r, alpha=scale, accumulate=True)


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
    with scope(dev, "lora"):
        lora_matmul(dev, transposed(dy, d_out), row_major(t, r), db, d_out, r, n_tokens, alpha=scale, accumulate=acc)
        lora_matmul(dev, row_major(dy, d_out), row_major(b, r), dt, n_tokens, r, d_out, alpha=scale)
        # dA^T [in, r] = x^T dt, stored transposed into dA [r, in]
        lora_matmul(dev, transposed(x, d_in), row_major(dt, r), da, d_in, r, n_tokens, accumulate=acc, csm=1, csn=d_in)
        lora_matmul(dev, row_major(dt, r), row_major(a, d_in), dx, n_tokens, d_in, r, accumulate=True)
