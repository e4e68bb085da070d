"""bfloat16 as numpy float32 values: the top 16 bits of an f32, rounded to nearest even (NaN stays NaN). The
twin of gpu/kernels/to_bf16.wgsl, which keeps the tensor-core path's checkpointed block inputs in bf16: f32's
range (the residual stream can leave f16's) at half the bytes, 8 significant bits (relative error <= 2^-9)."""

from __future__ import annotations

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns of float32 x, rounded to nearest even; NaN becomes a quiet NaN of its sign."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to bf16 (returned as float32 values)."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
