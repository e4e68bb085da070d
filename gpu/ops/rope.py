"""NORM RoPE (adjacent pairs, llama.cpp) forward and backward from a host-built cos/sin table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of pos * base^(-2i/D) for pos < n_positions, computed in float64 (as model/reference.py) and
    stored f32 as [n_positions, D/2] (cos, sin) pairs."""

    buffer: Any
    head_dim: int
    base: float
    n_positions: int

    @classmethod
    def build(cls, dev: Device, head_dim: int, base: float, n_positions: int) -> RopeTable:
        if head_dim % 2:
            raise ValueError(f"RopeTable: head_dim={head_dim} must be even")
        inv_freq = float(base) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        angle = np.arange(n_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
        cs = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
        return cls(dev.upload(cs, label=f"rope cos/sin D={head_dim}"), head_dim, float(base), n_positions)


def _rope(
    dev: Device, table: RopeTable, x: Any, y: Any, n_tokens: int, n_heads: int, sign: float, positions: Any, start: int
) -> None:
    d = table.head_dim
    need(x, n_tokens * n_heads * d, "rope input")
    need(y, n_tokens * n_heads * d, "rope output")
    if positions is None:
        if start + n_tokens > table.n_positions:
            raise ValueError(f"rope: positions {start}..{start + n_tokens - 1} exceed the table's {table.n_positions}")
        pipe = pipeline(dev, "rope")
        extra = []
    else:
        need(positions, n_tokens, "rope positions")
        pipe = pipeline(dev, "rope_positions")
        extra = [positions]
    params = pack(n_tokens, n_heads, d, start, sign, table.n_positions, 0, 0)
    dev.dispatch(pipe, [params, table.buffer, x, y, *extra], grid(n_tokens * n_heads * d // 2, 64))


def rope_forward(
    dev: Device,
    table: RopeTable,
    x: Any,
    y: Any,
    n_tokens: int,
    n_heads: int,
    *,
    positions: Any = None,
    start: int = 0,
) -> None:
    """y [T, n_heads, D] = x rotated by position start + (positions[t] if given else t) (y must not alias x)."""
    _rope(dev, table, x, y, n_tokens, n_heads, 1.0, positions, start)


def rope_backward(
    dev: Device,
    table: RopeTable,
    dy: Any,
    dx: Any,
    n_tokens: int,
    n_heads: int,
    *,
    positions: Any = None,
    start: int = 0,
) -> None:
    """dx = dy rotated by the opposite angle."""
    _rope(dev, table, dy, dx, n_tokens, n_heads, -1.0, positions, start)
