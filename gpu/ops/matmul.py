"""Matmul through a frozen (quantized) weight, decoded in-kernel: the forward Y = X.W^T and the input
gradient dX = dY.W, plus the general f32 form used by LoRA (transposed A, accumulate, alpha)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu.codegen import MatmulVariant, TileConfig, matmul_source
from gpu.device import BufferView, Device, DeviceError
from gpu.weights import QuantTensor

# Tile presets (bench/gemm.py). GPU: 128x128, 8x8 per thread, br=16: 28-32 TFLOP/s f32 at N=4096 on the
# H200 (Dawn and wgpu-native alike). lavapipe (CPU): 8x8 per thread beat 4x4; 64x64 tiles, 64 threads.
GPU_TILE = TileConfig(bm=128, bp=128, br=16, tm=8, tn=8)
GPU_TILE_SMALL_M = TileConfig(bm=16, bp=128, br=16, tm=4, tn=8)
CPU_TILE = TileConfig(bm=64, bp=64, br=16, tm=8, tn=8)
CPU_TILE_SMALL_M = TileConfig(bm=4, bp=64, br=32, tm=4, tn=8)


def pick_tile(dev: Device, m: int) -> TileConfig:
    """The tile preset for this device and row count."""
    if dev.is_cpu:
        return CPU_TILE_SMALL_M if m <= 4 else CPU_TILE
    return GPU_TILE_SMALL_M if m <= 16 else GPU_TILE


def _nbytes(b: Any) -> int:
    return b.nbytes if isinstance(b, BufferView) else b.size


def gemm(
    dev: Device,
    a: Any,
    w: QuantTensor,
    c: Any,
    m: int,
    *,
    orient: str = "nt",
    trans_a: bool = False,
    accumulate: bool = False,
    alpha: float = 1.0,
    lda: int | None = None,
    ldc: int | None = None,
    a_offset: int = 0,
    c_offset: int = 0,
    tile: TileConfig | None = None,
) -> None:
    """C[m, P] (+)= alpha * A[m, R] . B with B = W^T (orient "nt", R = k, P = n) or B = W (orient "nn",
    R = n, P = k), for W = w of shape (n, k) in any supported GGML type.

    A (f32) is row-major [m, R] with row stride lda (default R), or with trans_a stored as [R, m] with row
    stride lda (default m). C (f32) is [m, P] with row stride ldc (default P). Offsets are in elements.
    f32 arithmetic throughout (the parity path). Records into the current `dev.step()` (or submits at
    once)."""
    n, k = w.shape
    if orient == "nt":
        r, p = k, n
    elif orient == "nn":
        r, p = n, k
    else:
        raise ValueError(f"gemm orient={orient!r}: expected 'nt' (X.W^T) or 'nn' (dY.W)")
    if m <= 0:
        return
    lda = lda if lda is not None else (m if trans_a else r)
    ldc = ldc if ldc is not None else p
    a_need = 4 * (a_offset + ((r - 1) * lda + m if trans_a else (m - 1) * lda + r))
    c_need = 4 * (c_offset + (m - 1) * ldc + p)
    name = w.name or w.qtype.name
    if _nbytes(a) < a_need:
        raise DeviceError(f"gemm with {name!r}: input A has {_nbytes(a)} bytes, needs {a_need} for m={m}, R={r}")
    if _nbytes(c) < c_need:
        raise DeviceError(f"gemm with {name!r}: output C has {_nbytes(c)} bytes, needs {c_need} for m={m}, P={p}")
    tile = tile or pick_tile(dev, m)
    tile.validate(
        max_threads=int(dev.limits["max-compute-invocations-per-workgroup"]),
        max_workgroup_bytes=int(dev.limits["max-compute-workgroup-storage-size"]),
    )
    variant = MatmulVariant(w.qtype.name, orient, tile, trans_a, accumulate)
    pipe = dev.pipeline(variant.key, lambda: matmul_source(variant))
    alpha_bits = int(np.float32(alpha).view(np.uint32))
    params = np.array([m, p, r, k, lda, ldc, a_offset, c_offset, alpha_bits, n, 0, 0], np.uint32)
    grid = (-(-p // tile.bp), -(-m // tile.bm))
    dev.dispatch(pipe, [params, a, w.binding, c], grid)


def linear(dev: Device, x: Any, w: QuantTensor, y: Any, m: int, **kw: Any) -> None:
    """Y[m, n] (+)= alpha * X[m, k] . W^T — the forward of a linear layer with weight W [n, k]."""
    gemm(dev, x, w, y, m, orient="nt", **kw)


def linear_input_grad(dev: Device, dy: Any, w: QuantTensor, dx: Any, m: int, **kw: Any) -> None:
    """dX[m, k] (+)= alpha * dY[m, n] . W — the input gradient through a frozen weight W [n, k]."""
    gemm(dev, dy, w, dx, m, orient="nn", **kw)
