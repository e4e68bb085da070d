"""Matmul through a frozen (quantized) weight, decoded in-kernel: the forward Y = X.W^T and the input
gradient dX = dY.W, plus the general f32 form used by LoRA (transposed A, accumulate, alpha)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.codegen import MatmulVariant, TileConfig, matmul_source
from gpu.device import Device, DeviceError
from gpu.ops.common import nbytes
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


@dataclass(frozen=True)
class GemmShape:
    """The checked geometry of C[m, P] (+)= A[m, R] . B for a weight W (n, k) and an orientation."""

    m: int
    r: int
    p: int
    lda: int
    ldc: int

    def params(self, w: QuantTensor, a_offset: int, c_offset: int, alpha: float) -> np.ndarray:
        """The uniform block both matmul templates read."""
        n, k = w.shape
        alpha_bits = int(np.float32(alpha).view(np.uint32))
        return np.array(
            [self.m, self.p, self.r, k, self.lda, self.ldc, a_offset, c_offset, alpha_bits, n, 0, 0], np.uint32
        )


def gemm_shape(
    op: str,
    a: Any,
    w: QuantTensor,
    c: Any,
    m: int,
    orient: str,
    *,
    lda: int | None,
    ldc: int | None,
    a_offset: int,
    c_offset: int,
    trans_a: bool = False,
    a_elem_bytes: int = 4,
) -> GemmShape:
    """Orientation -> (R, P), default strides, and the operand sizes checked (errors name the weight)."""
    n, k = w.shape
    if orient not in ("nt", "nn"):
        raise ValueError(f"{op} orient={orient!r}: expected 'nt' (X.W^T) or 'nn' (dY.W)")
    r, p = (k, n) if orient == "nt" else (n, k)
    lda = lda if lda is not None else (m if trans_a else r)
    ldc = ldc if ldc is not None else p
    a_need = a_elem_bytes * (a_offset + ((r - 1) * lda + m if trans_a else (m - 1) * lda + r))
    c_need = 4 * (c_offset + (m - 1) * ldc + p)
    name = w.name or w.qtype.name
    if m > 0 and nbytes(a) < a_need:
        raise DeviceError(f"{op} with {name!r}: input A has {nbytes(a)} bytes, needs {a_need} for m={m}, R={r}")
    if m > 0 and nbytes(c) < c_need:
        raise DeviceError(f"{op} with {name!r}: output C has {nbytes(c)} bytes, needs {c_need} for m={m}, P={p}")
    return GemmShape(m, r, p, lda, ldc)


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
    g = gemm_shape("gemm", a, w, c, m, orient, lda=lda, ldc=ldc, a_offset=a_offset, c_offset=c_offset, trans_a=trans_a)
    if m <= 0:
        return
    tile = tile or pick_tile(dev, m)
    tile.validate(
        max_threads=int(dev.limits["max-compute-invocations-per-workgroup"]),
        max_workgroup_bytes=int(dev.limits["max-compute-workgroup-storage-size"]),
    )
    variant = MatmulVariant(w.qtype.name, orient, tile, trans_a, accumulate)
    pipe = dev.pipeline(variant.key, lambda: matmul_source(variant))
    grid = (-(-g.p // tile.bp), -(-m // tile.bm))
    dev.dispatch(pipe, [g.params(w, a_offset, c_offset, alpha), a, w.binding, c], grid)


def linear(dev: Device, x: Any, w: QuantTensor, y: Any, m: int, **kw: Any) -> None:
    """Y[m, n] (+)= alpha * X[m, k] . W^T — the forward of a linear layer with weight W [n, k]."""
    gemm(dev, x, w, y, m, orient="nt", **kw)


def linear_input_grad(dev: Device, dy: Any, w: QuantTensor, dx: Any, m: int, **kw: Any) -> None:
    """dX[m, k] (+)= alpha * dY[m, n] . W — the input gradient through a frozen weight W [n, k]."""
    gemm(dev, dy, w, dx, m, orient="nn", **kw)
