"""LoRA adapter (PEFT convention) forward and backward on the GPU:
forward t = x A^T [T, r], y += s t B^T; backward dB = s dy^T t, dt = s dy B, dA = dt^T x, dx += dt A.

The products are tiny (r = 16), so their cost is mostly the number of dispatches. Two paths, both deterministic
(fixed summation orders, no atomics), both within relative 1e-4 of float64 (tests/test_gpu_lora_kernels.py,
tests/test_gpu_lora_fused.py):
- split (`lora_forward_split` / `lora_backward_split`): every product on lora_matmul (gpu/ops/lora_matmul.py:
  long reductions split over many workgroups, then lora_reduce): forward 2-3 dispatches, backward 4-7.
- fused (`lora_forward_fused` / `lora_backward_fused`, r <= 64): each pair whose reduction runs over d (t then
  y; dt then dx) is one dispatch (gpu/ops/lora_fused.py: a workgroup per 16 token rows does both products); dB
  and dA^T (reductions over all T tokens) stay on lora_matmul: forward 1 dispatch, backward 5.
lora_forward / lora_backward take the fused path when FUSED is set and the rank is covered, else the split one.
FUSED stays off until bench/lora.py on the H200 shows the fused kernels faster at the TinyLlama and SmolLM2
shapes (issue 8; not yet measured)."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.lora_fused import covers, lora_fused
from gpu.ops.lora_matmul import lora_matmul
from gpu.ops.strided_matmul import row_major, transposed
from gpu.profile import scope

FUSED = False  # lora_forward / lora_backward on the fused kernels (where covers(T, r))


def lora_forward(
    dev: Device, x: Any, a: Any, b: Any, t_out: Any, y: Any, n_tokens: int, d_in: int, d_out: int, r: int, scale: float
) -> None:
    """t_out [T, r] = x [T, in] . A^T (A [r, in]; kept for the backward), then y [T, out] += scale t . B^T
    (B [out, r]); y already holds the base projection x W^T."""
    fn = lora_forward_fused if FUSED and covers(n_tokens, r) else lora_forward_split
    fn(dev, x, a, b, t_out, y, n_tokens, d_in, d_out, r, scale)


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
    fn = lora_backward_fused if FUSED and covers(n_tokens, r) else lora_backward_split
    fn(dev, dy, x, a, b, t, da, db, dx, dt, n_tokens, d_in, d_out, r, scale, accumulate_grads=accumulate_grads)


def lora_forward_split(
    dev: Device, x: Any, a: Any, b: Any, t_out: Any, y: Any, n_tokens: int, d_in: int, d_out: int, r: int, scale: float
) -> None:
    """lora_forward as two products on lora_matmul (x A^T, split + reduce when d_in is long; then t B^T into y)."""
    with scope(dev, "lora"):
        lora_matmul(dev, row_major(x, d_in), transposed(a, d_in), t_out, n_tokens, r, d_in)
        lora_matmul(dev, row_major(t_out, r), transposed(b, r), y, n_tokens, d_out, r, alpha=scale, accumulate=True)


def lora_forward_fused(
    dev: Device, x: Any, a: Any, b: Any, t_out: Any, y: Any, n_tokens: int, d_in: int, d_out: int, r: int, scale: float
) -> None:
    """lora_forward in one dispatch (r <= 64: gpu/ops/lora_fused.py; raises DeviceError beyond)."""
    with scope(dev, "lora"):
        lora_fused(
            dev, x, transposed(a, d_in), transposed(b, r), t_out, y, n_tokens, d_in, d_out, r, alpha1=1.0,
            alpha2=float(scale),
        )  # fmt: skip


def lora_backward_split(
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
    """lora_backward as four products on lora_matmul."""
    acc = accumulate_grads
    with scope(dev, "lora"):
        lora_matmul(dev, transposed(dy, d_out), row_major(t, r), db, d_out, r, n_tokens, alpha=scale, accumulate=acc)
        lora_matmul(dev, row_major(dy, d_out), row_major(b, r), dt, n_tokens, r, d_out, alpha=scale)
        # dA^T [in, r] = x^T dt, stored transposed into dA [r, in]
        lora_matmul(dev, transposed(x, d_in), row_major(dt, r), da, d_in, r, n_tokens, accumulate=acc, csm=1, csn=d_in)
        lora_matmul(dev, row_major(dt, r), row_major(a, d_in), dx, n_tokens, d_in, r, accumulate=True)


def lora_backward_fused(
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
    """lora_backward with dt = scale dy B and dx += dt A in one dispatch (r <= 64); dB and dA^T on lora_matmul."""
    acc = accumulate_grads
    with scope(dev, "lora"):
        lora_matmul(dev, transposed(dy, d_out), row_major(t, r), db, d_out, r, n_tokens, alpha=scale, accumulate=acc)
        lora_fused(
            dev, dy, row_major(b, r), row_major(a, d_in), dt, dx, n_tokens, d_out, d_in, r, alpha1=float(scale),
            alpha2=1.0,
        )  # fmt: skip
        # dA^T [in, r] = x^T dt (dt as the fused dispatch wrote it), stored transposed into dA [r, in]
        lora_matmul(dev, transposed(x, d_in), row_major(dt, r), da, d_in, r, n_tokens, accumulate=acc, csm=1, csn=d_in)
