"""GeGLU activation (GELU's tanh form times the up projection: Gemma's MLP gate) forward and backward,
elementwise; the twins of model/reference.py's geglu_forward / geglu_backward and of gpu/ops/swiglu.py."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline


def geglu_forward(dev: Device, g: Any, u: Any, y: Any, n: int, y16: Any = None) -> None:
    """y = gelu_tanh(g) * u over n elements; y16: also y as f16 there (as swiglu_forward's)."""
    for buf, what in ((g, "g"), (u, "u"), (y, "y")):
        need(buf, n, f"geglu_forward {what}")
    extra = [] if y16 is None else [y16]
    if y16 is not None:
        need(y16, n, "geglu_forward y16", elem_bytes=2)
    pipe = pipeline(dev, "geglu_forward", half=y16 is not None)
    dev.dispatch(pipe, [pack(n, 0, 0, 0), g, u, y, *extra], grid(n, 256))


def geglu_backward(dev: Device, dy: Any, g: Any, u: Any, dg: Any, n: int) -> None:
    """dg and du of y = gelu_tanh(g) * u over n elements; du overwrites u (u is dead after the backward)."""
    for buf, what in ((dy, "dy"), (g, "g"), (u, "u"), (dg, "dg")):
        need(buf, n, f"geglu_backward {what}")
    dev.dispatch(pipeline(dev, "geglu_backward"), [pack(n, 0, 0, 0), dy, g, u, dg], grid(n, 256))
