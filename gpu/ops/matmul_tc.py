"""Tensor-core matmul through a frozen (quantized) weight: Y = X.W^T and dX = dY.W with f16 operands and f32
accumulation (Dawn subgroup matrices). Same call shape as gpu/ops/matmul.py's gemm, minus trans_a.

Numerics: A and the dequantized W are rounded to f16 (|x| > 65504 overflows), products accumulate in f32;
the result matches float64 on the f16-rounded operands to ~1e-5 relative (DESIGN.md, mixed precision)."""

from __future__ import annotations

import weakref
from typing import Any

from gpu.codegen_tc import SUBGROUP_SIZE, TCConfig, TCVariant, matmul_tc_source
from gpu.device import SUBGROUP_MATRIX, Device, DeviceError
from gpu.ops.matmul import gemm_shape
from gpu.weights import QuantTensor

# Presets, measured with bench/tc_probe.py on an H200 (F16 GEMM, N = 4096): 16 subgroups of 2 x 2 result
# matrices (128 x 128 tile, BK = 32, single-buffered) ran 69 TFLOP/s (101 with Dawn's robustness off);
# larger per-subgroup tiles (4 x 4) and the register prefetch were 3-10x slower there. Small M (decode) uses
# a 16 x 128 tile (checked for every weight type on the H200; its speed is bound by reading W).
TC_TILE = TCConfig(sg_m=4, sg_n=4, tm=2, tn=2, bk=32)
TC_TILE_SMALL_M = TCConfig(sg_m=1, sg_n=4, tm=1, tn=2, bk=32, prefetch=True)
# Lavapipe-sized tile for the emulated kernel (tests of the indexing without tensor cores).
EMU_TILE = TCConfig(sg_m=2, sg_n=1, tm=1, tn=2, bk=32, prefetch=True)


def pick_config(m: int) -> TCConfig:
    """The tile preset for m rows of A."""
    return TC_TILE_SMALL_M if m <= 16 else TC_TILE


def matrix_config(dev: Device) -> dict[str, Any] | None:
    """The adapter's f16 x f16 -> f32 16x16x16 subgroup-matrix config (with its subgroup sizes), or None."""
    if dev.backend != "dawn":
        return None
    try:
        from wgpudawn.backends.dawn import extras

        configs = extras.get_adapter_properties(dev.adapter).get("subgroup_matrix_configs") or []
    except Exception:  # noqa: BLE001 - an older wgpudawn without adapter properties
        return None
    for c in configs:
        shape = (c.get("component_type"), c.get("result_component_type"), c.get("m"), c.get("n"), c.get("k"))
        if shape == ("f16", "f32", 16, 16, 16):
            return dict(c)
    return None


_problems: weakref.WeakKeyDictionary[Device, str | None] = weakref.WeakKeyDictionary()


def tensor_core_problem(dev: Device) -> str | None:
    """Why the tensor-core path cannot run on dev (None when it can); cached per device."""
    if dev in _problems:
        return _problems[dev]
    problem = None
    if dev.backend != "dawn":
        problem = f"backend {dev.backend!r}: tensor cores need wgpudawn (Device(backend='dawn'))"
    elif SUBGROUP_MATRIX not in dev.features:
        problem = f"adapter {dev.adapter.summary} has no {SUBGROUP_MATRIX}"
    else:
        c = matrix_config(dev)
        if c is None:
            problem = f"adapter {dev.adapter.summary} has no f16->f32 16x16x16 subgroup-matrix config"
        elif (c.get("min_subgroup_size"), c.get("max_subgroup_size")) != (SUBGROUP_SIZE, SUBGROUP_SIZE):
            lo, hi = c.get("min_subgroup_size"), c.get("max_subgroup_size")
            problem = f"subgroup size {lo}..{hi}: the kernels are generated for exactly {SUBGROUP_SIZE}"
    _problems[dev] = problem
    return problem


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
    cfg = cfg or (EMU_TILE if emulate else pick_config(m))
    cfg.validate(
        orient,
        max_threads=int(dev.limits["max-compute-invocations-per-workgroup"]),
        max_workgroup_bytes=int(dev.limits["max-compute-workgroup-storage-size"]),
    )
    a_vec = g.lda % 4 == 0 and a_offset % 4 == 0 and g.r % 4 == 0
    variant = TCVariant(w.qtype.name, orient, cfg, a_dtype, a_vec, accumulate)
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
