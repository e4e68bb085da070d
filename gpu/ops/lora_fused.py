"""A LoRA reduction + expansion pair in one dispatch (gpu/kernels/lora_fused.wgsl), f32, deterministic:

    T [M, r] = alpha1 X [M, K] . W1 [K, r]        (written out: the backward's dA / dB products read it)
    Y [M, N] += alpha2 T . W2 [r, N]

one workgroup per 16 token rows doing both products, T's block kept in workgroup memory in between. LoRA's
forward is (x, A^T, t, B^T, y), its backward's input-gradient pair (dy, B, dt, A, dx). Ranks up to 64 (the
largest rank bucket of gpu/codegen_lora_fused.py); `covers` says whether a shape can take this path.
"""

from __future__ import annotations

import math
from typing import Any

from gpu.codegen_lora_fused import BM, rank_bucket
from gpu.device import Device, DeviceError
from gpu.ops.common import nbytes, pack
from gpu.ops.strided_matmul import Operand
from gpu.registry import pipeline

MAX_GRID = 65535


def covers(m: int, r: int) -> bool:
    """Whether the fused kernel takes m token rows at rank r (r <= 64, one grid dimension of row blocks)."""
    return rank_bucket(r) is not None and math.ceil(m / BM) <= MAX_GRID


def lora_fused(
    dev: Device,
    x: Any,
    w1: Operand,
    w2: Operand,
    t: Any,
    y: Any,
    m: int,
    k: int,
    n: int,
    r: int,
    *,
    alpha1: float = 1.0,
    alpha2: float = 1.0,
) -> None:
    """t [m, r] = alpha1 x [m, k] . W1; y [m, n] += alpha2 t . W2, with x, t, y row-major from element 0 of their
    bindings and W1(k, j) = w1.buf[w1.off + k * w1.s0 + j * w1.s1], W2(j, n) = w2.buf[w2.off + j * w2.s0 + n * w2.s1]
    (offsets must be 0: bind a view instead). Raises DeviceError for shapes `covers` refuses or short buffers."""
    if min(m, r) <= 0:
        return
    rb = rank_bucket(r)
    if rb is None or not covers(m, r):
        raise DeviceError(f"lora_fused: {m} rows at rank {r} are not covered (r <= 64, <= {MAX_GRID * BM} rows)")
    if w1.off or w2.off:
        raise DeviceError("lora_fused: W1 / W2 must start at element 0 of their bindings (bind a view)")
    for buf, count, what in (
        (x, m * k, "X"),
        (t, m * r, "T"),
        (y, m * n, "Y"),
        (w1.buf, w1.last(k, r) + 1, "W1"),
        (w2.buf, w2.last(r, n) + 1, "W2"),
    ):
        if count > 0 and nbytes(buf) < 4 * count:
            raise DeviceError(f"lora_fused: {what} needs {4 * count} B, its buffer has {nbytes(buf)} B")
    params = pack(
        m, k, n, r, w1.s0, w1.s1, w1.s0 == 1, w2.s0, w2.s1, w2.s1 == 1, float(alpha1), float(alpha2)
    )  # fmt: skip
    dev.dispatch(pipeline(dev, "lora_fused", rb=rb), [params, x, w1.buf, w2.buf, t, y], (math.ceil(m / BM), 1, 1))
