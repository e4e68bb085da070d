"""Causal GQA attention, flash style: forward with a saved row logsumexp, backward recomputing the scores
tile by tile (dQ pass, then a dK/dV pass per kv head that sums its query heads in a fixed order)."""

from __future__ import annotations

import math
from typing import Any

from gpu.device import Device
from gpu.ops.common import need, pack
from gpu.registry import ATTENTION_ROWS, HEAD_DIMS, pipeline


def _check(t: int, hq: int, hkv: int, d: int, tensors: dict[str, tuple[Any, int]]) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"attention: head_dim={d} has no kernel variant; gpu/registry.py HEAD_DIMS lists {HEAD_DIMS}")
    if hq % hkv:
        raise ValueError(f"attention: n_heads={hq} is not a multiple of n_kv_heads={hkv}")
    if t <= 0:
        raise ValueError(f"attention: n_tokens={t} must be positive")
    if math.ceil(t / ATTENTION_ROWS) > 65535 or hq > 65535:
        raise ValueError(f"attention: n_tokens={t}, n_heads={hq} exceed the dispatch grid")
    for name, (buf, n) in tensors.items():
        need(buf, n, f"attention {name}")


def attention_forward(
    dev: Device, q: Any, k: Any, v: Any, out: Any, lse: Any, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int
) -> None:
    """out [T, Hq, D] = causal softmax(q k^T / sqrt(D)) v; lse [Hq, T] (f32) saved for the backward.
    q [T, Hq, D]; k, v [T, Hkv, D]; query head h reads kv head h // (Hq // Hkv)."""
    t, hq, hkv, d = n_tokens, n_heads, n_kv_heads, head_dim
    nq, nkv = t * hq * d, t * hkv * d
    _check(t, hq, hkv, d, {"q": (q, nq), "k": (k, nkv), "v": (v, nkv), "out": (out, nq), "lse": (lse, hq * t)})
    pipe = pipeline(dev, "attention_forward", head_dim=d)
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    dev.dispatch(pipe, [params, q, k, v, out, lse], (math.ceil(t / ATTENTION_ROWS), hq))


def attention_backward(
    dev: Device,
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dq: Any,
    dk: Any,
    dv: Any,
    n_tokens: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    delta: Any = None,
) -> None:
    """(dq, dk, dv) of attention_forward given dout, the forward's out and lse. `delta` is an [Hq, T] f32
    scratch (allocated when None; pass one to keep bind groups cached across steps)."""
    t, hq, hkv, d = n_tokens, n_heads, n_kv_heads, head_dim
    nq, nkv = t * hq * d, t * hkv * d
    if delta is None:
        delta = dev.buffer(hq * t * 4, label="attention delta")
    _check(
        t,
        hq,
        hkv,
        d,
        {
            "dout": (dout, nq),
            "q": (q, nq),
            "k": (k, nkv),
            "v": (v, nkv),
            "out": (out, nq),
            "lse": (lse, hq * t),
            "dq": (dq, nq),
            "dk": (dk, nkv),
            "dv": (dv, nkv),
            "delta": (delta, hq * t),
        },
    )
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    pipe = pipeline(dev, "attention_backward_dq", head_dim=d)
    dev.dispatch(pipe, [params, q, k, v, out, dout, lse, dq, delta], (math.ceil(t / ATTENTION_ROWS), hq))
    pipe = pipeline(dev, "attention_backward_dkv", head_dim=d)
    dev.dispatch(pipe, [params, q, k, v, dout, lse, delta, dk, dv], (math.ceil(t / ATTENTION_ROWS), hkv))
