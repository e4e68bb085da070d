"""Small helpers shared by the ops: uniform packing, grids, and size checks with messages naming the tensor.
The ops build their kernels' pipelines through gpu/registry.py."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from gpu.device import BufferView, DeviceError, grid_1d


def pack(*values: int | float | bool) -> bytes:
    """Uniform params as u32 words: ints and bools as u32, floats as their f32 bit pattern (struct order).
    Bytes (Device.uniform's cache key as is): a training step packs ~4,000 of these."""
    fmt = "".join("f" if isinstance(v, float | np.floating) else "I" for v in values)
    try:
        return struct.pack("<" + fmt, *values)
    except struct.error:
        bad = next(v for v in values if not isinstance(v, float | np.floating) and not 0 <= int(v) < 2**32)
        raise ValueError(f"uniform param {bad} does not fit a u32") from None


def grid(n_items: int, per_workgroup: int) -> tuple[int, int, int]:
    """A 2-D grid of ceil(n_items / per_workgroup) workgroups (kernels use wid.x + wid.y * nwg.x)."""
    return grid_1d(max(1, math.ceil(n_items / per_workgroup)))


def nbytes(buf: Any) -> int:
    """Bound size in bytes of a GPUBuffer or BufferView."""
    return buf.nbytes if isinstance(buf, BufferView) else int(buf.size)


def need(buf: Any, n_elems: int, what: str, elem_bytes: int = 4) -> None:
    """Raise DeviceError when `buf` is smaller than n_elems elements."""
    if nbytes(buf) < n_elems * elem_bytes:
        raise DeviceError(f"{what}: buffer has {nbytes(buf)} bytes, needs {n_elems * elem_bytes} ({n_elems} elements)")
