"""Causal GQA attention on tensor cores (Dawn subgroup matrices): the same contract as gpu/ops/attention.py
(q, out [T, Hq, D]; k, v [T, Hkv, D]; f32 in memory; lse [Hq, T] saved by the forward for the backward).

A call covers a batch of B sequences laid end to end (q [B T, Hq, D], ...; lse per sequence at a stride), each
kernel one dispatch with the sequence in grid z. Forward: pack q, k, v to f16 (zero padding rows), then one
flash-style kernel (QK^T and PV as 16 x 16 x 16 MMAs; one pass over the key tiles, O accumulated in its
result matrices against a lazy reference max, rescaled through workgroup memory only when a row's max passes it
by more than 8: gpu/kernels/attention_tc_forward.wgsl). Backward: delta = rowsum(dO * O) and max |dO| (f32), pack dO
scaled by a power of two sigma (so small gradients keep f16's precision), a dK/dV pass per query head (products
S^T, dP^T, P^T dO, dS^T Q on tensor cores) that also stores its f16 dS, and a dQ pass reading it back (dS K;
DQ_FROM_DS, else a dQ pass recomputing S, P, dP and dS itself), then the sum of each kv head's query heads in a
fixed order. Every pass streams its tiles through registers (the next tile's loads in flight during this
one's products). No [H, T, T] buffer; deterministic (no atomics on results).

Numerics: q, k, v, dO (scaled), P and dS are rounded to f16 for the products; everything else is f32. Held to
2e-3 of each output's max abs (out, lse, dq, dk, dv) against the float64 reference by
tests/test_gpu_attention_tc.py; measured on an H200 2026-12-03: 8e-5 .. 1.9e-3 (the largest: out with scores
spread 2x); on an H100 2026-12-05 with the lazy max: 2.2e-5 .. 1.7e-3, its rescaling exercised by scores that
climb every 64 keys. Head dims 64 and 128 (gpu/codegen_attention_tc.py); the model falls back to the f32 kernels
else."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

from gpu.codegen_attention_tc import (
    ATTENTION_TC_HEAD_DIMS,
    MATRIX,
    WIDE_FORWARD_SUBGROUPS,
    ds_store_halves,
    workgroup_rows,
)
from gpu.device import Device, DeviceError
from gpu.ops.attention import check_tensors
from gpu.ops.common import grid, need, pack
from gpu.ops.matmul_tc import tensor_core_problem
from gpu.ops.rope import RopeTable
from gpu.registry import pipeline

PAD_ROWS = 128  # packed operands carry this many zero rows past T rounded up to 16 (a workgroup's rows at most)
# the forward's subgroups a workgroup: 4 (64 query rows), or WIDE_FORWARD_SUBGROUPS (128 rows sharing each staged
# key tile of 32: attention_tc_forward8; bench/attention.py --forward-subgroups measures both) at the head dims of
# WIDE_FORWARD_HEAD_DIMS. 8: the 8B step on an H100 (2026-12-06) 4,831 against 4,808 tokens/s, the forward 25.0
# against 30.8 ms. At head dim 64 (TinyLlama, SmolLM2; key tiles of 32): the TinyLlama step on an H100 (2026-12-06)
# 22,394 against 22,214 tokens/s (+0.8 %), SmolLM2's the same within 0.1 %; bench/train_step.py --ab
# attention-forward4-d64 puts 4 subgroups back there
FORWARD_SUBGROUPS = 8
WIDE_FORWARD_HEAD_DIMS = (64, 128)
# the backward's passes with S and dP side by side in workgroup memory (4 barriers a key or query tile instead of 6;
# the dQ pass at head dim 128 only; bench/attention.py --paired-backward): on, the H100's 8B step 4,839 against
# 4,808 tokens/s, the backward 59.4 against 66.2 ms
PAIRED_BACKWARD = True
# dQ from the dS the dK/dV pass stores (attention_tc_backward_dkv_ds, then attention_tc_backward_dqs: dQ = dS K
# with nothing recomputed; with PAIRED_BACKWARD) instead of a dQ pass recomputing S, P, dP and dS. The store costs
# 2 B per causal (query, key) pair of a batch's query heads (ds_store_halves: 143 MB at B 4, T 1024, 32 heads) and
# is used only where it fits one binding. On: the H100's 8B step 5,823 / 5,826 against 5,769 / 5,778 tokens/s
# (2026-12-06), the backward 53.6 against 59.6 ms (dK/dV 40.9 with its stores, dQ 9.4 against 21.4)
DQ_FROM_DS = True
# each subgroup skips the products of the 16-key (dK/dV: 16-query) blocks the causal mask zeroes whole for its 16
# rows, in the forward, the dK/dV pass with the dS store and the dQ pass from it (skip_masked of
# gpu/codegen_attention_tc.py): the same results bitwise, ~5-8 % fewer products at T 1024 (the diagonal tiles).
# Off: the 8B step on an H100 (2026-12-08) 6,765 against 6,767 / 6,764 tokens/s (bench/train_step.py --ab
# attention-skip-masked), the workgroup waiting at each barrier for its busiest subgroup
SKIP_MASKED = False
# the forward: each subgroup moves its own lazy reference max and the subgroups' flags are exchanged after P's store,
# that exchange's barriers the tile's last (one_flag of gpu/codegen_attention_tc.py: one barrier pair a key tile
# fewer; P rounded against per-subgroup maxima, so within the tolerance, not bitwise). Off: the 8B step on an H100
# (2026-12-08) 6,775 against 6,767 / 6,764 tokens/s, inside the windows' spread (--ab attention-one-flag)
ONE_FLAG = False


@dataclass(frozen=True)
class RopeAt:
    """RoPE for the forward's q and k packs: the table, and each row's position (u32 [rows], rope_forward's)."""

    table: RopeTable
    positions: Any


def padded_rows(seq_len: int) -> int:
    """Rows of a packed f16 operand: every tile a kernel reads lies inside them."""
    return -(-seq_len // MATRIX) * MATRIX + PAD_ROWS


@dataclass
class AttentionTCScratch:
    """Packed f16 operands and backward scratch for one (T, Hq, Hkv, D); reused across calls."""

    q16: Any
    k16: Any
    v16: Any
    do16: Any
    stats: Any  # u32 max |dO| bits, then delta [B, Hq, T] f32, then a copy of lse [B, Hq, T]
    dkh: Any  # per-query-head dK, dV [T, Hq, D] (None when Hq == Hkv)
    dvh: Any
    ds: Any = None  # the dS store (DQ_FROM_DS; made on first use)

    @classmethod
    def build(cls, dev: Device, t: int, hq: int, hkv: int, d: int, b: int = 1) -> AttentionTCScratch:
        rows = b * padded_rows(t)
        per_q, per_kv = 2 * rows * hq * d, 2 * rows * hkv * d
        grouped = hq != hkv
        return cls(
            q16=dev.buffer(per_q, label="attention tc q16"),
            k16=dev.buffer(per_kv, label="attention tc k16"),
            v16=dev.buffer(per_kv, label="attention tc v16"),
            do16=dev.buffer(per_q, label="attention tc do16"),
            stats=dev.buffer(4 * (1 + 2 * b * hq * t), label="attention tc stats"),
            dkh=dev.buffer(4 * b * t * hq * d, label="attention tc dk per head") if grouped else None,
            dvh=dev.buffer(4 * b * t * hq * d, label="attention tc dv per head") if grouped else None,
        )


_scratch: weakref.WeakKeyDictionary[Device, dict[tuple[int, ...], AttentionTCScratch]]
_scratch = weakref.WeakKeyDictionary()


def scratch_for(dev: Device, t: int, hq: int, hkv: int, d: int, b: int = 1) -> AttentionTCScratch:
    """The device's scratch for this shape and batch (built once, so bind groups stay cached across steps)."""
    per_dev = _scratch.setdefault(dev, {})
    key = (t, hq, hkv, d, b)
    if key not in per_dev:
        per_dev[key] = AttentionTCScratch.build(dev, t, hq, hkv, d, b)
    return per_dev[key]


def _check(dev: Device, t: int, hq: int, hkv: int, d: int, b: int) -> None:
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
        raise ValueError(f"attention: seq_len={t} must be positive")
    if math.ceil(t / MATRIX) > 65535 or hq > 65535 or not 0 < b <= 65535:
        raise ValueError(f"attention: seq_len={t}, n_heads={hq}, n_seqs={b} exceed the dispatch grid")


def _pack(dev: Device, src: Any, dst: Any, t: int, heads: int, d: int, b: int, stats: Any = None) -> None:
    """dst (f16 [b, padded_rows(t), heads, d], padded rows zero) = src [b t, heads, d] (times sigma when stats
    is given)."""
    units, total = t * heads * d // 4, padded_rows(t) * heads * d // 4
    pipe = pipeline(dev, "pack_f16", scaled=stats is not None)
    bindings = [pack(units, total), src, dst] + ([stats] if stats is not None else [])
    dev.dispatch(pipe, bindings, grid(total, 256)[:2] + (b,))


def _pack_roped(dev: Device, src: Any, dst: Any, rope: RopeAt, t: int, heads: int, d: int, b: int) -> None:
    """dst as _pack gives it, of src with RoPE (rope_forward at rope.positions) applied on the way: the same f16."""
    table = rope.table
    if table.head_dim != d:
        raise ValueError(f"attention: a RoPE table of head dim {table.head_dim} for heads of {d}")
    need(rope.positions, b * t, "attention rope positions")
    pairs = padded_rows(t) * heads * d // 2
    prm = pack(t, padded_rows(t), heads, d, table.n_positions, 0, 0, 0)
    bindings = [prm, table.buffer, src, dst, rope.positions]
    dev.dispatch(pipeline(dev, "pack_f16_rope", neox=table.neox), bindings, grid(pairs, 64)[:2] + (b,))


def _pack_qkv(
    dev: Device,
    s: AttentionTCScratch,
    q: Any,
    k: Any,
    v: Any,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    b: int,
    rope: RopeAt | None = None,
) -> None:
    """The f16 operands of q, k, v (rope: q and k RoPE'd on the way)."""
    if rope is None:
        _pack(dev, q, s.q16, t, hq, d, b)
        _pack(dev, k, s.k16, t, hkv, d, b)
    else:
        _pack_roped(dev, q, s.q16, rope, t, hq, d, b)
        _pack_roped(dev, k, s.k16, rope, t, hkv, d, b)
    _pack(dev, v, s.v16, t, hkv, d, b)


def _params(t: int, hq: int, hkv: int, d: int, lse_stride: int) -> bytes:
    return pack(t, hq, hkv, 1.0 / math.sqrt(d), padded_rows(t), lse_stride)


def _check_batch(t: int, hq: int, hkv: int, d: int, b: int, lse_stride: int | None, lse: Any, **tensors: Any) -> int:
    """Size checks for a batch of b sequences; the lse stride (floats per sequence, default Hq T)."""
    stride = hq * t if lse_stride is None else lse_stride
    if stride < hq * t:
        raise ValueError(f"attention: lse_stride={stride} is below n_heads * seq_len = {hq * t}")
    check_tensors(b * t, hq, hkv, d, **tensors)
    need(lse, (b - 1) * stride + hq * t, "attention lse")
    return stride


def attention_forward_tc(
    dev: Device,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    n_seqs: int = 1,
    lse_stride: int | None = None,
    rope: RopeAt | None = None,
) -> None:
    """out [T, Hq, D] = causal softmax(q k^T / sqrt(D)) v on tensor cores; lse [Hq, T] (f32) for the backward.
    Same arguments as gpu.ops.attention.attention_forward, plus a batch: n_seqs sequences of seq_len laid end
    to end in q, k, v, out, and lse's [Hq, T] per sequence lse_stride floats apart (default Hq T). rope: q and k
    are given before RoPE, applied as they are packed (the f16 operands bitwise those of rope_forward's output)."""
    t, hq, hkv, d, b = seq_len, n_heads, n_kv_heads, head_dim, n_seqs
    _check(dev, t, hq, hkv, d, b)
    stride = _check_batch(t, hq, hkv, d, b, lse_stride, lse, q=q, k=k, v=v, out=out)
    s = scratch_for(dev, t, hq, hkv, d, b)
    _pack_qkv(dev, s, q, k, v, t, hq, hkv, d, b, rope)
    wide = FORWARD_SUBGROUPS == WIDE_FORWARD_SUBGROUPS and d in WIDE_FORWARD_HEAD_DIMS
    name = "attention_tc_forward8" if wide else "attention_tc_forward"
    pipe = pipeline(dev, name, head_dim=d, skip_masked=SKIP_MASKED, one_flag=ONE_FLAG)
    grid_rows = (math.ceil(t / workgroup_rows(FORWARD_SUBGROUPS if wide else 4)), hq, b)
    dev.dispatch(pipe, [_params(t, hq, hkv, d, stride), s.q16, s.k16, s.v16, out, lse], grid_rows)


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
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    delta: Any = None,
    n_seqs: int = 1,
    lse_stride: int | None = None,
    packed: bool = False,
) -> None:
    """(dq, dk, dv) of attention_forward_tc given dout, the forward's out and lse, on tensor cores. Same
    arguments as attention_forward_tc plus gpu.ops.attention.attention_backward's (`delta` is accepted and
    unused: the scratch holds it). The dO scale sigma is one for the whole batch. packed: the scratch's f16 q, k, v
    are these q, k, v's already (the last attention_forward_tc of this shape was over them): not packed again."""
    t, hq, hkv, d, b = seq_len, n_heads, n_kv_heads, head_dim, n_seqs
    _check(dev, t, hq, hkv, d, b)
    tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "dq": dq, "dk": dk, "dv": dv}
    stride = _check_batch(t, hq, hkv, d, b, lse_stride, lse, **tensors)
    s = scratch_for(dev, t, hq, hkv, d, b)
    if not packed:
        _pack_qkv(dev, s, q, k, v, t, hq, hkv, d, b)
    dev.clear(s.stats, 0, 4)
    delta_pipe = pipeline(dev, "attention_tc_delta", head_dim=d)
    dev.dispatch(delta_pipe, [pack(t, hq, b, stride), dout, out, s.stats, lse], grid(b * t * hq, 64))
    _pack(dev, dout, s.do16, t, hq, d, b, stats=s.stats)
    params = _params(t, hq, hkv, d, stride)
    rows = (math.ceil(t / workgroup_rows()), hq, b)
    dkh, dvh = (dk, dv) if hq == hkv else (s.dkh, s.dvh)
    if DQ_FROM_DS and PAIRED_BACKWARD and _ds_store(dev, s, t, hq, b):
        dkv = pipeline(dev, "attention_tc_backward_dkv_ds", head_dim=d, skip_masked=SKIP_MASKED)
        dev.dispatch(dkv, [params, s.q16, s.k16, s.v16, s.do16, s.ds, s.stats, dkh, dvh], rows)
        dqs = pipeline(dev, "attention_tc_backward_dqs", head_dim=d, skip_masked=SKIP_MASKED)
        dev.dispatch(dqs, [params, s.k16, s.ds, s.stats, dq], rows)
    else:
        operands = [params, s.q16, s.k16, s.v16, s.do16, lse, s.stats]
        paired_dq = "_paired" if PAIRED_BACKWARD and d == 128 else ""
        dev.dispatch(pipeline(dev, f"attention_tc_backward_dq{paired_dq}", head_dim=d), [*operands, dq], rows)
        dkv = pipeline(dev, "attention_tc_backward_dkv" + ("_paired" if PAIRED_BACKWARD else ""), head_dim=d)
        dev.dispatch(dkv, [*operands, dkh, dvh], rows)
    if hq == hkv:
        return
    units = b * t * hkv * d // 4
    red = pipeline(dev, "attention_tc_reduce")
    dev.dispatch(red, [pack(units, hq // hkv, d // 4), s.dkh, s.dvh, dk, dv], grid(units, 256))


def _ds_store(dev: Device, s: AttentionTCScratch, t: int, hq: int, b: int) -> bool:
    """Whether the dS store of this shape fits one binding (and its offsets 32 bits); made on first use."""
    n_bytes = 2 * ds_store_halves(t, hq, b)
    if n_bytes > min(dev.max_binding, 1 << 32):
        return False
    if s.ds is None:
        s.ds = dev.buffer(n_bytes, label="attention tc dS store")
    return True
