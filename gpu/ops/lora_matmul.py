"""LoRA's skinny f32 products (gpu/kernels/lora_gemm.wgsl, lora_reduce.wgsl), deterministic.

C[m, n] (+)= alpha * A[m, k] . B[k, n] over strided operands, in the three shapes LoRA has:
- thin outputs with a long reduction (x A^T, dy B: [T, r] over d; dB, dA^T: [d, r] over T tokens);
- rank-r expansions (t B^T into y, dt A into dx: [T, d] with k = r).
The reduction axis is split over workgroups (`splits` chunks of whole BK steps) when one chunk per output tile
would leave the GPU idle; the partial sums go to a per-device scratch buffer and lora_reduce adds them in
ascending split order, then applies alpha / accumulate. The split depends only on the shape (and the adapter's
binding limit), so a result is bitwise the same run to run and engine to engine. No atomics.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

from gpu.codegen_lora import BM, LORA_GEMM_BK, ROWS_BK, ROWS_ROWS, STREAM_COLS
from gpu.device import Device, DeviceError, grid_1d
from gpu.ops.common import nbytes, pack
from gpu.ops.strided_matmul import Operand, check_operands
from gpu.registry import pipeline

TARGET_WORKGROUPS = 1024  # split the reduction until about this many workgroups run (an H200 has 132 SMs)
MIN_CHUNK = 128  # reduction steps per split at least (fewer would spend more on partials than on products)
SCRATCH_CAP = 32 << 20  # bytes of partial sums at most (fewer splits beyond it)
# the bandwidth paths (lora_stream.wgsl, lora_rows.wgsl) for thin outputs (n <= FAST_MAX_N) whose operands read
# as vec4s; off: every product on lora_gemm (bench/lora.py --paths, bench/train_step.py --ab lora-gemm-only)
FAST_PATHS = False  # measured slower on an H100 (2026-12-06, docs/benchmarks.md): opt-in
FAST_MAX_N = 64
STREAM_WORKGROUPS, STREAM_MIN_ROWS = 400, 64  # lora_stream: split the rows until about this many workgroups run
STREAM_UNROLL = 4  # lora_stream's rows loaded at a time (its variants: gpu/codegen_lora.py STREAM_UNROLLS)
ROWS_WORKGROUPS, ROWS_MIN_CHUNK = 800, 128  # lora_rows likewise, chunks of whole ROWS_BK steps

_scratch: weakref.WeakKeyDictionary[Device, Any] = weakref.WeakKeyDictionary()


def scratch_for(dev: Device, n_bytes: int) -> Any:
    """The device's partial-sum buffer, grown to n_bytes when smaller (built once per largest shape, so bind
    groups stay cached across steps)."""
    buf = _scratch.get(dev)
    if buf is None or buf.size < n_bytes:
        buf = dev.buffer(max(n_bytes, 4), label="lora partial sums")
        _scratch[dev] = buf
    return buf


def pick_splits(m: int, n: int, k: int, bn: int, max_bytes: int = SCRATCH_CAP) -> tuple[int, int]:
    """(splits, chunk) of the reduction axis for an m x n output: enough workgroups to fill the GPU, chunks of
    at least MIN_CHUNK whole BK steps, partials within max_bytes."""
    bk = LORA_GEMM_BK[bn]
    if k <= MIN_CHUNK:
        return 1, max(k, 1)
    tiles = math.ceil(m / BM) * math.ceil(n / bn)
    splits = min(math.ceil(TARGET_WORKGROUPS / tiles), math.ceil(k / MIN_CHUNK), max(1, max_bytes // (4 * m * n)))
    return chunked(k, max(splits, 1), bk)


def chunked(k: int, splits: int, bk: int) -> tuple[int, int]:
    """(splits, chunk) for about `splits` chunks of whole bk steps covering k (the last one may be shorter)."""
    chunk = math.ceil(math.ceil(k / splits) / bk) * bk
    return math.ceil(k / chunk), chunk


MAX_GROUPS = 4  # column groups of one lora_matmul (lora_gemm.wgsl's b_go / c_go)


def reduce_params(
    count: int,
    n: int,
    splits: int,
    c_off: int,
    csm: int,
    csn: int,
    alpha: float,
    accumulate: bool,
    groups: Any = None,
    half: HalfCopy | None = None,
) -> bytes:
    """lora_reduce.wgsl's uniform: count = M * N outputs of N columns from `splits` partials, written like
    lora_gemm's C (groups: ColumnGroups or None), and where `half` is given their f16 copy."""
    gw, _, c_go = _group_words(groups)
    h = half or HalfCopy(None, (0,), 0, 0.0)
    h_go = [*h.offsets, *[0] * (MAX_GROUPS - len(h.offsets))]
    return pack(
        count, n, splits, c_off, csm, csn, float(alpha), accumulate, gw, 0, 0, 0, *c_go, 0, h.ld,
        float(h.factor), 0, *h_go,
    )  # fmt: skip


@dataclass(frozen=True)
class HalfCopy:
    """An f16 copy of a lora_matmul result C [m, n] (the integer GEMM's LoRA operand t16, gpu/ops/lora.py):
    element (i, j) times `factor` at buf[offsets[g] + i * ld + j % width] for column j of group g (one group
    without column groups; ld >= the columns of a group). Written by lora_reduce beside C, or by lora_pack where
    the product is not split."""

    buf: Any
    offsets: tuple[int, ...]
    ld: int
    factor: float


@dataclass(frozen=True)
class ColumnGroups:
    """lora_matmul's columns in len(b_offsets) groups of `width`: column j is column j % width of group j // width,
    whose B and C start b_offsets[g] / c_offsets[g] elements past the operand's and c_off (products that share A,
    such as t = x A^T of the projections reading the same x, in one dispatch)."""

    width: int
    b_offsets: tuple[int, ...]
    c_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.width <= 0 or not 1 <= len(self.b_offsets) == len(self.c_offsets) <= MAX_GROUPS:
            raise DeviceError(f"lora_matmul: column groups {self} (width > 0, 1..{MAX_GROUPS} of each offset)")


def _group_words(groups: ColumnGroups | None) -> tuple[int, list[int], list[int]]:
    if groups is None:
        return 0, [0] * MAX_GROUPS, [0] * MAX_GROUPS
    pad = [0] * (MAX_GROUPS - len(groups.b_offsets))
    return groups.width, [*groups.b_offsets, *pad], [*groups.c_offsets, *pad]


def lora_matmul(
    dev: Device,
    a: Operand,
    b: Operand,
    c: Any,
    m: int,
    n: int,
    k: int,
    *,
    alpha: float = 1.0,
    accumulate: bool = False,
    c_off: int = 0,
    csm: int | None = None,
    csn: int = 1,
    splits: int | None = None,
    groups: ColumnGroups | None = None,
    half: HalfCopy | None = None,
) -> None:
    """C(i, j) = c[c_off + i * csm + j * csn] (+)= alpha * A[i, :] . B[:, j] for i < m, j < n (csm defaults to n:
    row-major; with groups, as ColumnGroups says). Tile width: 64 when n > 32 (expansions), else 16. `splits`
    overrides the reduction split (tests); by default pick_splits chooses it from the shape. half: also C's f16
    copy (HalfCopy; C row-major within each group)."""
    if min(m, n) <= 0:
        return
    csm = n if csm is None else csm
    if groups is None:
        check_operands("lora_matmul", a, b, m, n, k)
        last_c = c_off + (m - 1) * csm + (n - 1) * csn
    else:
        if n != groups.width * len(groups.b_offsets):
            raise DeviceError(f"lora_matmul: {n} columns are not {len(groups.b_offsets)} groups of {groups.width}")
        check_operands("lora_matmul", a, replace(b, off=b.off + max(groups.b_offsets)), m, groups.width, k)
        last_c = c_off + max(groups.c_offsets) + (m - 1) * csm + (groups.width - 1) * csn
    if nbytes(c) < 4 * (last_c + 1):
        raise DeviceError(f"lora_matmul: output C ({m} x {n}, strides {csm}, {csn}) exceeds its buffer's {nbytes(c)} B")
    if half is not None:
        _check_half(half, m, n, csm, csn, groups)
    path = fast_path(a, b, m, n, k, groups)
    if path:
        _fast(dev, path, a, b, c, (m, n, k), alpha, accumulate, (c_off, csm, csn), splits, groups, half)
        return
    bn = 64 if n > 32 else 16
    bk = LORA_GEMM_BK[bn]
    if splits is None:
        splits, chunk = pick_splits(m, n, k, bn, min(SCRATCH_CAP, dev.max_binding))
    else:
        splits, chunk = chunked(max(k, 1), splits, bk)
    gx, gy = math.ceil(m / BM), math.ceil(n / bn)
    if max(gx, gy, splits) > 65535:
        raise DeviceError(f"lora_matmul: {m} x {n} output needs a grid of {gx} x {gy} x {splits} (max 65535 each)")
    partial = splits > 1
    a_kfast, b_kfast = a.s1 == 1, b.s0 == 1
    gw, b_go, c_go = _group_words(groups)
    params = pack(
        m, n, k, chunk, a.off, a.s0, a.s1, b.off, b.s0, b.s1, c_off, csm, csn, alpha, accumulate, partial,
        a_kfast, b_kfast, gw, 0, *b_go, *c_go,
    )  # fmt: skip
    out = scratch_for(dev, 4 * splits * m * n) if partial else c
    dev.dispatch(pipeline(dev, "lora_gemm", bn=bn), [params, a.buf, b.buf, out], (gx, gy, splits))
    if partial:
        _reduce(dev, out, c, m, n, splits, (c_off, csm, csn), alpha, accumulate, groups, half)
    elif half is not None:
        _pack_half(dev, c, m, n, c_off, groups, half)


def _reduce(
    dev: Device,
    partials: Any,
    c: Any,
    m: int,
    n: int,
    splits: int,
    c_layout: tuple[int, int, int],
    alpha: float,
    accumulate: bool,
    groups: ColumnGroups | None,
    half: HalfCopy | None = None,
) -> None:
    """lora_reduce: C (+)= alpha * the sum of the `splits` partial [m, n] sums, in ascending split order (and
    its f16 copy where `half` is given)."""
    rparams = reduce_params(m * n, n, splits, *c_layout, alpha, accumulate, groups, half)
    pipe = pipeline(dev, "lora_reduce", half=half is not None)
    extra = [] if half is None else [half.buf]
    dev.dispatch(pipe, [rparams, partials, c, *extra], grid_1d(math.ceil(m * n / 256)))


def _check_half(half: HalfCopy, m: int, n: int, csm: int, csn: int, groups: ColumnGroups | None) -> None:
    """An f16 copy needs C row-major within each group (as t and dt are) and room for every group's rows."""
    width = n if groups is None else groups.width
    count = 1 if groups is None else len(groups.c_offsets)
    if csn != 1 or csm != width or len(half.offsets) != count or half.ld < width:
        raise DeviceError(
            f"lora_matmul: an f16 copy needs C row-major per group (csm {csm} = {width}, csn {csn} = 1), "
            f"{count} offsets (got {len(half.offsets)}) and rows of >= {width} (ld {half.ld})"
        )
    if nbytes(half.buf) < 2 * (max(half.offsets) + (m - 1) * half.ld + width):
        raise DeviceError(f"lora_matmul: the f16 copy of {m} x {width} exceeds its buffer's {nbytes(half.buf)} B")


def _pack_half(dev: Device, c: Any, m: int, n: int, c_off: int, groups: ColumnGroups | None, half: HalfCopy) -> None:
    """The f16 copy of an unsplit product (no lora_reduce pass to write it): lora_pack per group, from C."""
    width = n if groups is None else groups.width
    starts = (0,) if groups is None else groups.c_offsets
    for c_go, h_off in zip(starts, half.offsets, strict=True):
        items = m * half.ld
        prm = pack(items, m, width, half.ld, float(half.factor), 0, 0, 0, 0, 0.0, c_off + c_go, h_off)
        bindings = [prm, c, c, half.buf, _unused16(dev)]  # the second copy (L16) has no items
        dev.dispatch(pipeline(dev, "lora_pack"), bindings, grid_1d(math.ceil(items / 256)))


_unused: weakref.WeakKeyDictionary[Device, Any] = weakref.WeakKeyDictionary()


def _unused16(dev: Device) -> Any:
    """A small buffer for lora_pack's second output where it copies nothing."""
    buf = _unused.get(dev)
    if buf is None:
        buf = _unused[dev] = dev.buffer(16, label="lora_pack unused output")
    return buf


def fast_path(a: Operand, b: Operand, m: int, n: int, k: int, groups: ColumnGroups | None = None) -> str:
    """Which bandwidth kernel computes this product: "stream" (A read along m, each row of its k: dB = dY^T t,
    dA^T = x^T dt), "rows" / "rows_kfast" (A read along k: t = x A^T, dt = dY B; S row-major or k-fast), or ""
    (lora_gemm: strides or sizes that do not read as vec4s, wide outputs, FAST_PATHS off)."""
    aligned = a.off % 4 == 0 and b.off % 4 == 0 and n % 4 == 0
    if groups is not None:
        aligned = aligned and groups.width % 16 == 0 and all(o % 4 == 0 for o in groups.b_offsets)
    if not FAST_PATHS or n > FAST_MAX_N or not aligned:
        return ""
    if a.s0 == 1 and a.s1 % 4 == 0 and b.s1 == 1 and b.s0 % 4 == 0 and m % 4 == 0:
        return "stream"
    if a.s1 == 1 and a.s0 % 4 == 0 and k % 4 == 0:
        if b.s1 == 1 and b.s0 % 4 == 0:
            return "rows"
        if b.s0 == 1 and b.s1 % 4 == 0:
            return "rows_kfast"
    return ""


def fast_splits(tiles: int, m: int, n: int, k: int, path: str, max_bytes: int = SCRATCH_CAP) -> tuple[int, int]:
    """(splits, chunk) of the reduction for a bandwidth kernel with `tiles` output tiles (a function of the shape
    only: the same split every run)."""
    target, least, step = (
        (STREAM_WORKGROUPS, STREAM_MIN_ROWS, 1) if path == "stream" else (ROWS_WORKGROUPS, ROWS_MIN_CHUNK, ROWS_BK)
    )
    splits = min(math.ceil(target / tiles), math.ceil(k / least), max(1, max_bytes // (4 * m * n)))
    return chunked(max(k, 1), max(splits, 1), step)


def _fast(
    dev: Device,
    path: str,
    a: Operand,
    b: Operand,
    c: Any,
    mnk: tuple[int, int, int],
    alpha: float,
    accumulate: bool,
    c_layout: tuple[int, int, int],
    splits: int | None,
    groups: ColumnGroups | None,
    half: HalfCopy | None = None,
) -> None:
    """lora_matmul on lora_stream / lora_rows (and lora_reduce when the reduction is split)."""
    m, n, k = mnk
    c_off, csm, csn = c_layout
    rows = 4 * STREAM_COLS if path == "stream" else ROWS_ROWS
    grid = (math.ceil(n / 16), math.ceil(m / rows))
    if splits is None:
        splits, chunk = fast_splits(grid[0] * grid[1], m, n, k, path, min(SCRATCH_CAP, dev.max_binding))
    else:
        splits, chunk = chunked(max(k, 1), splits, 1 if path == "stream" else ROWS_BK)
    if max(*grid, splits) > 65535:
        raise DeviceError(f"lora_matmul: {m} x {n} output needs a grid of {grid} x {splits} (max 65535 each)")
    lda, ldb = (a.s1, b.s0) if path == "stream" else (a.s0, b.s0 if path == "rows" else b.s1)
    partial = splits > 1
    gw, b_go, c_go = _group_words(groups)
    params = pack(
        m, n, k, chunk, a.off, lda, b.off, ldb, c_off, csm, csn, alpha, accumulate, partial, gw, 0, *b_go, *c_go
    )
    out = scratch_for(dev, 4 * splits * m * n) if partial else c
    stream = ("lora_stream", {"unroll": STREAM_UNROLL})
    name, variant = stream if path == "stream" else ("lora_rows", {"s_kfast": path == "rows_kfast"})
    dev.dispatch(pipeline(dev, name, **variant), [params, a.buf, b.buf, out], (*grid, splits))
    if partial:
        _reduce(dev, out, c, m, n, splits, (c_off, csm, csn), alpha, accumulate, groups, half)
    elif half is not None:
        _pack_half(dev, c, m, n, c_off, groups, half)
