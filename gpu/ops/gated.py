"""Gated MLP activations, elementwise, forward and backward: SwiGLU (silu(g) * u) and GeGLU (GELU's tanh form
times u: Gemma's MLP gate); the twins of model/reference.py's swiglu_* / geglu_*."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline


def gated_forward(dev: Device, gate: str, g: Any, u: Any, y: Any, n: int, y16: Any = None) -> None:
    """y = act(g) * u over n elements (act: silu for swiglu, gelu_tanh for geglu); y16: also y as f16 there (the
    down projection's tensor-core A operand, rounded as gpu/ops/half.py's to_f16 would)."""
    for buf, what in ((g, "g"), (u, "u"), (y, "y")):
        need(buf, n, f"{gate}_forward {what}")
    extra = [] if y16 is None else [y16]
    if y16 is not None:
        need(y16, n, f"{gate}_forward y16", elem_bytes=2)
    pipe = pipeline(dev, f"{gate}_forward", half=y16 is not None)
    dev.dispatch(pipe, [pack(n, 0, 0, 0), g, u, y, *extra], grid(n, 256))


def gated_backward(
    dev: Device, gate: str, dy: Any, g: Any, u: Any, dg: Any, n: int, dg16: Any = None, du16: Any = None
) -> None:
    """dg and du of y = act(g) * u over n elements; du overwrites u (u is dead after the backward). dg16, du16
    (both or neither): also both as f16 there (the gate and up projections' tensor-core input-gradient operands,
    rounded as gpu/ops/half.py's to_f16 would)."""
    for buf, what in ((dy, "dy"), (g, "g"), (u, "u"), (dg, "dg")):
        need(buf, n, f"{gate}_backward {what}")
    half = [] if dg16 is None else [dg16, du16]
    for buf, what in zip(half, ("dg16", "du16"), strict=False):
        need(buf, n, f"{gate}_backward {what}", elem_bytes=2)
    pipe = pipeline(dev, f"{gate}_backward", half=bool(half))
    dev.dispatch(pipe, [pack(n, 0, 0, 0), dy, g, u, dg, *half], grid(n, 256))


def swiglu_forward(dev: Device, g: Any, u: Any, y: Any, n: int, y16: Any = None) -> None:
    gated_forward(dev, "swiglu", g, u, y, n, y16)


def swiglu_backward(dev: Device, dy: Any, g: Any, u: Any, dg: Any, n: int, dg16: Any = None, du16: Any = None) -> None:
    gated_backward(dev, "swiglu", dy, g, u, dg, n, dg16, du16)


def geglu_forward(dev: Device, g: Any, u: Any, y: Any, n: int, y16: Any = None) -> None:
    gated_forward(dev, "geglu", g, u, y, n, y16)


def geglu_backward(dev: Device, dy: Any, g: Any, u: Any, dg: Any, n: int, dg16: Any = None, du16: Any = None) -> None:
    gated_backward(dev, "geglu", dy, g, u, dg, n, dg16, du16)
