"""RMSNorm forward and input-gradient backward (the norm weight is frozen), one workgroup per row."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline

# the backward over rows of a multiple of 4 on rmsnorm_backward4 (vec4s, the row read once: its values kept in
# registers between the sums and the output), else rmsnorm_backward (scalars, the row read twice)
VEC4_BACKWARD = True


def rmsnorm_forward(dev: Device, x: Any, w: Any, y: Any, n_rows: int, hidden: int, eps: float, y16: Any = None) -> None:
    """y[T, H] = x / sqrt(mean(x^2) + eps) * w; y16: also y as f16 there (a tensor-core GEMM's A operand,
    rounded as gpu/ops/half.py's to_f16 would)."""
    need(x, n_rows * hidden, "rmsnorm_forward x")
    need(w, hidden, "rmsnorm_forward weight")
    need(y, n_rows * hidden, "rmsnorm_forward y")
    extra = [] if y16 is None else [y16]
    if y16 is not None:
        need(y16, n_rows * hidden, "rmsnorm_forward y16", elem_bytes=2)
    pipe = pipeline(dev, "rmsnorm_forward", half=y16 is not None)
    dev.dispatch(pipe, [pack(n_rows, hidden, float(eps), 0), x, w, y, *extra], grid(n_rows, 1))


def rmsnorm_backward(
    dev: Device, dy: Any, x: Any, w: Any, dx: Any, n_rows: int, hidden: int, eps: float, *, accumulate: bool = False
) -> None:
    """dx[T, H] (+)= d rmsnorm / dx applied to dy (rstd recomputed from x)."""
    for buf, what in ((dy, "dy"), (x, "x"), (dx, "dx")):
        need(buf, n_rows * hidden, f"rmsnorm_backward {what}")
    need(w, hidden, "rmsnorm_backward weight")
    pipe = pipeline(dev, "rmsnorm_backward4" if VEC4_BACKWARD and hidden % 4 == 0 else "rmsnorm_backward")
    dev.dispatch(pipe, [pack(n_rows, hidden, float(eps), accumulate), dy, x, w, dx], grid(n_rows, 1))
