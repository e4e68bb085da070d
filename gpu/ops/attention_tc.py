"""Causal GQA attention on tensor cores (Dawn subgroup matrices): the same contract as gpu/ops/attention.py
(q, out [T, Hq, D]; k, v [T, Hkv, D]; f32 in memory; lse [Hq, T] saved by the forward for the backward).

Forward: pack q, k, v to f16 (zero padding rows), then one flash-style kernel (QK^T and PV as 16 x 16 x 16
MMAs; two passes over the key tiles: the f32 row max / sum, then P = exp(S - L) and PV into f32 accumulators,
so the opaque accumulators are never rescaled). Backward: delta = rowsum(dO * O) and max |dO| (f32), pack dO
scaled by a power of two sigma (so small gradients keep f16's precision), a dQ pass and a dK/dV pass per
query head (products S, dP, dS K, P^T dO, dS^T Q on tensor cores), then the sum of each kv head's query heads
in a fixed order. No [H, T, T] buffer; deterministic (no atomics on results).

Numerics: q, k, v, dO (scaled), P and dS are rounded to f16 for the products; everything else is f32. Held to
2e-3 of each output's max abs (out, lse, dq, dk, dv) against the float64 reference by
tests/test_gpu_attention_tc.py; measured on an H200 2026-12-03: 8e-5 .. 1.9e-3 (the largest: out with scores
spread 2x). Head dims 64 and 128 (gpu/codegen_attention_tc.py); the model falls back to the f32 kernels else."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

from gpu.codegen_attention_tc import ATTENTION_TC_HEAD_DIMS, MATRIX, workgroup_rows
from gpu.device import Device, DeviceError
from gpu.ops.attention import check_tensors
from gpu.ops.common import grid, pack
from gpu.ops.matmul_tc import tensor_core_problem
from gpu.registry import pipeline

PAD_ROWS = 64  # packed operands carry this many zero rows past T rounded up to 16 (the widest tile)


def padded_rows(n_tokens: int) -> int:
    """Rows of a packed f16 operand: every tile a kernel reads lies inside them."""
    return -(-n_tokens // MATRIX) * MATRIX + PAD_ROWS


@dataclass
class AttentionTCScratch:
    """Packed f16 operands and backward scratch for one (T, Hq, Hkv, D); reused across calls."""

    q16: Any
    k16: Any
    v16: Any
    do16: Any
    stats: Any  # u32 max |dO| bits, then delta [Hq, T] f32
    dkh: Any  # per-query-head dK, dV [T, Hq, D] (None when Hq == Hkv)
    dvh: Any

    @classmethod
    def build(cls, dev: Device, t: int, hq: int, hkv: int, d: int) -> AttentionTCScratch:
        rows = padded_rows(t)
        per_q, per_kv = 2 * rows * hq * d, 2 * rows * hkv * d
        grouped = hq != hkv
        return cls(
            q16=dev.buffer(per_q, label="attention tc q16"),
            k16=dev.buffer(per_kv, label="attention tc k16"),
            v16=dev.buffer(per_kv, label="attention tc v16"),
            do16=dev.buffer(per_q, label="attention tc do16"),
            stats=dev.buffer(4 * (1 + hq * t), label="attention tc stats"),
            dkh=dev.buffer(4 * t * hq * d, label="attention tc dk per head") if grouped else None,
            dvh=dev.buffer(4 * t * hq * d, label="attention tc dv per head") if grouped else None,
        )


_scratch: weakref.WeakKeyDictionary[Device, dict[tuple[int, int, int, int], AttentionTCScratch]]
_scratch = weakref.WeakKeyDictionary()


def scratch_for(dev: Device, t: int, hq: int, hkv: int, d: int) -> AttentionTCScratch:
    """The device's scratch for this shape (built once, so bind groups stay cached across steps)."""
    per_dev = _scratch.setdefault(dev, {})
    key = (t, hq, hkv, d)
    if key not in per_dev:
        per_dev[key] = AttentionTCScratch.build(dev, t, hq, hkv, d)
    return per_dev[key]


def _check(dev: Device, t: int, hq: int, hkv: int, d: int) -> None:
    problem = tensor_core_problem(dev)
    if problem is not None:
        raise DeviceError(f"tensor-core attention: {problem}")
    if d not in ATTENTION_TC_HEAD_DIMS:
        raise ValueError(
            f"tensor-core attention: head_dim={d} has no kernel; gpu/codegen_attention_tc.py generates "
            f"{ATTENTION_TC_HEAD_DIMS} (precision f32 covers the others)"
        )
    if hq % hkv:
        raise ValueError(f"attention: n_heads={hq} is not a multiple of n_kv_heads={hkv}")
    if t <= 0:
        raise ValueError(f"attention: n_tokens={t} must be positive")
    if math.ceil(t / MATRIX) > 65535 or hq > 65535:
        raise ValueError(f"attention: n_tokens={t}, n_heads={hq} exceed the dispatch grid")


def _pack(dev: Device, src: Any, dst: Any, t: int, heads: int, d: int, stats: Any = None) -> None:
    """dst (f16, padded rows zero) = src [t, heads, d] (times sigma when stats is given)."""
    units, total = t * heads * d // 4, padded_rows(t) * heads * d // 4
    pipe = pipeline(dev, "pack_f16", scaled=stats is not None)
    bindings = [pack(units, total), src, dst] + ([stats] if stats is not None else [])
    dev.dispatch(pipe, bindings, grid(total, 256))


def _pack_qkv(dev: Device, s: AttentionTCScratch, q: Any, k: Any, v: Any, t: int, hq: int, hkv: int, d: int):
    _pack(dev, q, s.q16, t, hq, d)
    _pack(dev, k, s.k16, t, hkv, d)
    _pack(dev, v, s.v16, t, hkv, d)


def attention_forward_tc(
    dev: Device,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    n_tokens: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> None:
    """out [T, Hq, D] = causal softmax(q k^T / sqrt(D)) v on tensor cores; lse [Hq, T] (f32) for the backward.
    Same arguments as gpu.ops.attention.attention_forward."""
    t, hq, hkv, d = n_tokens, n_heads, n_kv_heads, head_dim
    _check(dev, t, hq, hkv, d)
    check_tensors(t, hq, hkv, d, q=q, k=k, v=v, out=out, lse=lse)
    s = scratch_for(dev, t, hq, hkv, d)
    _pack_qkv(dev, s, q, k, v, t, hq, hkv, d)
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    pipe = pipeline(dev, "attention_tc_forward", head_dim=d)
    dev.dispatch(pipe, [params, s.q16, s.k16, s.v16, out, lse], (math.ceil(t / workgroup_rows()), hq))


def attention_backward_tc(
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
    """(dq, dk, dv) of attention_forward_tc given dout, the forward's out and lse, on tensor cores. Same
    arguments as gpu.ops.attention.attention_backward (`delta` is accepted and unused: the scratch holds it)."""
    t, hq, hkv, d = n_tokens, n_heads, n_kv_heads, head_dim
    _check(dev, t, hq, hkv, d)
    check_tensors(t, hq, hkv, d, dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    s = scratch_for(dev, t, hq, hkv, d)
    _pack_qkv(dev, s, q, k, v, t, hq, hkv, d)
    dev.clear(s.stats, 0, 4)
    delta_pipe = pipeline(dev, "attention_tc_delta", head_dim=d)
    dev.dispatch(delta_pipe, [pack(t, hq), dout, out, s.stats], grid(t * hq, 64))
    _pack(dev, dout, s.do16, t, hq, d, stats=s.stats)
    params = pack(t, hq, hkv, 1.0 / math.sqrt(d))
    operands = [params, s.q16, s.k16, s.v16, s.do16, lse, s.stats]
    rows = (math.ceil(t / workgroup_rows()), hq)
    dev.dispatch(pipeline(dev, "attention_tc_backward_dq", head_dim=d), [*operands, dq], rows)
    dkv = pipeline(dev, "attention_tc_backward_dkv", head_dim=d)
    if hq == hkv:
        dev.dispatch(dkv, [*operands, dk, dv], rows)
        return
    dev.dispatch(dkv, [*operands, s.dkh, s.dvh], rows)
    units = t * hkv * d // 4
    red = pipeline(dev, "attention_tc_reduce")
    dev.dispatch(red, [pack(units, hq // hkv, d // 4), s.dkh, s.dvh, dk, dv], grid(units, 256))
