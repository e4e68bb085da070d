"""The numpy engine's objectives: what NumpyEngine (cpu/engine.py, the trunk) optimises. Each takes its typed
batch (model/engine_spec.py), turns the final normed hidden states into a loss and dL/dh of the rows that count,
and says what an evaluation returns. Their GPU twins are gpu/objectives.py's GpuKd and GpuPreference.

NumpyKd: model/kd.py's KD losses over the teacher's top-k (or the sampled store's draws: LossConfig.samples > 0,
KdBatch.teacher_counts), through cpu/head.py's vocabulary pass.

NumpyPreference: DPO-family losses (model/dpo.py) over P pairs as 2P sequences: rows 0..P-1 the chosen responses,
P..2P-1 the rejected ones. One vocabulary pass (tau = 1, weighted) gives per masked row the target's log-prob
z[t] - lse(z) and pW = sum_v softmax(z)_v W_v. Summed per sequence that is logπ(y); model/dpo.py turns the 2P sums
(and the reference's) into the loss and g_s = dL/dlogπ(s); since d logπ / dz_row = onehot(target) - softmax(z),

    dL/dh_row = g_s * (W[target] - pW)

is the CE head's gradient with a signed per-sequence weight. With the adapter zeroed (B = 0) the same pass gives
the reference log-probs of the default reference.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from cpu.head import VocabHead, VocabPass, head_backward, kd_rows
from model.config import ModelConfig
from model.dpo import DpoConfig, PairTerms, preference_loss
from model.engine_spec import KdBatch, PairBatch, check_pair_engine, expect_batch, pair_arrays
from model.kd import LossConfig

Batch = dict[str, Any]  # an objective's arrays of the written batch; "ids" and "prefix" feed the trunk's forward
HeadResult = tuple[float, np.ndarray | None, np.ndarray]  # (loss, dL/dh of the rows that count or None, those rows)


class Trunk(Protocol):
    """What an objective reads of the engine it is plugged into (cpu/engine.py's NumpyEngine)."""

    cfg: ModelConfig
    batch: int  # sequences per batch
    seq_len: int
    rows: int  # batch * seq_len
    start_layer: int
    head: VocabHead  # the lm_head, chunked over the vocabulary


class NumpyObjective(Protocol):
    """What NumpyEngine needs of an objective."""

    def bind(self, engine: Trunk) -> None:
        """Called once by the engine's constructor: check the engine's shapes, keep what the objective needs."""
        ...

    def write(self, batch: Any) -> Batch:
        """Check and convert one typed batch: the arrays of the next step or evaluation (with "ids" [B, T] and
        "prefix" [B, T, H] or None)."""
        ...

    def head(self, b: Batch, nf: np.ndarray, backward: bool) -> HeadResult:
        """The loss of the batch from the final normed hidden states nf [rows, H]; with backward, dL/dh of the
        rows that count."""
        ...

    def evaluate(self, b: Batch, nf: np.ndarray) -> dict[str, np.ndarray]:
        """Forward-only results of the batch from nf [rows, H] (Engine.evaluate_batch)."""
        ...


def _check_ids(name: str, a: np.ndarray, vocab: int) -> None:
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise ValueError(f"{name} outside the student's vocabulary [0, {vocab})")


# ---- knowledge distillation ----------------------------------------------------------------------------------
class NumpyKd:
    """KD over the teacher's top-k (model/kd.py's `loss`), k = top_k ids per position."""

    def __init__(self, loss: LossConfig, top_k: int) -> None:
        self.loss_cfg, self.top_k = loss, top_k

    def bind(self, engine: Trunk) -> None:
        self.engine = engine

    def write(self, batch: KdBatch) -> Batch:
        """ids/targets/mask [B, T], teacher top-k ids/logprobs [B, T, k], tail [B, T] or None; prefix [B, T, H]:
        the input of block start_layer (required when start_layer > 0, refused otherwise)."""
        expect_batch(batch, KdBatch, "KD")
        e, prefix = self.engine, batch.prefix
        bt, v = (e.batch, e.seq_len), e.cfg.vocab
        if (prefix is None) != (e.start_layer == 0):
            raise ValueError(f"prefix activations: given {prefix is not None}, start_layer is {e.start_layer}")
        if prefix is not None:
            prefix = np.asarray(prefix, np.float32)
            if prefix.shape != (*bt, e.cfg.hidden):
                raise ValueError(f"prefix activations of shape {prefix.shape}, the engine takes {(*bt, e.cfg.hidden)}")
        ids = np.asarray(batch.ids).reshape(bt).astype(np.intp)
        tids = np.asarray(batch.teacher_ids).reshape(e.rows, self.top_k).astype(np.intp)
        targets = np.asarray(batch.targets).reshape(-1).astype(np.intp)
        for name, a in (("token ids", ids), ("teacher ids", tids), ("targets", targets)):
            _check_ids(name, a, v)
        tail = batch.teacher_tail
        counts = None
        if self.loss_cfg.samples:
            if batch.teacher_counts is None:
                raise ValueError("the sampled KD loss needs KdBatch.teacher_counts (teacher.store: sampled)")
            counts = np.asarray(batch.teacher_counts).reshape(e.rows, self.top_k).astype(np.int32)
            mask = np.asarray(batch.mask).reshape(-1) != 0
            if (counts[mask].sum(axis=1) != self.loss_cfg.samples).any():
                raise ValueError(f"teacher counts of a trained position do not sum to {self.loss_cfg.samples}")
            tail = None
        elif batch.teacher_counts is not None:
            raise ValueError("a sampled KdBatch (teacher_counts) given to a top-k loss: set teacher.store: sampled")
        return {
            "teacher_counts": counts,
            "ids": ids,
            "targets": targets,
            "mask": np.asarray(batch.mask).reshape(-1) != 0,
            "teacher_ids": tids,
            "teacher_logprobs": np.asarray(batch.teacher_logprobs, np.float32).reshape(e.rows, self.top_k),
            "teacher_tail": None if tail is None else np.asarray(tail, np.float32).reshape(-1),
            "prefix": prefix,
        }

    def head(self, b: Batch, nf: np.ndarray, backward: bool) -> HeadResult:
        rows = np.flatnonzero(b["mask"])
        count = len(rows)
        if count == 0:
            return 0.0, None, rows
        c, head = self.loss_cfg, self.engine.head
        weighted = ("tau+1" if c.ce_weight and c.tau != 1.0 else "tau") if backward else ""
        tids, targets = b["teacher_ids"][rows], b["targets"][rows]
        vp = head.vocab_pass(nf[rows], tids, targets, c.tau, weighted=weighted)
        tail = None if b["teacher_tail"] is None else b["teacher_tail"][rows]
        counts = None if b["teacher_counts"] is None else b["teacher_counts"][rows]
        kd = kd_rows(vp, b["teacher_logprobs"][rows], tail, c, count, backward, counts)
        loss = float(np.sum(kd.row_loss))
        dh = head_backward(head, vp, kd, tids, targets, c, count) if backward else None
        return loss, dh, rows

    def evaluate(self, b: Batch, nf: np.ndarray) -> dict[str, np.ndarray]:
        """kd_loss (the batch's masked-mean loss, [1]), ce [rows], the student's top-1 id [rows] (u32) and its
        log-prob at temperature 1 (top1_logp [rows], for calibration); rows with mask 0 are included (callers
        select masked rows)."""
        c = self.loss_cfg
        vp = self.engine.head.vocab_pass(nf, b["teacher_ids"], b["targets"], c.tau, top1=True)
        rows = np.flatnonzero(b["mask"])
        loss = 0.0
        if len(rows):
            sub = VocabPass(vp.lse_tau[rows], vp.lse_1[rows], vp.gathered[rows], None, None, None)
            tail = None if b["teacher_tail"] is None else b["teacher_tail"][rows]
            counts = None if b["teacher_counts"] is None else b["teacher_counts"][rows]
            kd = kd_rows(sub, b["teacher_logprobs"][rows], tail, c, len(rows), False, counts)
            loss = float(np.sum(kd.row_loss))
        return {
            "kd_loss": np.array([loss], np.float32),
            "ce": vp.lse_1 - vp.gathered[:, self.top_k].astype(np.float64),
            "top1": vp.top1.astype(np.uint32),
            "top1_logp": vp.top1_z.astype(np.float64) - vp.lse_1,
        }


# ---- preference pairs ----------------------------------------------------------------------------------------
class NumpyPreference:
    """A DPO-family loss (model/dpo.py's `dpo`) over pairs; the engine's batch is 2 sequences per pair."""

    def __init__(self, dpo: DpoConfig) -> None:
        self.dpo = dpo
        self.last_terms: PairTerms | None = None  # of the last step's pairs
        self.last_hidden: np.ndarray | None = None  # the normed final hidden states [2P * T, H] of the last evaluation

    def bind(self, engine: Trunk) -> None:
        self.engine, self.pairs = engine, check_pair_engine(engine.batch, engine.start_layer)

    def write(self, batch: PairBatch) -> Batch:
        """ids, mask [2P, T] (chosen rows first); the last position of each row has no target."""
        expect_batch(batch, PairBatch, "preference")
        e = self.engine
        ids, mask, targets = pair_arrays(batch, (e.batch, e.seq_len))
        _check_ids("token ids", ids, e.cfg.vocab)
        ref = None if batch.ref_logps is None else np.asarray(batch.ref_logps, np.float64).reshape(e.batch)
        targets = targets.reshape(-1).astype(np.intp)
        return {"ids": ids.astype(np.intp), "targets": targets, "mask": mask.reshape(-1), "ref": ref, "prefix": None}

    def _token_pass(self, b: Batch, nf: np.ndarray, rows: np.ndarray, backward: bool) -> tuple[np.ndarray, VocabPass]:
        """(log p(target) per masked row, the vocabulary pass) for the normed rows nf[rows]."""
        no_ids = np.zeros((len(rows), 0), np.intp)
        vp = self.engine.head.vocab_pass(nf[rows], no_ids, b["targets"][rows], 1.0, weighted="tau" if backward else "")
        return vp.gathered[:, 0].astype(np.float64) - vp.lse_1, vp

    def _sequence_sums(self, rows: np.ndarray, token_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seq = rows // self.engine.seq_len
        logp = np.bincount(seq, weights=token_logp, minlength=self.engine.batch)
        count = np.bincount(seq, minlength=self.engine.batch)
        return logp, count

    def _terms(self, b: Batch, logp: np.ndarray, count: np.ndarray) -> PairTerms:
        p, ref = self.pairs, b["ref"]
        if ref is None and not self.dpo.reference_free:
            raise RuntimeError("the preference objective needs PairBatch.ref_logps for a reference-based loss")
        rc, rr = (None, None) if ref is None else (ref[:p], ref[p:])
        return preference_loss(logp[:p], logp[p:], rc, rr, count[:p], count[p:], self.dpo)

    def head(self, b: Batch, nf: np.ndarray, backward: bool) -> HeadResult:
        """The CE head over the response rows, the preference loss and dL/dh of those rows."""
        rows = np.flatnonzero(b["mask"])
        if len(rows) == 0:
            self.last_terms = None
            return 0.0, None, rows
        token_logp, vp = self._token_pass(b, nf, rows, backward)
        terms = self._terms(b, *self._sequence_sums(rows, token_logp))
        self.last_terms = terms
        dh = None
        if backward:
            g = np.concatenate([terms.d_chosen, terms.d_rejected])[rows // self.engine.seq_len].astype(np.float32)
            dh = g[:, None] * (self.engine.head.w[b["targets"][rows]] - vp.q_w)
        return terms.loss, dh, rows

    def evaluate(self, b: Batch, nf: np.ndarray) -> dict[str, np.ndarray]:
        """logps [2P] (summed response log-probs, float64), counts [2P] (response tokens) and, when the batch has
        reference log-probs or the loss is reference-free, the loss terms: loss [1], pair_loss, margin,
        chosen_reward, rejected_reward, valid [P]. The normed hidden states stay in last_hidden."""
        self.last_hidden = nf
        rows = np.flatnonzero(b["mask"])
        logp, count = self._sequence_sums(rows, self._token_pass(b, nf, rows, backward=False)[0])
        out = {"logps": logp, "counts": count}
        if b["ref"] is not None or self.dpo.reference_free:
            out.update(self._terms(b, logp, count).metrics())
        return out
