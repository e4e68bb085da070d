"""Causal GQA attention, flash style: forward with a saved row logsumexp, backward recomputing the scores
tile by tile (dQ pass, then a dK/dV pass per kv head that sums its query heads in a fixed order)."""

from __future__ import annotations

import math
from typing import Any

from gpu.device import Device
from gpu.ops.common import need, pack
from gpu.registry import ATTENTION_ROWS, HEAD_DIMS, pipeline

_KV_SHAPED = ("k", "v", "dk", "dv")  # [T, Hkv, D]; lse and delta are [Hq, T]; the others [T, Hq, D]


def check_tensors(t: int, hq: int, hkv: int, d: int, **tensors: Any) -> None:
    """Raise DeviceError naming the first attention tensor too small for its shape (q, out, dout, dq: [T, Hq, D];
    k, v, dk, dv: [T, Hkv, D]; lse, delta: [Hq, T]); shared with the tensor-core ops."""
    for name, buf in tensors.items():
        n = hq * t if name in ("lse", "delta") else t * (hkv if name in _KV_SHAPED else hq) * d
        need(buf, n, f"attention {name}")


def _check(t: int, hq: int, hkv: int, d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"attention: head_dim={d} has no kernel variant; gpu/registry.py HEAD_DIMS lists {HEAD_DIMS}")
    if hq % hkv:
        raise ValueError(f"attention: n_heads={hq} is not a multiple of n_kv_heads={hkv}")
    if t <= 0:
        raise ValueError(f"attention: seq_len={t} must be positive")
    if math.ceil(t / ATTENTION_ROWS) > 65535 or hq > 65535:
        raise ValueError(f"attention: seq_len={t}, n_heads={hq} exceed the dispatch grid")


def attention_forward(
    dev: Device, q: Any, k: Any, v: Any, out: Any, lse: Any, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int
) -> None:
    """out [T, Hq, D] = causal softmax(q k^T / sqrt(D)) v; lse [Hq, T] (f32) saved for the backward.
    q [T, Hq, D]; k, v [T, Hkv, D]; query head h reads kv head h // (Hq // Hkv)."""
    t, hq, hkv, d = seq_len, n_heads, n_kv_heads, head_dim
    _check(t, hq, hkv, d)
    check_tensors(t, hq, hkv, d, q=q, k=k, v=v, out=out, lse=lse)
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
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    delta: Any = None,
) -> None:
    """(dq, dk, dv) of attention_forward given dout, the forward's out and lse. `delta` is an [Hq, T] f32
    scratch (allocated when None; pass one to keep bind groups cached across steps)."""
    t, hq, hkv, d = seq_len, n_heads, n_kv_heads, head_dim
    if delta is None:
        delta = dev.buffer(hq * t * 4, label="attention delta")
    _check(t, hq, hkv, d)
    check_tensors(t, hq, hkv, d, dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv, delta=delta)
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    pipe = pipeline(dev, "attention_backward_dq", head_dim=d)
    dev.dispatch(pipe, [params, q, k, v, out, dout, lse, dq, delta], (math.ceil(t / ATTENTION_ROWS), hq))
    pipe = pipeline(dev, "attention_backward_dkv", head_dim=d)
    dev.dispatch(pipe, [params, q, k, v, dout, lse, delta, dk, dv], (math.ceil(t / ATTENTION_ROWS), hkv))
