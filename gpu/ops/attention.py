"""Causal GQA attention, flash style: forward with a saved row logsumexp, backward recomputing the scores
tile by tile (dQ pass, then a dK/dV pass per kv head that sums its query heads in a fixed order)."""

from __future__ import annotations

import math
from typing import Any

from gpu.device import Device
from gpu.ops.common import need, pack, pipeline

BQ = 64  # rows (threads) per workgroup


def key_tile(head_dim: int) -> int:
    """Keys (or queries) staged per tile: two BK x D f32 tiles stay within 16 KiB of workgroup memory."""
    return 32 if head_dim <= 64 else 16 if head_dim <= 128 else 8


def _consts(head_dim: int) -> dict[str, int]:
    bk = key_tile(head_dim)
    return {"D": head_dim, "DV": head_dim // 4, "BQ": BQ, "BK": bk, "BKD": bk * head_dim, "BKDV": bk * head_dim // 4}


def _check(t: int, hq: int, hkv: int, d: int, tensors: dict[str, tuple[Any, int]]) -> None:
    if d % 4:
        raise ValueError(f"attention: head_dim={d} must be a multiple of 4")
    if hq % hkv:
        raise ValueError(f"attention: n_heads={hq} is not a multiple of n_kv_heads={hkv}")
    if t <= 0:
        raise ValueError(f"attention: n_tokens={t} must be positive")
    if math.ceil(t / BQ) > 65535 or hq > 65535:
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
    pipe = pipeline(dev, "attention_forward", ("attention_common", "attention_kv_tile"), **_consts(d))
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    dev.dispatch(pipe, [params, q, k, v, out, lse], (math.ceil(t / BQ), hq))


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
    c = _consts(d)
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    pipe = pipeline(dev, "attention_backward_dq", ("attention_common", "attention_kv_tile"), **c)
    dev.dispatch(pipe, [params, q, k, v, out, dout, lse, dq, delta], (math.ceil(t / BQ), hq))
    pipe = pipeline(dev, "attention_backward_dkv", ("attention_common",), **c)
    dev.dispatch(pipe, [params, q, k, v, dout, lse, delta, dk, dv], (math.ceil(t / BQ), hkv))
