"""Small helpers shared by the ops: uniform packing, grids, and size checks with messages naming the tensor.
The ops build their kernels' pipelines through gpu/registry.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpu.device import BufferView, DeviceError, grid_1d


def pack(*values: int | float | bool) -> np.ndarray:
    """Uniform params as u32 words: ints and bools as u32, floats as their f32 bit pattern (struct order)."""
    words = []
    for v in values:
        if isinstance(v, bool | int | np.integer):
            if not 0 <= int(v) < 2**32:
                raise ValueError(f"uniform param {v} does not fit a u32")
            words.append(int(v))
        else:
            words.append(int(np.float32(v).view(np.uint32)))
    return np.array(words, dtype=np.uint32)


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
