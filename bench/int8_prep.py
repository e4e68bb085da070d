"""The integer path's operand preparation, timed alone, as JSON lines: the weights' int8 decode (weight_to_i8: Q4_K's
fast kernel, Q6_K through the generic one; each also with its row scales given, fixed: the codes alone, as the
engine decodes a block after its first), the RMSNorm and the gated unit with their output's codes (rmsnorm_i8,
glu_i8; rotated rows on either kernel: UNIT_ROWS), the activations' quantizer (quantize_i8_gpu: plain, times column
scales as the input gradients', rotated) and the rotation back (rotate_rows), each rotated in blocks of 128 and
not, at the Llama-3-8B shapes of a B4 x T1024 step.

    python bench/int8_prep.py
    python bench/int8_prep.py --shapes 4096x4096,4096x14336
    python bench/int8_prep.py --row-wg 64,256     # rows of <= 4096 on 64 or 256 invocations (quantize_i8.py)

GB/s counts the bytes each kernel must move once (the weights' GGML bytes read + a code byte written per weight;
an activation's f32 read + a code byte written; rotate_rows' f32 read + write): against the GPU's memory
bandwidth (H100 SXM ~3.35 TB/s, H200 ~4.8) they say how far these passes are from streaming. Times: wall
(median of 3 windows, bench/gemm_tc.py time_calls) and GPU (timestamp queries, median of 5).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu.ops.quantize_i8 as quantize_ops  # noqa: E402
from bench.gemm_tc import gpu_time, time_calls  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops.matmul_i8 import i8_buffers  # noqa: E402
from gpu.ops.quantize_i8 import quantize_i8_gpu, rotate_rows, row_workgroup, weight_to_i8  # noqa: E402
from gpu.weights import random_blocks, upload_quant  # noqa: E402
from model.quant import row_bytes  # noqa: E402

# (rows, width): weights [out, in] of q/o, gate/up, down, k/v; activations [tokens, width] alike
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def timed(dev: Device, op: str, call: Callable[[], None], n_bytes: int, **fields: Any) -> dict[str, Any]:
    t = time_calls(dev, call, 0.2)
    row = {"op": op, **fields, "us": round(t["seconds"] * 1e6, 1), "gbs": round(n_bytes / t["seconds"] / 1e9, 1)}
    g = gpu_time(dev, call)
    if "gpu_us" in g:
        row |= {"gpu_us": g["gpu_us"], "gpu_gbs": round(n_bytes / (g["gpu_us"] * 1e-6) / 1e9, 1)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in SHAPES), help="ROWSxWIDTH,...")
    ap.add_argument("--backend", default="dawn", help="wgpu or dawn")
    ap.add_argument("--row-wg", default="", help="invocations a row for rows of <= 4096 (64, 256), comma-separated")
    args = ap.parse_args()
    dev = Device(args.backend)
    emit(device=dev.adapter.summary)
    for wg in [int(x) for x in args.row_wg.split(",") if x] or [quantize_ops.SHORT_ROW_WORKGROUP]:
        quantize_ops.SHORT_ROW_WORKGROUP = wg
        run_shapes(dev, args.shapes)


def run_shapes(dev: Device, shapes: str) -> None:
    """Every op at every shape, as JSON lines (each with the workgroup size its rows ran on)."""
    rng = np.random.default_rng(0)
    for text in shapes.split(","):
        rows, k = (int(x) for x in text.split("x"))
        for qtype in (T.Q4_K, T.Q6_K):
            w = upload_quant(dev, random_blocks(qtype, (rows, k), rng), qtype, (rows, k), name="w")
            out = i8_buffers(dev, rows, k, k, "w")
            n_bytes = rows * row_bytes(qtype, k) + rows * k
            for rot, fixed in ((0, False), (128, False), (128, True)):
                call = partial(weight_to_i8, dev, w, out, rot=rot, fixed_scales=fixed)
                wg = row_workgroup(k) if qtype == T.Q4_K else 256
                fields = {"wtype": qtype.name, "rows": rows, "k": k, "rot": rot, "wg": wg, "fixed": fixed}
                emit(**timed(dev, "weight_to_i8", call, n_bytes, **fields))
        x = dev.upload(rng.standard_normal((rows, k), dtype=np.float32))
        cs = dev.upload(rng.uniform(0.5, 2.0, k).astype(np.float32))
        a = i8_buffers(dev, rows, k, k, "x")
        for rot, scaled, units in ((0, False, True), (128, False, False), (128, False, True), (0, True, True)):
            quantize_ops.UNIT_ROWS = units
            call = partial(quantize_i8_gpu, dev, x, a, col_scales=cs if scaled else None, rot=rot)
            fields = {"rows": rows, "k": k, "rot": rot, "scaled": scaled, "wg": row_workgroup(k), "units": units}
            emit(**timed(dev, "quantize_i8", call, 5 * rows * k, **fields))
        quantize_ops.UNIT_ROWS = True
        call = partial(rotate_rows, dev, x, rows, k, 128)
        emit(**timed(dev, "rotate_rows", call, 8 * rows * k, rows=rows, k=k))
        if k <= quantize_ops.FUSED_NORM_ROTATED_WIDTH:
            norm_rows(dev, x, a, rows, k, rng)
        if k <= 64 * row_workgroup(k):
            glu_rows(dev, x, a, rows, k, rng)


def norm_rows(dev: Device, x: Any, a: Any, rows: int, k: int, rng: Any) -> None:
    """rmsnorm_i8 of rows of k, plain and rotated on either kernel (UNIT_ROWS); bytes: x read, y written, a code
    byte written per value."""
    w, y = dev.upload(rng.uniform(0.5, 1.5, k).astype(np.float32)), dev.buffer(4 * rows * k)
    for rot, units in ((0, False), (128, False), (128, True)):
        quantize_ops.UNIT_ROWS = units
        call = partial(quantize_ops.rmsnorm_i8, dev, x, w, y, a, 1e-5, rot)
        emit(**timed(dev, "rmsnorm_i8", call, 9 * rows * k, rows=rows, k=k, rot=rot, units=units))
    quantize_ops.UNIT_ROWS = True


def glu_rows(dev: Device, x: Any, a: Any, rows: int, k: int, rng: Any) -> None:
    """glu_i8 (SwiGLU) of rows of k, plain and rotated on either kernel (UNIT_ROWS); bytes: g and u read, y written,
    a code byte written per value."""
    u, y = dev.upload(rng.standard_normal((rows, k), dtype=np.float32)), dev.buffer(4 * rows * k)
    for rot, units in ((0, False), (128, False), (128, True)):
        quantize_ops.UNIT_ROWS = units
        call = partial(quantize_ops.glu_i8, dev, "swiglu", x, u, y, a, rot)
        emit(**timed(dev, "glu_i8", call, 13 * rows * k, rows=rows, k=k, rot=rot, units=units))
    quantize_ops.UNIT_ROWS = True


if __name__ == "__main__":
    main()
