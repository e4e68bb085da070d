"""Deterministic single-workgroup sums (loss totals, mask counts)."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import need, pack
from gpu.registry import pipeline


def reduce_sum(dev: Device, x: Any, out: Any, n: int, *, out_index: int = 0, alpha: float = 1.0) -> None:
    """out[out_index] = alpha * sum(x[:n]) (f32), summed in a fixed order."""
    need(x, n, "reduce_sum input")
    need(out, out_index + 1, "reduce_sum output")
    dev.dispatch(pipeline(dev, "reduce_sum"), [pack(n, out_index, alpha, 0), x, out], 1)


def count_nonzero(dev: Device, x: Any, out: Any, n: int, *, out_index: int = 0) -> None:
    """out[out_index] = number of nonzero u32 entries of x[:n], as f32."""
    need(x, n, "count_nonzero input")
    need(out, out_index + 1, "count_nonzero output")
    dev.dispatch(pipeline(dev, "count_nonzero"), [pack(n, out_index, 1.0, 0), x, out], 1)
