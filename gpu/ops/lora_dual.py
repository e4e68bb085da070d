"""LoRA backward's dB = s dY^T t and dt = s dY B in one pass over dY (gpu/kernels/lora_dual.wgsl), rank 16: dY,
the largest operand of both ([T, d_out] f32), read once instead of twice; the partial sums (one part per 256
columns for dt, per 256 rows for dB) go to lora_matmul's scratch and lora_reduce adds them in ascending order, so
the result is the same run to run (not bitwise lora_matmul's: another summation order). Opt-in (DUAL) until
measured: bench/train_step.py --lora-dual on."""

from __future__ import annotations

import math
from typing import Any

from gpu.device import BufferView, Device, DeviceError, grid_1d
from gpu.ops.common import nbytes, pack
from gpu.ops.lora_matmul import reduce_params, scratch_for
from gpu.registry import pipeline

DUAL = False
RANK = 16  # the rank the kernel is written for
TILE_COLS = 256  # columns of dY a workgroup (one per invocation)
CHUNK_ROWS = 256  # rows of dY a workgroup
_ALIGN_FLOATS = 64  # dB's partials start on a 256-byte boundary (a binding offset)


def covers(r: int) -> bool:
    """Whether lora_dual takes this rank."""
    return r == RANK


def lora_dual(
    dev: Device, dy: Any, t: Any, b: Any, dt: Any, db: Any, n_tokens: int, d_out: int, scale: float, *, accumulate: bool
) -> None:
    """dt [T, 16] = scale dy . B and dB [d_out, 16] (+)= scale dy^T . t, dy [T, d_out], t [T, 16], B [d_out, 16]
    (f32, row-major), dB accumulated when `accumulate` (gradient accumulation), dt overwritten."""
    rows, cols, r = n_tokens, d_out, RANK
    for buf, n, what in ((dy, rows * cols, "dy"), (t, rows * r, "t"), (b, cols * r, "B"), (dt, rows * r, "dt")):
        if nbytes(buf) < 4 * n:
            raise DeviceError(f"lora_dual: {what} has {nbytes(buf)} bytes, needs {4 * n}")
    if nbytes(db) < 4 * cols * r:
        raise DeviceError(f"lora_dual: dB has {nbytes(db)} bytes, needs {4 * cols * r}")
    col_tiles, row_chunks = math.ceil(cols / TILE_COLS), math.ceil(rows / CHUNK_ROWS)
    dt_floats, db_floats = col_tiles * rows * r, row_chunks * cols * r
    db0 = -(-dt_floats // _ALIGN_FLOATS) * _ALIGN_FLOATS
    parts = scratch_for(dev, 4 * (db0 + db_floats))
    pipe = pipeline(dev, "lora_dual", cr=CHUNK_ROWS)
    dev.dispatch(pipe, [pack(rows, cols, db0, 0), dy, t, b, parts], (col_tiles, row_chunks, 1))
    reduce = pipeline(dev, "lora_reduce", half=False)
    for out, n, splits, first, size, acc in (
        (dt, rows * r, col_tiles, 0, dt_floats, False),
        (db, cols * r, row_chunks, db0, db_floats, accumulate),
    ):
        params = reduce_params(n, r, splits, 0, r, 1, float(scale), acc)
        dev.dispatch(reduce, [params, BufferView(parts, 4 * first, 4 * size), out], grid_1d(math.ceil(n / 256)))
