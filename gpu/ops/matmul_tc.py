"""Tensor-core matmul through a frozen (quantized) weight: Y = X.W^T and dX = dY.W with f16 operands and f32
accumulation (Dawn subgroup matrices). Same call shape as gpu/ops/matmul.py's gemm, minus trans_a.

Numerics: A and the dequantized W are rounded to f16 (|x| > 65504 overflows), products accumulate in f32;
the result matches float64 on the f16-rounded operands to ~1e-5 relative (DESIGN.md, mixed precision)."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

from gpu.codegen_tc import MATRIX, SUBGROUP_SIZE, TCConfig, TCVariant, matmul_tc_source
from gpu.device import SUBGROUP_MATRIX, Device, DeviceError
from gpu.ops.common import nbytes
from gpu.ops.matmul import gemm_shape
from gpu.weights import QuantTensor

# Presets, measured on an H200 (docs/benchmarks.md, 2026-12-03): TC_TILE, 256 x 128 (4 x 2 subgroups of 4 x 4
# matrices, BK = 32, one buffer + register prefetch): the staging (global -> registers -> scalar f16 stores to
# workgroup memory), not the MMAs, bounds the kernel (bench/tc_ceiling.py), and a larger tile stages fewer bytes
# per product: Q4_K, f16 A, M = 4096, 2048 -> 2048 / 5632 / 5632 -> 2048: "nt" 132.7 / 130.4 / 142.9 TFLOP/s,
# "nn" 121.6 / 126.3 / 115.6, vs the former 128 x 128 two-buffer tile's 120.4 / 120.7 / 129.2 and 91.3 / 90.2 /
# 86.5 in the same run. bench/gemm_tc.py --sweep compares candidates.
TC_TILE = TCConfig(sg_m=4, sg_n=2, tm=4, tn=4, bk=32, stages=1, vec=8)
# Grids of TC_TILE with fewer workgroups than this leave multiprocessors idle: a 128 x 64 tile instead, 4 x 2
# subgroups of 2 x 2 matrices (74.3 vs 43.8 TFLOP/s for a 64 x 64 tile at the k / v projections, 4096 x 2048 ->
# 256; split-K was slower). Measured crossover: TC_TILE wins at 80 workgroups (4096 x 576 -> 576: 54.8 vs 49.6
# "nt", 51.8 vs 44.2 "nn"), loses at 64 (1024 x 2048 -> 2048: 68.0 vs 80.2 "nt").
TC_TILE_MIN_GRID = 80
TC_TILE_NARROW = TCConfig(sg_m=4, sg_n=2, tm=2, tn=2, bk=32, stages=2, vec=8)
# Small M (decode): its speed is bound by reading W.
TC_TILE_SMALL_M = TCConfig(sg_m=1, sg_n=4, tm=1, tn=2, bk=32, stages=1, vec=8)
# Lavapipe-sized tile for the emulated kernel (tests of the indexing without tensor cores).
EMU_TILE = TCConfig(sg_m=2, sg_n=1, tm=1, tn=2, bk=32, stages=2, vec=8)


def pick_config(m: int, p: int | None = None) -> TCConfig:
    """The tile preset for m rows of A and p columns of C (None: assume a wide C)."""
    if m <= 16:
        return TC_TILE_SMALL_M
    if p is not None and -(-m // TC_TILE.bm) * -(-p // TC_TILE.bn) < TC_TILE_MIN_GRID:
        return TC_TILE_NARROW
    return TC_TILE


def a_width(a_dtype: str, lda: int, a_offset: int, last: int, binding_bytes: int) -> int:
    """The widest A load (elements) that lda, a_offset and A's binding allow; `last` = index of the last
    element read. A binding of vec4s exposes only whole vectors, so the last one must lie inside it."""
    esize = 4 if a_dtype == "f32" else 2
    for width in (8, 4) if a_dtype == "f16" else (4,):
        vec_bytes = width * esize
        if lda % width == 0 and a_offset % width == 0 and (last // width + 1) * vec_bytes <= binding_bytes:
            return width
    return 1


def variant_for(
    w_type: str, w_k: int, orient: str, cfg: TCConfig, a_dtype: str, a_w: int, accumulate: bool
) -> TCVariant:
    """The kernel variant gemm_tc dispatches for a weight of type w_type with row length w_k."""
    return TCVariant(
        w_type,
        orient,
        cfg,
        a_dtype,
        min(a_w, cfg.vec),
        accumulate,
        w_wide=w_type == "F16" and w_k % 8 == 0,
        b_fast=orient == "nt" or (w_k % cfg.vec == 0 and w_k >= cfg.vec),
    )


def all_variants(cfg: TCConfig, w_types: list[str]) -> list[TCVariant]:
    """Every variant gemm_tc can dispatch with tile cfg for these weight types (for compile checks and the
    kernel registry)."""
    out = set()
    cfgs = {cfg, replace(cfg, direct=False)}  # a C smaller than one matrix takes the checked epilogue only
    for w_type, tile in ((t, c) for t in w_types for c in cfgs):
        for w_k in (256, 260):
            for orient in ("nt", "nn"):
                for a_dtype, widths in (("f32", (4, 1)), ("f16", (8, 4, 1))):
                    for a_w in widths:
                        for acc in (False, True):
                            out.add(variant_for(w_type, w_k, orient, tile, a_dtype, a_w, acc))
    return sorted(out, key=str)


F16_MATRIX = ("f16", "f32", 16, 16, 16)  # (component, result, M, N, K) of the config gemm_tc is generated for


def matrix_config(dev: Device, shape: tuple = F16_MATRIX) -> dict[str, Any] | None:
    """The adapter's subgroup-matrix config of `shape` (component, result, M, N, K), with its subgroup sizes, or
    None."""
    if dev.backend != "dawn":
        return None
    try:
        from wgpudawn.backends.dawn import extras

        configs = extras.get_adapter_properties(dev.adapter).get("subgroup_matrix_configs") or []
    except Exception:  # noqa: BLE001 - an older wgpudawn without adapter properties
        return None
    for c in configs:
        if (c.get("component_type"), c.get("result_component_type"), c.get("m"), c.get("n"), c.get("k")) == shape:
            return dict(c)
    return None


def matrix_problem(dev: Device, shape: tuple, what: str) -> str | None:
    """Why kernels generated for the subgroup-matrix config `shape` (`what`, for the message) cannot run on dev,
    or None when they can."""
    if dev.backend != "dawn":
        return f"backend {dev.backend!r}: {what} need wgpudawn (Device(backend='dawn'))"
    if SUBGROUP_MATRIX not in dev.features:
        return f"adapter {dev.adapter.summary} has no {SUBGROUP_MATRIX}"
    c = matrix_config(dev, shape)
    if c is None:
        ct, rt, m, n, k = shape
        return f"adapter {dev.adapter.summary} has no {ct}->{rt} {m}x{n}x{k} subgroup-matrix config"
    if (c.get("min_subgroup_size"), c.get("max_subgroup_size")) != (SUBGROUP_SIZE, SUBGROUP_SIZE):
        lo, hi = c.get("min_subgroup_size"), c.get("max_subgroup_size")
        return f"subgroup size {lo}..{hi}: the kernels are generated for exactly {SUBGROUP_SIZE}"
    return None


_problems: weakref.WeakKeyDictionary[Device, str | None] = weakref.WeakKeyDictionary()


def tensor_core_problem(dev: Device) -> str | None:
    """Why the tensor-core path cannot run on dev (None when it can); cached per device."""
    if dev not in _problems:
        _problems[dev] = matrix_problem(dev, F16_MATRIX, "tensor cores")
    return _problems[dev]


def has_tensor_cores(dev: Device) -> bool:
    """True when gemm_tc runs on dev's tensor cores."""
    return tensor_core_problem(dev) is None


def gemm_tc(
    dev: Device,
    a: Any,
    w: QuantTensor,
    c: Any,
    m: int,
    *,
    orient: str = "nt",
    a_dtype: str = "f32",
    accumulate: bool = False,
    alpha: float = 1.0,
    lda: int | None = None,
    ldc: int | None = None,
    a_offset: int = 0,
    c_offset: int = 0,
    cfg: TCConfig | None = None,
    emulate: bool = False,
) -> None:
    """C[m, P] (+)= alpha * A[m, R] . B on tensor cores, with B = W^T (orient "nt", R = k, P = n) or
    B = W (orient "nn", R = n, P = k) for W = w of shape (n, k) in any supported GGML type.

    A is row-major [m, R] (row stride lda, default R) of a_dtype "f32" or "f16"; C is f32 [m, P] (row
    stride ldc, default P). Offsets are in elements. emulate=True runs the same kernel with the matrix
    builtins emulated in plain WGSL (slow; for testing the indexing on adapters without tensor cores).
    Records into the current `dev.step()` (or submits at once)."""
    if a_dtype not in ("f32", "f16"):
        raise ValueError(f"gemm_tc a_dtype={a_dtype!r}: expected 'f32' or 'f16'")
    name = w.name or w.qtype.name
    if not emulate:
        problem = tensor_core_problem(dev)
        if problem is not None:
            raise DeviceError(f"gemm_tc with {name!r}: {problem}")
    g = gemm_shape(
        "gemm_tc",
        a,
        w,
        c,
        m,
        orient,
        lda=lda,
        ldc=ldc,
        a_offset=a_offset,
        c_offset=c_offset,
        a_elem_bytes=4 if a_dtype == "f32" else 2,
    )
    if m <= 0:
        return
    cfg = cfg or (EMU_TILE if emulate else pick_config(m, g.p))
    if cfg.direct and nbytes(c) < 4 * MATRIX * MATRIX:  # Dawn: a matrix load/store binding holds >= 1 matrix
        cfg = replace(cfg, direct=False)
    cfg.validate(
        orient,
        max_threads=int(dev.limits["max-compute-invocations-per-workgroup"]),
        max_workgroup_bytes=int(dev.limits["max-compute-workgroup-storage-size"]),
    )
    last = a_offset + (m - 1) * g.lda + g.r - 1
    a_w = a_width(a_dtype, g.lda, a_offset, last, nbytes(a))
    variant = variant_for(w.qtype.name, w.k, orient, cfg, a_dtype, a_w, accumulate)
    pipe = dev.pipeline((*variant.key, emulate), lambda: matmul_tc_source(variant, emulate=emulate))
    grid = (-(-g.p // cfg.bn), -(-m // cfg.bm))
    if max(grid) > int(dev.limits.get("max-compute-workgroups-per-dimension", 65535)):
        raise DeviceError(f"gemm_tc with {name!r}: grid {grid} exceeds the workgroups per dimension")
    dev.dispatch(pipe, [g.params(w, a_offset, c_offset, alpha), a, w.binding, c], grid)


def linear_tc(dev: Device, x: Any, w: QuantTensor, y: Any, m: int, **kw: Any) -> None:
    """Y[m, n] (+)= alpha * X[m, k] . W^T on tensor cores — the forward of a linear layer."""
    gemm_tc(dev, x, w, y, m, orient="nt", **kw)


def linear_input_grad_tc(dev: Device, dy: Any, w: QuantTensor, dx: Any, m: int, **kw: Any) -> None:
    """dX[m, k] (+)= alpha * dY[m, n] . W on tensor cores — the input gradient through a frozen weight."""
    gemm_tc(dev, dy, w, dx, m, orient="nn", **kw)
