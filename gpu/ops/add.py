"""Residual add: y = a + b, the in-place accumulate y += b, and a row bias y[r, :] += b."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline


def add(dev: Device, a: Any, b: Any, y: Any, n: int) -> None:
    """y = a + b over n elements (y must not alias a or b; use add_inplace)."""
    for buf, what in ((a, "a"), (b, "b"), (y, "y")):
        need(buf, n, f"add {what}")
    dev.dispatch(pipeline(dev, "add"), [pack(n, 0, 0, 0), a, b, y], grid(n, 256))


def add_inplace(dev: Device, y: Any, b: Any, n: int) -> None:
    """y += b over n elements."""
    need(y, n, "add_inplace y")
    need(b, n, "add_inplace b")
    dev.dispatch(pipeline(dev, "add_inplace"), [pack(n, 0, 0, 0), b, y], grid(n, 256))


def add_bias(dev: Device, y: Any, b: Any, n_rows: int, width: int) -> None:
    """y[r, j] += b[j] for y [n_rows, width] (a frozen projection bias)."""
    need(y, n_rows * width, "add_bias y")
    need(b, width, "add_bias b")
    n = n_rows * width
    dev.dispatch(pipeline(dev, "add_bias"), [pack(n, 0, width, 0), b, y], grid(n, 256))


def scale_inplace(dev: Device, y: Any, alpha: float, n: int) -> None:
    """y *= alpha over n elements."""
    need(y, n, "scale_inplace y")
    dev.dispatch(pipeline(dev, "scale"), [pack(n, float(alpha), 0, 0), y], grid(n, 256))
