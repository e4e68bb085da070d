"""Embedding gather from a frozen table kept in its GGML type (F32, F16, Q8_0, Q4_x, ...; decoded in-kernel)."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.registry import pipeline
from gpu.weights import QuantTensor


def embedding_forward(dev: Device, table: QuantTensor, ids: Any, out: Any, n_tokens: int) -> None:
    """out[T, H] = table[ids[t], :] for ids (u32 [T]); table of numpy shape (V, H). Ids >= V are clamped."""
    v, h = table.shape
    name = table.name or "embedding table"
    if h % 4:
        raise ValueError(f"embedding_forward: {name!r} row length {h} is not a multiple of 4")
    need(ids, n_tokens, f"embedding_forward ids for {name!r}")
    need(out, n_tokens * h, f"embedding_forward output for {name!r}")
    pipe = pipeline(dev, "embedding", wtype=table.qtype.name)
    dev.dispatch(pipe, [pack(n_tokens, h, v, 0), table.binding, ids, out], grid(n_tokens * h // 4, 64))
