"""Small helpers shared by the elementwise / attention / LoRA / KD / AdamW ops: uniform packing, grids,
cached pipelines from gpu/kernels/<name>.wgsl templates, and size checks with messages naming the tensor."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpu.codegen import fill, kernel_text
from gpu.device import BufferView, Device, DeviceError, grid_1d


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


def pipeline(dev: Device, name: str, includes: tuple[str, ...] = (), **values: object) -> Any:
    """The cached pipeline of gpu/kernels/<name>.wgsl, after the shared snippets gpu/kernels/<include>.wgsl,
    with ${NAME} placeholders filled from `values`."""
    key = (name, includes, tuple(sorted((k, str(v)) for k, v in values.items())))
    parts = [kernel_text(f"{inc}.wgsl") for inc in includes] + [kernel_text(f"{name}.wgsl")]
    return dev.pipeline(key, lambda: fill("\n".join(parts), **values))


def nbytes(buf: Any) -> int:
    """Bound size in bytes of a GPUBuffer or BufferView."""
    return buf.nbytes if isinstance(buf, BufferView) else int(buf.size)


def need(buf: Any, n_elems: int, what: str, elem_bytes: int = 4) -> None:
    """Raise DeviceError when `buf` is smaller than n_elems elements."""
    if nbytes(buf) < n_elems * elem_bytes:
        raise DeviceError(f"{what}: buffer has {nbytes(buf)} bytes, needs {n_elems * elem_bytes} ({n_elems} elements)")
