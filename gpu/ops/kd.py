"""lm_head + KD loss fused over vocab chunks (model/kd.py semantics), never holding the [T, V] logits.

Pass 1, per chunk: logits Z_c = h W_c^T (strided_matmul), then kd_stats folds them into each row's online
logsumexp (at tau and at 1) and gathers the logits at the teacher ids and the target. kd_row then gives the
per-row loss and dL/da (a = log softmax(z/tau)[ids]). Pass 2, per chunk: recompute Z_c, turn it into dL/dZ_c in
place (kd_grad) and accumulate dh += dZ_c W_c, chunks in ascending order. Everything is reproducible.

One pass instead (a scratch built with `hidden`, a quantized head, no dh accumulation, and CE only at tau = 1):
dL/dz = c_t q_tau(z) + sparse terms at the teacher ids and the target (kd_grad.wgsl), so dh = c_t U + those rows of
W, with U = sum_v q_tau,v W_v accumulated chunk by chunk like attention's output: pass 1's kd_stats also writes
P_c = exp(Z_c / tau - m) against the row's running max m (kd_stats_probs: f32 in place; kd_stats_probs16: f16
times 2^15 on tensor cores), dh_part = P_c W_c, and U = U exp(m_old - m) + dh_part (kd_rescaled_add); kd_finish
then applies c_t and adds the sparse rows, decoded from the head's GGML type. The logits are computed once (the
two-pass backward computes them twice: ~30 ms of the Llama-3-8B step on an H100).

On tensor cores (h16 given, a quantized head, a scratch built with `hidden`) dZ_c W_c runs on them too: dZ_c,
whose values lie far below f16's normal range (~1/T), is packed to f16 times a power of two sigma_c putting its max
in [2^14, 2^15) (gpu/ops/half.py to_f16_scaled), the product goes to a scratch and dh += it / sigma_c.
Held by the H200 test tests/test_gpu_kd.py (dh within 1e-2 of float64, relative to its max) and the whole-step
tensor-core tests. A scratch with w16 (DECODED_CHUNK) decodes each chunk's rows to f16 once for both of its
tensor-core products (the same values as decoding while staging). With the scratch's Int8Head (precision int8)
both products run on the integer GEMM instead: h and each chunk's rows of W rounded to 8 bits of their row's max,
dZ_c times W's row scales likewise per row (two passes). An Int8Head of the logits alone (no dz) computes Z_c on
the integer GEMM and leaves the one-pass backward's P_c W_c where it was (tensor cores, over the decoded chunk);
one with probs puts that product on the integer GEMM too, from P_c times W's row scales rounded stochastically to 8
bits of their row's max (gpu/kernels/kd_probs_i8.wgsl; over rotated codes, U turned back once at the end)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.ops.half import add_unscaled, to_f16_scaled, weight_to_f16
from gpu.ops.head import Int8Head, logits_chunk
from gpu.ops.matmul import linear_input_grad
from gpu.ops.matmul_tc import linear_input_grad_tc
from gpu.ops.quantize_i8 import rotate_rows
from gpu.ops.reduce import count_nonzero, reduce_sum
from gpu.ops.strided_matmul import row_major, strided_matmul
from gpu.registry import pipeline
from gpu.weights import QuantTensor, check_lm_head, padded_nbytes, row_slice
from model.kd import KINDS, LossConfig

ONE_PASS = True  # the one-pass backward where it applies (module docstring; bench/train_step.py --kd-one-pass off)
# each vocab chunk of a quantized head decoded to f16 once (gpu/ops/half.py weight_to_f16, into the scratch's w16)
# for its tensor-core products over plain F16 weights, instead of both products decoding it as they stage it: the
# same f16 values, staged from half the loads; +1.4 % on the Llama-3-8B step (H100, 2026-12-06, docs/benchmarks.md;
# bench --ab kd-staged-chunk puts the staging decode back). KdScratch.build reads it.
DECODED_CHUNK = True


@dataclass(frozen=True)
class KdScratch:
    """Buffers for one (n_tokens, k, chunk) shape; build once and reuse every step (keeps bind groups cached).
    row_loss [T] holds each row's share of the loss (they sum to the loss); row_info has one more entry after
    the rows, whose first float is the number of unmasked rows (keeps kd_row within 8 storage buffers)."""

    n_tokens: int
    k: int
    chunk: int
    logits: Any  # [T, chunk]
    lse: Any  # [T, 4] running (m_tau, s_tau, m_1, s_1)
    gathered: Any  # [T, k + 1] logits at teacher ids, then at the target
    row_loss: Any  # [T]
    da: Any  # [T, k]
    row_info: Any  # [T + 1, 4] (lse_tau, lse_1, sum da, ce_weight / n), then (rows with mask != 0, 0, 0, 0)
    # the backward on tensor cores (built with `hidden` and half, when chunk % 4 == 0), else None:
    dz16: Any = None  # [T, chunk] f16: dL/dZ_c * sigma_c (two-pass), P_c * 2^15 (one-pass)
    dz_stats: Any = None  # sigma_c's bits (gpu/ops/half.py to_f16_scaled)
    dh_part: Any = None  # [T, hidden] f32: dZ_c16 W_c before the unscaling, or P_c W_c (built with `hidden`)
    rescale: Any = None  # [T] the one-pass backward's exp(m_old - m) per row (built with `hidden`)
    int8: Int8Head | None = None  # the head on the integer GEMM (precision int8), else None
    w16: Any = None  # [chunk, hidden] f16: the vocab chunk's rows decoded once (DECODED_CHUNK, tensor cores), else None

    @classmethod
    def build(
        cls,
        dev: Device,
        n_tokens: int,
        k: int,
        chunk: int,
        hidden: int | None = None,
        int8_hidden: int | None = None,
        *,
        half: bool = True,
        int8_backward: bool = True,
        int8_rot: int = 0,
        int8_probs: bool = False,
        decoded_chunk: bool | None = None,
    ) -> KdScratch:
        """hidden: also the buffers of the one-pass backward (module docstring) and, with half, those of the
        tensor-core backward (for a caller passing h16); int8_hidden: those of the integer head
        (gpu/ops/head.py Int8Head) for rows of int8_hidden, its backward too unless int8_backward is False (the
        logits only), rotated in blocks of int8_rot, and with int8_probs the one-pass backward's P_c W_c on the integer
        GEMM too (Int8Head probs: stochastically rounded probabilities; needs hidden); decoded_chunk (None:
        DECODED_CHUNK), with the tensor-core buffers and hidden a multiple of 8: a vocab chunk's rows as f16,
        decoded once for both its products."""
        t = n_tokens

        def buf(n: int, label: str) -> Any:
            return dev.buffer(4 * n, label=f"kd {label}")

        # with the integer head's probabilities, P_c W_c needs neither the f16 probabilities nor the f16 chunk
        probs = int8_probs and int8_hidden is not None and hidden is not None
        tc = half and hidden is not None and chunk % 4 == 0 and not probs
        decoded = tc and hidden % 8 == 0 and (DECODED_CHUNK if decoded_chunk is None else decoded_chunk)
        return cls(
            t,
            k,
            chunk,
            buf(t * chunk, "logits chunk"),
            buf(t * 4, "lse"),
            buf(t * (k + 1), "gathered"),
            buf(t, "row loss"),
            buf(t * k, "da"),
            buf((t + 1) * 4, "row info"),
            buf(t * chunk // 2, "dlogits f16") if tc else None,
            buf(4, "dlogits scale") if tc else None,
            buf(t * hidden, "dh part") if hidden is not None else None,
            buf(t, "one-pass rescale") if hidden is not None else None,
            None
            if int8_hidden is None
            else Int8Head.build(dev, t, int8_hidden, chunk, int8_backward, int8_rot, probs=probs),
            dev.buffer(padded_nbytes(GGMLQuantizationType.F16, (chunk, hidden)), label="kd head chunk f16")
            if decoded
            else None,
        )


def kd_head_forward_backward(
    dev: Device,
    h: Any,
    w: Any,
    teacher_ids: Any,
    teacher_logprobs: Any,
    teacher_tail: Any | None,
    targets: Any,
    mask: Any,
    cfg: LossConfig,
    dh: Any,
    loss: Any,
    n_tokens: int,
    hidden: int,
    vocab: int,
    k: int,
    *,
    scratch: KdScratch | None = None,
    chunk: int = 4096,  # vocab columns per chunk when no scratch is given (else scratch.chunk)
    accumulate_dh: bool = False,
    loss_index: int = 0,
    backward: bool = True,
    h16: Any = None,
) -> KdScratch:
    """Loss of model/kd.py kd_loss_forward for logits = h [T, H] . W^T (W f32 [V, H]) and dh [T, H] (+)=
    dL/dlogits . W, computed over vocab chunks. teacher_ids u32 [T, k], teacher_logprobs f32 [T, k] (at tau),
    teacher_tail f32 [T] or None (then 1 - sum exp(logprobs)), targets u32 [T], mask u32 [T] (rows != 0 count).
    loss[loss_index] (f32) receives the scalar loss; backward=False skips pass 2 (evaluation: dh untouched).
    h16: h as f16 for tensor-core logits, and with a scratch built with `hidden` the backward's dlogits . W on
    tensor cores too (module docstring). Returns the scratch (row_loss, row_info) for inspection and reuse."""
    t = n_tokens
    if cfg.kind not in KINDS:
        raise ValueError(f"LossConfig.kind={cfg.kind!r} is not one of {KINDS}")
    if scratch is None:
        scratch = KdScratch.build(dev, t, k, min(chunk, vocab))
    sc = scratch
    if (sc.n_tokens, sc.k) != (t, k) or sc.chunk <= 0:
        raise ValueError(f"kd: scratch built for n_tokens={sc.n_tokens}, k={sc.k}; called with {t}, {k}")
    chunk = sc.chunk
    for buf, n, what in (
        (h, t * hidden, "h"),
        (teacher_ids, t * k, "teacher_ids"),
        (teacher_logprobs, t * k, "teacher_logprobs"),
        (targets, t, "targets"),
        (mask, t, "mask"),
        (dh, t * hidden, "dh"),
        (loss, loss_index + 1, "loss"),
    ):
        need(buf, n, f"kd {what}")
    if teacher_tail is not None:
        need(teacher_tail, t, "kd teacher_tail")
    check_lm_head(w, vocab, hidden, chunk, dev.offset_alignment)
    inv_tau = 1.0 / cfg.tau
    beta = cfg.beta if cfg.kind == "jsd" else 0.5
    ce = cfg.ce_weight > 0
    chunks = [(c0, min(chunk, vocab - c0)) for c0 in range(0, vocab, chunk)]

    quant = isinstance(w, QuantTensor)
    i8 = sc.int8 if quant else None
    if i8 is not None:
        i8.quantize(dev, h)

    count_nonzero(dev, mask, sc.row_info, t, out_index=4 * t)
    int8_backward = i8 is not None and i8.dz is not None  # dZ_c . W_c on the integer GEMM too (else the logits only)
    # P_c W_c on the integer GEMM from stochastically rounded probabilities (Int8Head probs), every chunk covered
    probs8 = i8 is not None and i8.probs is not None and all(i8.covers(w, nv) for _, nv in chunks)
    one_pass = ONE_PASS and backward and not accumulate_dh and quant and not int8_backward and sc.rescale is not None
    one_pass = one_pass and (not ce or cfg.tau == 1.0) and (probs8 or h16 is None or sc.dz16 is not None)
    probs8 = probs8 and one_pass
    half = one_pass and h16 is not None and not probs8
    stats = "kd_stats_probs16" if half else "kd_stats_probs" if one_pass else "kd_stats"
    stats_pipe = pipeline(dev, "kd_stats_probs8" if probs8 else stats)
    for i, (c0, nv) in enumerate(chunks):
        # the f16 chunk only where a product reads it (pass 1 of two, with the integer logits: none)
        integer_logits = i8 is not None and i8.covers(w, nv)
        no_f16 = integer_logits and (not one_pass or probs8)
        wc, r0 = (w, c0) if no_f16 else _chunk_head(dev, sc, w, c0, nv, h16, int8_backward)
        _logits(dev, sc, h, w, c0, wc, r0, nv, hidden, h16, i8)
        params = pack(t, nv, chunk, c0, k, inv_tau, i == 0, 0)
        bind = [params, sc.logits, teacher_ids, targets, sc.lse, sc.gathered]
        if probs8:
            bind += [i8.probs_buf, sc.rescale, i8.decoded[0], i8.dither]
        elif one_pass:
            bind += [sc.dz16, sc.rescale] if half else [sc.rescale]
        dev.dispatch(stats_pipe, bind, grid(t, 1))
        if one_pass:  # dh = U, the running sum of P_c W_c at the running max
            if probs8:  # over rotated codes: U R, turned back after the last chunk
                i8.probs_grad(dev, nv, sc.dh_part)
            elif half:
                linear_input_grad_tc(dev, sc.dz16, row_slice(wc, r0, nv), sc.dh_part, t, lda=chunk, a_dtype="f16")
            else:
                linear_input_grad(dev, sc.logits, row_slice(w, c0, nv), sc.dh_part, t, lda=chunk)
            scale = 2.0**-15 if half else 1.0
            n = t * hidden
            rescaled = pipeline(dev, "kd_rescaled_add", acc=i > 0)
            dev.dispatch(rescaled, [pack(n, scale, hidden, 0), sc.dh_part, sc.rescale, dh], grid(n, 256))

    tail = "none" if not cfg.use_tail else "derived" if teacher_tail is None else "given"
    row_pipe = pipeline(dev, "kd_row", kind=cfg.kind, tail=tail, ce=ce)
    row_params = pack(t, k, cfg.tau, inv_tau, beta, math.log(beta), math.log1p(-beta), cfg.ce_weight if ce else 0.0)
    tail_buf = teacher_tail if tail == "given" else sc.gathered  # bound either way; read only when given
    bind = [row_params, mask, teacher_logprobs, sc.gathered, sc.lse, sc.row_loss, sc.da, sc.row_info, tail_buf]
    dev.dispatch(row_pipe, bind, grid(t, 64))
    reduce_sum(dev, sc.row_loss, loss, t, out_index=loss_index)

    if one_pass:  # dh = c_t U + the rows of W at the teacher ids and the target
        if probs8 and i8.rot:
            rotate_rows(dev, dh, t, hidden, i8.rot)
        finish = pipeline(dev, "kd_finish", wtype=w.qtype.name, ce=ce)
        bind = [pack(t, hidden, k, inv_tau), w.binding, teacher_ids, sc.da, sc.row_info, sc.lse, targets, mask, dh]
        dev.dispatch(finish, bind, grid(t * hidden // 4, 64))
        return sc
    if not backward:
        return sc
    grad_pipe = pipeline(dev, "kd_grad", ce=ce)
    for i, (c0, nv) in enumerate(chunks):
        wc, r0 = _chunk_head(dev, sc, w, c0, nv, h16, int8_backward)
        _logits(dev, sc, h, w, c0, wc, r0, nv, hidden, h16, i8)
        params = pack(t, nv, chunk, c0, k, inv_tau, 0, 0)
        bind = [params, mask, teacher_ids, sc.da, sc.row_info, targets, sc.logits]
        dev.dispatch(grad_pipe, bind, grid(t, 1))
        acc = accumulate_dh or i > 0
        if int8_backward and i8.covers(w, nv):  # the integer GEMM, on the rows just decoded
            i8.input_grad(dev, sc.logits, chunk, nv, dh, acc)
            continue
        if quant and h16 is not None and sc.dz16 is not None:  # tensor cores, dZ_c scaled into f16's range
            to_f16_scaled(dev, sc.logits, sc.dz16, sc.dz_stats, t * chunk)
            linear_input_grad_tc(dev, sc.dz16, row_slice(wc, r0, nv), sc.dh_part, t, lda=chunk, a_dtype="f16")
            add_unscaled(dev, sc.dh_part, sc.dz_stats, dh, t * hidden, accumulate=acc)
            continue
        if quant:
            linear_input_grad(dev, sc.logits, row_slice(w, c0, nv), dh, t, lda=chunk, accumulate=acc)
            continue
        a, b = row_major(sc.logits, chunk), row_major(w, hidden, off=c0 * hidden)
        strided_matmul(dev, a, b, dh, t, hidden, nv, accumulate=acc)
    return sc


def _chunk_head(dev: Device, sc: KdScratch, w: Any, c0: int, nv: int, h16: Any, int8_backward: bool) -> tuple[Any, int]:
    """(head, first row) to read vocab chunk c0 .. c0 + nv from: its rows decoded to f16 into sc.w16 (once for
    the chunk's tensor-core products) where the scratch has w16 and they run on tensor cores (with an integer
    head of the logits only, its backward's product; int8_backward: none do), else w."""
    plain = not isinstance(w, QuantTensor) or w.qtype == GGMLQuantizationType.F16
    if sc.w16 is None or h16 is None or int8_backward or plain:
        return w, c0
    return weight_to_f16(dev, row_slice(w, c0, nv), sc.w16), 0


def _logits(
    dev: Device,
    sc: KdScratch,
    h: Any,
    w: Any,
    c0: int,
    wc: Any,
    r0: int,
    nv: int,
    hidden: int,
    h16: Any,
    i8: Int8Head | None,
) -> None:
    """sc.logits = chunk c0 .. c0 + nv of h . W^T: on the integer head from W's own rows where it covers them,
    else from (wc, r0), _chunk_head's choice."""
    if i8 is not None and i8.covers(w, nv):
        i8.logits(dev, w, sc.logits, c0, nv, sc.chunk)
        return
    logits_chunk(dev, h, wc, sc.logits, sc.n_tokens, hidden, r0, nv, sc.chunk, h16)
