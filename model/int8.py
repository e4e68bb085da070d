"""8-bit operands of the integer tensor-core GEMM (gpu/ops/matmul_i8.py): symmetric int8 codes with one f32 scale
per row and chunk of `chunk` consecutive elements along the reduction axis. The numpy twin of
gpu/kernels/quantize_i8.wgsl and the reference of the GEMM:

    x[r, c*chunk + i] ~ scale[r, c] * code[r, c*chunk + i],  scale = max|x[r, chunk c]| / 127,  |code| <= 127

so a GEMM over int8 operands is exact in i32 within a chunk and the chunk's partial sum is scaled once:
    Y[m, n] = sum_c  sa[m, c] * sw[n, c] * sum_{k in chunk c} A[m, k] W[n, k].
Rounding: to nearest, ties to even (WGSL round()); an all-zero chunk gets scale 0 and codes 0. Relative to
max|x| of its chunk, a value is represented to within 1/254.
"""

from __future__ import annotations

import numpy as np

QMAX = 127


def check_chunk(k: int, chunk: int, *, what: str = "rows") -> int:
    """The number of chunks of a row of length k; chunk must divide k and be a multiple of 32 (one MMA step)."""
    if chunk <= 0 or chunk % 32 or k % chunk:
        raise ValueError(f"int8 chunk {chunk} for {what} of length {k}: must be a multiple of 32 dividing {k}")
    return k // chunk


def quantize_i8(x: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [rows, k], scales float32 [rows, k / chunk]) of float32 x [rows, k]."""
    x = np.ascontiguousarray(x, np.float32)
    rows, k = x.shape
    n = check_chunk(k, chunk)
    blocks = x.reshape(rows, n, chunk)
    scale = (np.abs(blocks).max(axis=2) / np.float32(QMAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -QMAX, QMAX).astype(np.int8)
    return codes.reshape(rows, k), scale


def dequantize_i8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of (codes [rows, k], scales [rows, k / chunk])."""
    rows, k = codes.shape
    n = scales.shape[1]
    return (codes.reshape(rows, n, k // n).astype(np.float32) * scales[:, :, None]).reshape(rows, k)


def gemm_i8_reference(
    a_codes: np.ndarray, a_scales: np.ndarray, w_codes: np.ndarray, w_scales: np.ndarray
) -> np.ndarray:
    """float64 Y[m, n] = sum_c sa[m, c] sw[n, c] sum_{k in c} A[m, k] W[n, k] (the integer GEMM's definition)."""
    k = a_codes.shape[1]
    size = k // a_scales.shape[1]
    out = np.zeros((a_codes.shape[0], w_codes.shape[0]))
    for c in range(a_scales.shape[1]):  # float64 sums of integer products are exact (|sum| << 2^53)
        part = a_codes[:, c * size : (c + 1) * size].astype(np.float64) @ w_codes[:, c * size : (c + 1) * size].T
        out += part * a_scales[:, c, None].astype(np.float64) * w_scales[None, :, c].astype(np.float64)
    return out


def pack_i8(codes: np.ndarray) -> np.ndarray:
    """int8 [rows, k] (k % 4 == 0) as little-endian uint32 words, four codes each (the kernels' layout)."""
    codes = np.ascontiguousarray(codes, np.int8)
    return codes.view(np.uint32).reshape(codes.shape[0], -1) if codes.ndim == 2 else codes.view(np.uint32)
