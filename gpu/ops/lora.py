"""LoRA adapter (PEFT convention) forward and backward on the GPU:
forward t = x A^T [T, r], y += s t B^T; backward dB = s dy^T t, dt = s dy B, dA = dt^T x, dx += dt A.

The products are skinny (r = 16): their cost is memory traffic over [T, d] and the number of dispatches.
Two paths (`fused=`), both deterministic (fixed summation orders, no atomics), both within relative 1e-4 of
float64 (tests/test_gpu_lora_kernels.py, tests/test_gpu_lora_fused.py):
- split: every product on lora_matmul (gpu/ops/lora_matmul.py: long reductions split over many workgroups, then
  lora_reduce): forward 2-3 dispatches, backward 4-7.
- fused (r <= 64): each pair whose reduction runs over d (t then y; dt then dx) is one dispatch
  (gpu/ops/lora_fused.py: a workgroup per 16 token rows does both products); dB and dA^T (reductions over all T
  tokens) stay on lora_matmul: forward 1 dispatch, backward 5.
By default (fused=None) the fused path runs when FUSED is set and the rank is covered. FUSED is off: on the
H200 (2026-12-04, docs/benchmarks.md) the fused kernels made the TinyLlama-shape train step slower (LoRA 64.4 vs
54.0 ms per step, 11,487 vs 12,038 tokens/s; `bench/train_step.py --lora-path fused|split`): fewer dispatches,
but the fused forward took 89 us at d 2048 x 2048 against 35 + 9 + 35 for the split one's three.
lora_expand is the forward's second product alone, for a caller that kept t (the backward's recompute);
lora_project its first alone, for the integer GEMM that adds the second in its epilogue (lora_project_group: the
first products of the adapters whose projections share an input, in one pass over it; lora_da_group their dA);
lora_term packs that
epilogue's f16 operands (gpu/ops/matmul_i8.py LoraTerm) where the parameters' f16 mirrors do not hold them
(gpu/ops/lora_mirror.py: ranks that are no multiple of 16, or MIRRORS off); with the mirrors, t16 and dt16 come
from the products themselves (half=, gpu/ops/lora_matmul.py HalfCopy).
lora_group_sum is a mergeable adapter's projection of dA (model/reference.py lora_group_project)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu.device import BufferView, Device, DeviceError
from gpu.ops import lora_dual
from gpu.ops.common import grid, need, pack
from gpu.ops.lora_fused import covers, lora_fused
from gpu.ops.lora_matmul import ColumnGroups, HalfCopy, lora_matmul
from gpu.ops.matmul_i8 import LoraTerm
from gpu.ops.strided_matmul import row_major, transposed
from gpu.profile import scope
from gpu.registry import pipeline

FUSED = False  # the default path of lora_forward / lora_backward (where covers(T, r))


def lora_rank16(r: int) -> int:
    """The rank rounded up to the f16 MMA's K (16): a LoRA term's packed row length."""
    return -(-r // 16) * 16


def lora_term(
    dev: Device, t: Any, lo: Any, rows: int, cols: int, r: int, scale: float, layout: str, t16: Any, l16: Any
) -> LoraTerm:
    """Pack a LoRA term for gemm_i8 (gpu/kernels/lora_pack.wgsl, one dispatch): t16 = f16(scale * t) for t [rows, r]
    (f32), l16 = f16(L) for L (lo) stored as L^T [cols, r] ("rows") or L [r, cols] ("cols"); both zero padded to the
    rank rounded up to 16. Values past f16's range become inf (LoRA products are far inside it)."""
    if layout not in ("rows", "cols"):
        raise DeviceError(f"lora_term: layout {layout!r}, expected 'rows' or 'cols'")
    lr = lora_rank16(r)
    need(t, rows * r, "lora_term t")
    need(lo, cols * r, "lora_term L")
    need(t16, rows * lr, "lora_term t16", elem_bytes=2)
    need(l16, cols * lr, "lora_term l16", elem_bytes=2)
    l_shape = (cols, r, lr, cols) if layout == "rows" else (r, cols, cols, lr)  # rows1, cols1, cols1_p, rows1_p
    n0, n1 = rows * lr, l_shape[3] * l_shape[2]
    prm = pack(n0, rows, r, lr, float(scale), n1, l_shape[0], l_shape[1], l_shape[2], 1.0, 0, 0)
    dev.dispatch(pipeline(dev, "lora_pack"), [prm, t, lo, t16, l16], grid(n0 + n1, 256))
    return LoraTerm(t16, l16, lr, layout)


def _fused(fused: bool | None, n_tokens: int, r: int) -> bool:
    return FUSED and covers(n_tokens, r) if fused is None else fused


def lora_forward(
    dev: Device,
    x: Any,
    a: Any,
    b: Any,
    t_out: Any,
    y: Any,
    n_tokens: int,
    d_in: int,
    d_out: int,
    r: int,
    scale: float,
    *,
    fused: bool | None = None,
) -> None:
    """t_out [T, r] = x [T, in] . A^T (A [r, in]; kept for the backward), then y [T, out] += scale t . B^T
    (B [out, r]); y already holds the base projection x W^T. fused=True: one dispatch (r <= 64, else
    DeviceError); False: two products on lora_matmul; None: see the module docstring."""
    with scope(dev, "lora"):
        if _fused(fused, n_tokens, r):
            lora_fused(
                dev, x, transposed(a, d_in), transposed(b, r), t_out, y, n_tokens, d_in, d_out, r, alpha1=1.0,
                alpha2=float(scale),
            )  # fmt: skip
            return
        lora_project(dev, x, a, t_out, n_tokens, d_in, r)
        lora_expand(dev, t_out, b, y, n_tokens, d_out, r, scale)


def lora_project(
    dev: Device, x: Any, a: Any, t_out: Any, n_tokens: int, d_in: int, r: int, *, half: HalfCopy | None = None
) -> None:
    """t_out [T, r] = x [T, in] . A^T (A [r, in]): lora_forward's first product alone, for a caller that adds
    scale t . B^T itself (the integer GEMM's LoRA epilogue, gpu/ops/matmul_i8.py LoraTerm; half: its t16 too)."""
    with scope(dev, "lora"):
        lora_matmul(dev, row_major(x, d_in), transposed(a, d_in), t_out, n_tokens, r, d_in, half=half)


def lora_project_group(
    dev: Device,
    x: Any,
    a: Sequence[BufferView],
    t: Sequence[BufferView],
    n_tokens: int,
    d_in: int,
    r: int,
    *,
    half: HalfCopy | None = None,
) -> None:
    """t_g [T, r] = x A_g^T for adapters whose projections share the input x (q, k, v; gate, up): one product over
    x for all of them (lora_matmul's column groups), x read once. A_g [r, d_in]: views of one buffer (the
    parameters), t_g: views of one buffer (the kept t's); half: their f16 copies too (an offset per group)."""
    a_span, a_offs = view_span(a, "A")
    t_span, t_offs = view_span(t, "t")
    groups = ColumnGroups(r, a_offs, t_offs)
    with scope(dev, "lora"):
        lora_matmul(
            dev, row_major(x, d_in), transposed(a_span, d_in), t_span, n_tokens, r * len(a), d_in, csm=r,
            groups=groups, half=half,
        )  # fmt: skip


def lora_da_group(
    dev: Device,
    x: Any,
    dt: Sequence[BufferView],
    da: Sequence[BufferView],
    n_tokens: int,
    d_in: int,
    r: int,
    *,
    accumulate: bool = False,
) -> None:
    """dA_g [r, d_in] (+)= dt_g^T x for adapters whose projections share the input x, in one product over x
    (lora_backward's dA for each, with_da=False there). dt_g [T, r]: views of one buffer; dA_g: views of one buffer
    (the gradients)."""
    dt_span, dt_offs = view_span(dt, "dt")
    da_span, da_offs = view_span(da, "dA")
    groups = ColumnGroups(r, dt_offs, da_offs)
    with scope(dev, "lora"):
        lora_matmul(
            dev, transposed(x, d_in), row_major(dt_span, r), da_span, d_in, r * len(dt), n_tokens,
            accumulate=accumulate, csm=1, csn=d_in, groups=groups,
        )  # fmt: skip


def view_span(views: Sequence[BufferView], what: str) -> tuple[BufferView, tuple[int, ...]]:
    """One view over 4-byte aligned views of the same buffer, and each one's float offset in it."""
    if not views or any(v.buffer is not views[0].buffer or v.offset % 4 for v in views):
        raise DeviceError(f"LoRA column groups: the {what} views must be 4-byte aligned views of one buffer")
    start, end = min(v.offset for v in views), max(v.offset + v.nbytes for v in views)
    return BufferView(views[0].buffer, start, end - start), tuple((v.offset - start) // 4 for v in views)


def lora_expand(dev: Device, t: Any, b: Any, y: Any, n_tokens: int, d_out: int, r: int, scale: float) -> None:
    """y [T, out] += scale t . B^T (t [T, r], B [out, r]): lora_forward's second product alone, for a caller
    that still holds t = x A^T (the backward's recompute of a block, gpu/student.py)."""
    with scope(dev, "lora"):
        lora_matmul(dev, row_major(t, r), transposed(b, r), y, n_tokens, d_out, r, alpha=scale, accumulate=True)


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
    fused: bool | None = None,
    group: int = 0,
    da_scratch: Any = None,
    with_da: bool = True,
    dt16: HalfCopy | None = None,
    dt_ready: bool = False,
    db_ready: bool = False,
) -> None:
    """dB [out, r] = scale dy^T t; dt [T, r] (scratch) = scale dy B; dA [r, in] = dt^T x; dx [T, in] += dt A
    (dx None: not done here, the caller adds dt A itself: the integer GEMM's LoRA epilogue).
    accumulate_grads=True adds into dA / dB instead of overwriting them (gradient accumulation). fused=True: dt
    and dx in one dispatch (r <= 64); False: four products on lora_matmul; None: see the module docstring.
    group > 0 (a mergeable adapter): dt^T x goes to da_scratch ([r, in] floats at least) and dA gets its
    group sums (lora_group_sum), the gradient of A's group values. with_da=False: no dA here (the caller runs
    lora_da_group over the adapters sharing x). dt16: dt's f16 copy too (the integer GEMM's LoRA term). dt_ready: dt
    is already there (gpu/ops/lora_i8.py, from dY's int8 codes): dB and dA only (dx None); db_ready: so is dB
    (gpu/ops/lora_db_i8.py)."""
    acc = accumulate_grads
    if group and da_scratch is None:
        raise DeviceError("lora_backward: a mergeable adapter (group > 0) needs da_scratch")
    if (dt16 is not None or dt_ready) and dx is not None:
        raise DeviceError("lora_backward: dt16 and dt_ready are for a caller that adds dt A itself (dx None)")
    with scope(dev, "lora"):
        fuse = dx is not None and _fused(fused, n_tokens, r)
        if lora_dual.DUAL and lora_dual.covers(r) and not fuse and dt16 is None and not dt_ready:  # dB, dt in one pass
            lora_dual.lora_dual(dev, dy, t, b, dt, db, n_tokens, d_out, scale, accumulate=acc)
        else:
            if not db_ready:
                dy_t = transposed(dy, d_out)
                lora_matmul(dev, dy_t, row_major(t, r), db, d_out, r, n_tokens, alpha=scale, accumulate=acc)
            if fuse:
                lora_fused(
                    dev, dy, row_major(b, r), row_major(a, d_in), dt, dx, n_tokens, d_out, d_in, r,
                    alpha1=float(scale), alpha2=1.0,
                )  # fmt: skip
            elif not dt_ready:
                lora_matmul(dev, row_major(dy, d_out), row_major(b, r), dt, n_tokens, r, d_out, alpha=scale, half=dt16)
        # dA^T [in, r] = x^T dt, stored transposed into dA [r, in]
        if with_da and group:
            lora_matmul(dev, transposed(x, d_in), row_major(dt, r), da_scratch, d_in, r, n_tokens, csm=1, csn=d_in)
            lora_group_sum(dev, da_scratch, da, r * d_in, group, accumulate=acc)
        elif with_da:
            lora_matmul(
                dev, transposed(x, d_in), row_major(dt, r), da, d_in, r, n_tokens, accumulate=acc, csm=1, csn=d_in
            )
        if dx is not None and not fuse:
            lora_matmul(dev, row_major(dt, r), row_major(a, d_in), dx, n_tokens, d_in, r, accumulate=True)


def lora_group_sum(dev: Device, x: Any, y: Any, n: int, group: int, *, accumulate: bool = False) -> None:
    """y[i] (+)= the sum of x over the group of `group` consecutive elements holding i, for i < n (n a multiple
    of group): dA [r, in] of a mergeable adapter projected onto group-constant matrices (the gradient of A's
    group values). y must not alias x."""
    if group <= 0 or n % group:
        raise DeviceError(f"lora_group_sum: {n} elements are not whole groups of {group}")
    need(x, n, "lora_group_sum x")
    need(y, n, "lora_group_sum y")
    with scope(dev, "lora"):
        dev.dispatch(pipeline(dev, "lora_group_sum", acc=accumulate), [pack(n, 0.0, group, 0), x, y], grid(n, 256))
