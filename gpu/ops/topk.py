"""Teacher top-k per row over logits chunks: ids + log-probs at temperature tau + tail mass (the precompute's
stored distribution). Rows keep a running top-k ordered by (logit desc, id asc) and an online logsumexp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.ops.head import Int8Head, logits_chunk
from gpu.registry import TOPK_SORT_SIZES, pipeline

MAX_SORT = max(TOPK_SORT_SIZES)  # (key, id) pairs sorted per workgroup
MAX_K = 256
TOPK_STEP = 1024  # columns a step of topk.wgsl takes (its STEP): NS holds the list and one step's candidates


@dataclass(frozen=True)
class TopKState:
    """Running state for n_tokens rows: vals/ids [T, k] (best logits so far), lse [T, 2] (max, sum exp)."""

    n_tokens: int
    k: int
    vals: Any
    ids: Any
    lse: Any

    @classmethod
    def build(cls, dev: Device, n_tokens: int, k: int) -> TopKState:
        if not 1 <= k <= MAX_K:
            raise ValueError(f"top-k: k={k} must be in 1..{MAX_K}")
        t = n_tokens
        return cls(
            t,
            k,
            dev.buffer(4 * t * k, label="topk vals"),
            dev.buffer(4 * t * k, label="topk ids"),
            dev.buffer(8 * t, label="topk lse"),
        )


def _sort_size(k: int, n_cols: int) -> int:
    ns = 1
    while ns < min(MAX_SORT, k + n_cols):
        ns *= 2
    return ns


def topk_chunk(
    dev: Device,
    st: TopKState,
    logits: Any,
    n_cols: int,
    v0: int,
    tau: float,
    *,
    first: bool,
    ld: int | None = None,
    col_offset: int = 0,
) -> None:
    """Fold logits [T, n_cols] (row stride ld, starting at column col_offset; vocab ids v0 ..) into the state,
    one dispatch (topk.wgsl sorts as often as its NS pairs need). first=True for the first chunk of a pass
    (resets the state)."""
    t, k = st.n_tokens, st.k
    ld = n_cols if ld is None else ld
    need(logits, (t - 1) * ld + col_offset + n_cols, "topk logits")
    ns = _sort_size(k, max(n_cols, TOPK_STEP))  # room for the list and one step's candidates at least
    params = pack(t, n_cols, ld, col_offset, v0, k, 1.0 / tau, first)
    dev.dispatch(pipeline(dev, "topk", ns=ns), [params, logits, st.vals, st.ids, st.lse], grid(t, 1))


def topk_finish(dev: Device, st: TopKState, logprobs: Any, tail: Any, tau: float) -> None:
    """logprobs [T, k] = kept logits / tau - logsumexp(z / tau); tail [T] = max(0, 1 - sum exp(logprobs)).
    The ids are st.ids (u32 [T, k]), best first."""
    t, k = st.n_tokens, st.k
    need(logprobs, t * k, "topk logprobs")
    need(tail, t, "topk tail")
    pipe = pipeline(dev, "topk_finish")
    dev.dispatch(pipe, [pack(t, k, 1.0 / tau, 0), st.vals, st.lse, logprobs, tail], grid(t, 64))


def hidden_topk(
    dev: Device,
    h: Any,
    w: Any,
    st: TopKState,
    logprobs: Any,
    tail: Any,
    hidden: int,
    vocab: int,
    tau: float,
    *,
    logits_scratch: Any = None,
    chunk: int = 4096,
    h16: Any = None,
    i8: Int8Head | None = None,
) -> None:
    """Top-k of logits = h [T, H] . W^T (W f32 [V, H]) computed chunk by chunk (never [T, V] at once); h16: h
    as f16 for tensor-core logits, i8: buffers for integer-GEMM logits (gpu/ops/head.py)."""
    t = st.n_tokens
    chunk = min(chunk, vocab)
    if logits_scratch is None:
        logits_scratch = dev.buffer(4 * t * chunk, label="topk logits chunk")
    if i8 is not None:
        i8.quantize(dev, h)
    for c0 in range(0, vocab, chunk):
        nv = min(chunk, vocab - c0)
        logits_chunk(dev, h, w, logits_scratch, t, hidden, c0, nv, chunk, h16, i8)
        topk_chunk(dev, st, logits_scratch, nv, c0, tau, first=c0 == 0, ld=chunk)
    topk_finish(dev, st, logprobs, tail, tau)
