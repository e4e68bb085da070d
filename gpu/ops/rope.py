"""RoPE forward and backward from a host-built cos/sin table: llama.cpp's NORM pairs (adjacent, llama) or NEOX
pairs (halves, qwen2/qwen3), angles optionally divided by Llama 3's frequency factors (rope_freqs.weight)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline
from model.config import ModelConfig
from model.reference import rope_inv_freq


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of pos * theta_i for pos < n_positions (theta as model.reference.rope_inv_freq: base^(-2i/D) / f_i),
    computed in float64 and stored f32 as [n_positions, D/2] (cos, sin) pairs; `neox` picks the pair layout."""

    buffer: Any
    head_dim: int
    base: float
    n_positions: int
    neox: bool = False

    @classmethod
    def build(
        cls,
        dev: Device,
        head_dim: int,
        base: float,
        n_positions: int,
        *,
        factors: tuple[float, ...] | np.ndarray | None = None,
        neox: bool = False,
    ) -> RopeTable:
        if head_dim % 2:
            raise ValueError(f"RopeTable: head_dim={head_dim} must be even")
        angle = np.arange(n_positions, dtype=np.float64)[:, None] * rope_inv_freq(head_dim, base, factors)[None, :]
        cs = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
        return cls(dev.upload(cs, label=f"rope cos/sin D={head_dim}"), head_dim, float(base), n_positions, neox)

    @classmethod
    def for_model(cls, dev: Device, cfg: ModelConfig, n_positions: int, layer: int | None = None) -> RopeTable:
        """The table of a model's RoPE for block `layer` (None: a global block), base and factors as
        ModelConfig.rope_of gives them (Llama 3 or linear scaling, gemma3's sliding blocks' own base)."""
        base, factors = cfg.rope_of(layer)
        return cls.build(dev, cfg.head_dim, base, n_positions, factors=factors, neox=cfg.rope_type == "neox")


def _rope(
    dev: Device, table: RopeTable, x: Any, y: Any, n_tokens: int, n_heads: int, sign: float, positions: Any, start: int
) -> None:
    d = table.head_dim
    need(x, n_tokens * n_heads * d, "rope input")
    need(y, n_tokens * n_heads * d, "rope output")
    if positions is None:
        if start + n_tokens > table.n_positions:
            raise ValueError(f"rope: positions {start}..{start + n_tokens - 1} exceed the table's {table.n_positions}")
        pipe = pipeline(dev, "rope", neox=table.neox)
        extra = []
    else:
        need(positions, n_tokens, "rope positions")
        pipe = pipeline(dev, "rope_positions", neox=table.neox)
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
