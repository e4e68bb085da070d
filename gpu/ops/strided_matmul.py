"""A small general f32 matmul over strided operands (LoRA products, KD head chunk logits), reproducible."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpu.device import Device, DeviceError
from gpu.ops.common import nbytes, pack
from gpu.registry import pipeline

TILE = 16


@dataclass(frozen=True)
class Operand:
    """Element (i, k) of a matrix operand is buf[off + i * s0 + k * s1] (offsets and strides in elements)."""

    buf: Any
    off: int
    s0: int
    s1: int

    def last(self, n0: int, n1: int) -> int:
        return self.off + (n0 - 1) * self.s0 + (n1 - 1) * self.s1


def check_operands(op: str, a: Operand, b: Operand, m: int, n: int, k: int) -> None:
    """Raise DeviceError when A [m, k] or B [k, n] would read past its buffer (op names the caller)."""
    for x, rows, cols, what in ((a, m, k, "A"), (b, k, n, "B")):
        if k > 0 and nbytes(x.buf) < 4 * (x.last(rows, cols) + 1):
            raise DeviceError(f"{op}: operand {what} ({rows} x {cols}) reads past its buffer's {nbytes(x.buf)} B")


def row_major(buf: Any, cols: int, off: int = 0) -> Operand:
    """A row-major [rows, cols] matrix."""
    return Operand(buf, off, cols, 1)


def transposed(buf: Any, cols: int, off: int = 0) -> Operand:
    """The transpose of a row-major [rows, cols] matrix."""
    return Operand(buf, off, 1, cols)


def strided_matmul(
    dev: Device,
    a: Operand,
    b: Operand,
    c: Any,
    m: int,
    n: int,
    k: int,
    *,
    alpha: float = 1.0,
    accumulate: bool = False,
    c_off: int = 0,
    ldc: int | None = None,
) -> None:
    """C[m, n] (+)= alpha * A[m, k] . B[k, n]; C row-major at element c_off with row stride ldc (default n)."""
    if min(m, n) <= 0:
        return
    ldc = n if ldc is None else ldc
    check_operands("strided_matmul", a, b, m, n, k)
    if nbytes(c) < 4 * (c_off + (m - 1) * ldc + n):
        raise DeviceError(f"strided_matmul: output C ({m} x {n}, ldc {ldc}) exceeds its buffer's {nbytes(c)} B")
    gx, gy = math.ceil(n / TILE), math.ceil(m / TILE)
    if max(gx, gy) > 65535:
        raise DeviceError(f"strided_matmul: {m} x {n} output needs a grid of {gx} x {gy} (max 65535 per dimension)")
    params = pack(m, n, k, a.off, a.s0, a.s1, b.off, b.s0, b.s1, c_off, ldc, alpha, accumulate, 0, 0, 0)
    dev.dispatch(pipeline(dev, "strided_matmul"), [params, a.buf, b.buf, c], (gx, gy))
