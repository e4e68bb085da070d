"""Activations to int8 codes and per-(row, chunk) scales for the integer GEMM (gpu/kernels/quantize_i8.wgsl; the
numpy twin is model/int8.py quantize_i8)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu.device import Device, DeviceError
from gpu.ops.common import nbytes
from gpu.ops.matmul_i8 import Int8Matrix
from gpu.registry import pipeline


def quantize_i8_gpu(dev: Device, x: Any, out: Int8Matrix, *, ldx: int | None = None, x_offset: int = 0) -> None:
    """out <- int8 codes and scales of the f32 rows x[out.rows, out.k] (row stride ldx, default k)."""
    ldx = out.k if ldx is None else ldx
    need = 4 * (x_offset + (out.rows - 1) * ldx + out.k)
    if out.rows > 0 and nbytes(x) < need:
        raise DeviceError(f"quantize_i8 of {out.name!r}: input has {nbytes(x)} bytes, needs {need}")
    if out.rows > int(dev.limits.get("max-compute-workgroups-per-dimension", 65535)):
        raise DeviceError(f"quantize_i8 of {out.name!r}: {out.rows} rows exceed the workgroups per dimension")
    prm = np.array([out.k, ldx, x_offset, out.chunk, out.chunks, 0, 0, 0], np.uint32)
    dev.dispatch(pipeline(dev, "quantize_i8"), [prm, x, out.codes, out.scales], (out.chunks, out.rows))
