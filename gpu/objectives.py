"""GPUStudent's objectives: what the GPU trunk (gpu/student.py) optimises, the twins of cpu/objectives.py's
NumpyKd and NumpyPreference. Each takes its typed batch (model/engine_spec.py), owns the buffers only it needs,
records the head that leaves the loss in the step's loss slot and dL/dh in a["tmp"], and says what an evaluation
returns.

GpuKd: the fused lm_head + KD loss kernels (gpu/ops/kd.py) over the teacher's top-k.

GpuPreference: a DPO-family loss (model/dpo.py) through GpuKd's head used as CE: k = 1, the teacher's single
id = the target and forward KL at tau = 1 is the cross-entropy of the target, whose gradient at a masked row is
dL/dh = (pW - W[target]) / n (n masked rows). A preference step is then two passes:

1. forward only (GpuKd's evaluation): the target's log-prob per row -> logπ per sequence -> model/dpo.py's loss
   and g_s = dL/dlogπ(s) on the host (`prepare`);
2. the trunk's recorded forward + backward, where the head's dL/dh rows are scaled by -g_s * n on the host (one
   read and one write of [rows, H] inside the step) to g_s * (W[target] - pW), exactly as NumpyPreference, and
   the micro-batch's loss slot gets the preference loss.

So no kernel changes; the cost over a KD step is one more forward and the host round trip of dL/dh. A fused
per-row weight in the KD head (a float mask) would remove both.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from gpu.device import Device
from gpu.model import ModelWeights
from gpu.ops import head
from gpu.ops.add import add
from gpu.ops.kd import KdScratch, kd_head_forward_backward
from gpu.ops.topk import TopKState, hidden_topk
from gpu.profile import scope
from model.config import ModelConfig
from model.dpo import DpoConfig, PairTerms, preference_loss
from model.engine_spec import EngineSpec, KdBatch, PairBatch, check_pair_engine, expect_batch, pair_arrays
from model.int8 import mix32
from model.kd import EPS, LossConfig


class Trunk(Protocol):
    """What an objective reads of the GPU trunk it is plugged into (gpu/student.py's GPUStudent, a GPUModel):
    its shapes, buffers, and the forward it records its head after."""

    dev: Device
    cfg: ModelConfig
    w: ModelWeights
    spec: EngineSpec
    batch: int  # sequences per batch
    seq_len: int
    rows: int  # batch * seq_len
    precision: str  # resolved: f32, tensorcore or int8
    grad_accum: int
    start_layer: int
    a: dict[str, Any]  # activation buffers: the head reads "nf" and leaves dL/dh in "tmp"
    losses: Any  # [grad_accum] f32: each micro-batch's loss
    _b: Any  # the named input buffers ("ids", "positions"; an objective adds its own)
    _pack_inputs: bool  # tensor cores: GEMM inputs packed to f16

    def write_prefix(self, x: np.ndarray) -> None: ...

    def _taped(self, key: Hashable, record: Callable[[], None]) -> None: ...

    def _forward_to_head(self, checkpoint: bool = False) -> Any: ...


class GpuObjective(Protocol):
    """What GPUStudent needs of an objective."""

    host_pass: bool
    """True when each step needs a host computation between forward passes (prepare): no one-encoder step."""

    def bind(self, student: Trunk) -> None:
        """Called once by the student's constructor: check its shapes and allocate the objective's buffers."""
        ...

    def write(self, batch: Any) -> None:
        """Check one typed batch and upload it."""
        ...

    def tape_key(self) -> Hashable:
        """What, besides shapes, the recorded head depends on (part of the trunk's tape keys)."""
        ...

    def prepare(self, micro: int) -> None:
        """Before micro-batch `micro` is recorded (host_pass objectives: their first pass)."""
        ...

    def finish(self) -> None:
        """After the micro-batch is recorded (or failed)."""
        ...

    def head(self, loss_index: int, backward: bool, h16: Any) -> None:
        """Record lm_head + loss of the uploaded batch into losses[loss_index]; with backward, dL/dh into
        a["tmp"]. h16: the final hidden state's f16 copy (None on the f32 path)."""
        ...

    def micro_loss(self, micro: int) -> float:
        """The loss of recorded micro-batch `micro` (after its step)."""
        ...

    def evaluate(self) -> dict[str, np.ndarray]:
        """Forward only: the objective's results of the uploaded batch (Engine.evaluate_batch)."""
        ...


# ---- knowledge distillation ----------------------------------------------------------------------------------
class GpuKd:
    """KD over the teacher's top-k (model/kd.py's `loss`), k = top_k ids per position; or, loss.samples > 0, the
    sampled store's estimate over its distinct drawn ids (k = samples columns, counts c). The sampled gradient
    (q - c / n) / tau is forward KL's with teacher probabilities c / n and a zero tail, so the head runs that
    (teacher log-probs log(c / n), log EPS on padding; the floored tail and padding change the gradient by ~EPS);
    the two losses differ by tau^2 sum (c / n) (lt - log(c / n)) per position, which does not depend on the student
    and is added to the loss on the GPU (SampledShift)."""

    host_pass = False

    def __init__(self, loss: LossConfig, top_k: int) -> None:
        self.loss_cfg, self.top_k = loss, top_k
        self._has_tail = False
        self._head_cfg = replace(loss, samples=0, use_tail=True) if loss.samples else loss
        self._shift: np.ndarray | None = None  # sampled: the batch's loss shift (SampledShift)

    def bind(self, student: Trunk) -> None:
        st, rows, top_k = student, student.rows, self.top_k
        self.st = st
        b = st._b.get
        for name, n in (
            ("targets", rows),
            ("mask", rows),
            ("teacher_ids", rows * top_k),
            ("teacher_logprobs", rows * top_k),
            ("teacher_tail", rows),
        ):
            b(name, n)
        dev = st.dev
        chunk = min(st.spec.vocab_chunk, st.cfg.vocab)
        int8 = st.precision == "int8" and (head.INT8_STUDENT_HEAD or head.INT8_STUDENT_LOGITS)
        int8_head = st.cfg.hidden if int8 else None
        # the one-pass backward (gpu/ops/kd.py), on TCs with packed inputs; int8_head: the head's logits (and its
        # backward) on the integer GEMM
        self.scratch = KdScratch.build(
            dev,
            rows,
            top_k,
            chunk,
            hidden=st.cfg.hidden,
            half=st._pack_inputs,
            int8_hidden=int8_head,
            int8_backward=head.INT8_STUDENT_HEAD,
            int8_rot=st._rotation(st.cfg.hidden),
            int8_probs=head.INT8_STUDENT_PROBS and not head.INT8_STUDENT_HEAD,
        )
        self._batches = 0  # batches written: each step's stochastic rounding seed (int8 probabilities)
        if self.scratch.int8 is not None:
            self.scratch.int8.keep_row_scales(dev, st.w.lm_head, st.cfg.vocab)
        self.top1 = TopKState.build(dev, rows, 1)
        self.top1_lp = dev.buffer(4 * rows, label="student top-1 logprob")
        self.top1_tail = dev.buffer(4 * rows, label="student top-1 tail")
        n_losses = max(1, st.spec.grad_accum)
        self.shift = dev.buffer(4 * n_losses, label="sampled loss shift") if self.loss_cfg.samples else None
        self.shifted = dev.buffer(4 * n_losses, label="shifted losses") if self.loss_cfg.samples else None

    def write(self, batch: KdBatch) -> None:
        """Upload ids/targets/mask [B, T], teacher top-k ids/logprobs [B, T, k], tail [B, T]; prefix [B, T, H]:
        the input of block start_layer (required when start_layer > 0, refused otherwise)."""
        expect_batch(batch, KdBatch, "KD")
        st, prefix = self.st, batch.prefix
        if (prefix is None) != (st.start_layer == 0):
            raise ValueError(f"prefix activations: given {prefix is not None}, start_layer is {st.start_layer}")
        if prefix is not None:
            st.write_prefix(prefix)
        bt = (st.batch, st.seq_len)
        ids = np.asarray(batch.ids).reshape(bt)
        if np.any(ids < 0) or np.any(ids >= st.cfg.vocab):
            raise ValueError(f"token ids outside the student's vocabulary [0, {st.cfg.vocab})")
        w = st.dev.write
        bufs = st._b.bufs
        if self.scratch.int8 is not None:
            self._batches += 1
            self.scratch.int8.reseed(st.dev, int(mix32(np.uint32(self._batches))))
        w(bufs["ids"], ids.astype(np.uint32).reshape(-1))
        w(bufs["positions"], np.tile(np.arange(st.seq_len, dtype=np.uint32), st.batch))
        w(bufs["targets"], np.asarray(batch.targets).reshape(bt).astype(np.uint32).reshape(-1))
        w(bufs["mask"], (np.asarray(batch.mask).reshape(bt) != 0).astype(np.uint32).reshape(-1))
        w(bufs["teacher_ids"], np.asarray(batch.teacher_ids).reshape(*bt, self.top_k).astype(np.uint32).reshape(-1))
        logprobs = np.asarray(batch.teacher_logprobs, np.float32).reshape(*bt, self.top_k)
        if self.loss_cfg.samples:
            logprobs = self._sampled(batch, logprobs)
        w(bufs["teacher_logprobs"], logprobs.reshape(-1))
        tail = np.zeros(bt, np.float32) if batch.teacher_tail is None else np.asarray(batch.teacher_tail, np.float32)
        w(bufs["teacher_tail"], tail.reshape(-1))
        self._has_tail = batch.teacher_tail is not None or bool(self.loss_cfg.samples)

    def _sampled(self, batch: KdBatch, lt: np.ndarray) -> np.ndarray:
        """A sampled batch's head inputs: log(c / n) (log EPS where c = 0) as the teacher log-probs; keeps the
        batch's loss shift, the masked mean of tau^2 sum (c / n) (lt - log(c / n)), for prepare()."""
        n, st = self.loss_cfg.samples, self.st
        if batch.teacher_counts is None:
            raise ValueError("the sampled KD loss needs KdBatch.teacher_counts (teacher.store: sampled)")
        p = np.asarray(batch.teacher_counts, np.float64).reshape(lt.shape) / n
        mask = np.asarray(batch.mask).reshape(lt.shape[:2]) != 0
        if (np.abs(p[mask].sum(axis=-1) - 1.0) > 1e-9).any():
            raise ValueError(f"teacher counts of a trained position do not sum to {n}")
        logp = np.log(np.where(p > 0, p, EPS))
        per_row = self.loss_cfg.tau**2 * np.sum(np.where(p > 0, p * (lt - logp), 0.0), axis=-1)
        self._shift = np.float32(per_row[mask].sum() / max(1, int(mask.sum())))
        st.dev.write(self.shift, np.full(max(1, st.spec.grad_accum), 0.0, np.float32))
        self.prepare(0)
        return logp.astype(np.float32)

    def tape_key(self) -> Hashable:
        return self._has_tail

    def prepare(self, micro: int) -> None:
        if self.shift is not None and self._shift is not None:  # only micro-batch `micro`'s loss gets the shift
            shift = np.zeros(max(1, self.st.spec.grad_accum), np.float32)
            shift[micro] = self._shift
            self.st.dev.write(self.shift, shift)

    def finish(self) -> None:
        pass

    def head(self, loss_index: int, backward: bool, h16: Any) -> None:
        st = self.st
        cfg, bufs = st.cfg, st._b.bufs
        tail = bufs["teacher_tail"] if self._has_tail else None
        with scope(st.dev, "kd head"):
            kd_head_forward_backward(
                st.dev, st.a["nf"], st.w.lm_head, bufs["teacher_ids"], bufs["teacher_logprobs"], tail,
                bufs["targets"], bufs["mask"], self._head_cfg, st.a["tmp"], st.losses, st.rows, cfg.hidden,
                cfg.vocab, self.top_k, scratch=self.scratch, loss_index=loss_index, backward=backward,
                h16=h16,
            )  # fmt: skip
            if self.shift is not None:  # the sampled estimate's value (see the class docstring)
                n = max(1, st.spec.grad_accum)
                add(st.dev, st.losses, self.shift, self.shifted, n)
                st.dev.copy(self.shifted, st.losses, 4 * n)

    def micro_loss(self, micro: int) -> float:
        return float(self.st.dev.read(self.st.losses, np.float32, (micro + 1,))[micro])

    def evaluate(self) -> dict[str, np.ndarray]:
        """Per row the KD loss share, the CE on the target and the student's top-1 id: kd_loss (the batch's
        masked-mean loss, [1]), ce [rows], top1 [rows] (u32), top1_logp [rows] (its log-prob at temperature 1, for
        calibration); rows with mask 0 are included (callers select masked rows)."""
        st = self.st
        dev, rows = st.dev, st.rows
        with dev.step():
            st._taped(("evaluate", self.tape_key()), self._record_evaluate)
        lse = dev.read(self.scratch.lse, np.float32, (rows, 4)).astype(np.float64)
        gathered = dev.read(self.scratch.gathered, np.float32, (rows, self.top_k + 1)).astype(np.float64)
        ce = lse[:, 2] + np.log(lse[:, 3]) - gathered[:, self.top_k]
        return {
            "kd_loss": dev.read(st.losses, np.float32, (1,)),
            "ce": ce,
            "top1": dev.read(self.top1.ids, np.uint32, (rows,)),
            "top1_logp": dev.read(self.top1_lp, np.float32, (rows,)).astype(np.float64),
        }

    def _record_evaluate(self) -> None:
        """evaluate's forward, KD loss and top-1, recorded into the current step."""
        st = self.st
        cfg = st.cfg
        h16 = st._forward_to_head()  # one f16 copy for the KD head and the top-1
        self.head(0, backward=False, h16=h16)
        hidden_topk(
            st.dev,
            st.a["nf"],
            st.w.lm_head,
            self.top1,
            self.top1_lp,
            self.top1_tail,
            cfg.hidden,
            cfg.vocab,
            1.0,
            logits_scratch=self.scratch.logits,
            chunk=self.scratch.chunk,
            h16=h16,
            i8=self.scratch.int8,
        )


# ---- preference pairs ----------------------------------------------------------------------------------------
class GpuPreference:
    """A DPO-family loss (model/dpo.py's `dpo`) over pairs through GpuKd's head as CE (see the module docstring)."""

    host_pass = True

    def __init__(self, dpo: DpoConfig) -> None:
        self.dpo = dpo
        self.ce = GpuKd(LossConfig("forward_kl", tau=1.0), top_k=1)
        self.last_terms: PairTerms | None = None  # of the last step's pairs
        self._ref: np.ndarray | None = None
        self._row_scale: np.ndarray | None = None

    def bind(self, student: Trunk) -> None:
        self.st, self.pairs = student, check_pair_engine(student.batch, student.start_layer)
        self.ce.bind(student)
        self._mask = np.zeros(student.rows, bool)
        self._micro_losses = np.zeros(student.grad_accum, np.float32)

    def write(self, batch: PairBatch) -> None:
        """As NumpyPreference.write: ids, mask [2P, T] (chosen rows first), ref_logps [2P] or None."""
        expect_batch(batch, PairBatch, "preference")
        st = self.st
        bt = (st.batch, st.seq_len)
        ids, mask, targets = pair_arrays(batch, bt)
        zeros = np.zeros((*bt, 1), np.float32)
        self.ce.write(KdBatch(ids, targets, mask.astype(np.uint8), targets[..., None], zeros, None))
        self._mask = mask.reshape(-1)
        self._ref = None if batch.ref_logps is None else np.asarray(batch.ref_logps, np.float64).reshape(st.batch)

    def tape_key(self) -> Hashable:
        return self.ce.tape_key()

    # ---- pass 1: log-probs and the preference loss ----------------------------------------------------
    def sequence_logps(self) -> tuple[np.ndarray, np.ndarray]:
        """Forward only: (summed response log-prob [2P], response tokens [2P]) of the written pairs."""
        st = self.st
        ce = self.ce.evaluate()["ce"]
        st.dev.write(st.losses, self._micro_losses)  # the evaluation wrote slot 0: restore the step's losses
        rows = np.flatnonzero(self._mask)
        seq = rows // st.seq_len
        logp = np.bincount(seq, weights=-ce[rows], minlength=st.batch)
        return logp, np.bincount(seq, minlength=st.batch)

    def _terms(self, logp: np.ndarray, count: np.ndarray) -> PairTerms:
        p = self.pairs
        if self._ref is None and not self.dpo.reference_free:
            raise RuntimeError("the preference objective needs PairBatch.ref_logps for a reference-based loss")
        rc, rr = (None, None) if self._ref is None else (self._ref[:p], self._ref[p:])
        return preference_loss(logp[:p], logp[p:], rc, rr, count[:p], count[p:], self.dpo)

    def evaluate(self) -> dict[str, np.ndarray]:
        """As NumpyPreference.evaluate: logps, counts [2P] and, with reference log-probs or a reference-free
        loss, the loss terms."""
        logp, count = self.sequence_logps()
        out = {"logps": logp, "counts": count}
        if self._ref is not None or self.dpo.reference_free:
            out.update(self._terms(logp, count).metrics())
        return out

    def prepare(self, micro: int) -> None:
        """Pass 1 for micro-batch `micro`: its loss and the per-row scale of the head's gradient."""
        st = self.st
        terms = self._terms(*self.sequence_logps())
        rows = np.flatnonzero(self._mask)
        g = np.concatenate([terms.d_chosen, terms.d_rejected])[rows // st.seq_len]
        scale = np.zeros(st.rows, np.float32)
        scale[rows] = -g * max(1, len(rows))
        self._row_scale, self.last_terms = scale, terms
        self._micro_losses[micro] = terms.loss

    def finish(self) -> None:
        self._row_scale = None

    # ---- pass 2: the recorded step with the scaled head gradient ---------------------------------------
    def head(self, loss_index: int, backward: bool, h16: Any) -> None:
        st = self.st
        self.ce.head(loss_index, backward, h16)
        if backward and self._row_scale is not None:
            dh = st.dev.read(st.a["tmp"], np.float32, (st.rows, st.cfg.hidden))
            st.dev.write(st.a["tmp"], dh * self._row_scale[:, None])
            st.dev.write(st.losses, self._micro_losses[loss_index : loss_index + 1], offset=4 * loss_index)

    def micro_loss(self, micro: int) -> float:
        return float(self._micro_losses[micro])
