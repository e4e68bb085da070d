"""f32 -> f16 copies of tensor-core GEMM operands (the pack_f16 kernel, shared with the attention's packs)."""

from __future__ import annotations

from typing import Any

from gpu.device import Device, DeviceError
from gpu.ops.common import grid, nbytes, pack
from gpu.registry import pipeline


def to_f16(dev: Device, src: Any, dst: Any, n_elems: int) -> bool:
    """dst (f16) = src (f32), n_elems a multiple of 4: the A operand of tensor-core GEMMs packed once (rounded
    exactly as the kernels round f32 A while staging, so the products are bitwise the same) and read at half
    the bytes, with the f16 A kernels' 16-byte loads. False (nothing recorded) when n_elems is not a multiple
    of 4: the caller passes the f32 tensor instead."""
    if n_elems % 4:
        return False
    if nbytes(src) < 4 * n_elems or nbytes(dst) < 2 * n_elems:
        raise DeviceError(f"to_f16: {n_elems} elements do not fit src ({nbytes(src)} B) / dst ({nbytes(dst)} B)")
    units = n_elems // 4
    dev.dispatch(pipeline(dev, "pack_f16", scaled=False), [pack(units, units), src, dst], grid(units, 256))
    return True
