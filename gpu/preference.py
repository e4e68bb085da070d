"""GPUPreferenceStudent: DPO-family steps (model/dpo.py) on GPUStudent, through its fused KD head used as CE.

The KD head with k = 1, the teacher's single id = the target and forward KL at tau = 1 is the cross-entropy of
the target, whose gradient at a masked row is dL/dh = (pW - W[target]) / n (n masked rows). A preference step
is then two passes:

1. forward only (evaluate_batch): the target's log-prob per row -> logπ per sequence -> model/dpo.py's loss and
   g_s = dL/dlogπ(s) on the host;
2. the usual recorded forward + backward, where the head's dL/dh rows are scaled by -g_s * n on the host (one
   read and one write of [rows, H] inside the step) to g_s * (W[target] - pW), exactly as cpu/preference.py's
   PreferenceEngine, and the micro-batch's loss slot gets the preference loss.

So no kernel changes; the cost over a KD step is one more forward and the host round trip of dL/dh. A fused
per-row weight in the KD head (a float mask) would remove both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.model import StudentWeights
from gpu.student import GPUStudent
from model.dpo import DpoConfig, PairTerms, preference_loss
from model.kd import LossConfig
from schemas.optim import AdamWConfig, StepStats


class GPUPreferenceStudent(GPUStudent):
    """GPUStudent whose loss is a preference objective over pairs; the API of cpu/preference.py's engine."""

    def __init__(
        self,
        dev: Device,
        weights: StudentWeights,
        *,
        targets: Iterable[str],
        r: int,
        alpha: float,
        pairs: int,
        seq_len: int,
        dpo: DpoConfig,
        optim: AdamWConfig | None = None,
        vocab_chunk: int = 4096,
        layers: Iterable[int] | None = None,
        grad_accum: int = 1,
        precision: str = "f32",
    ) -> None:
        super().__init__(
            dev,
            weights,
            targets=targets,
            r=r,
            alpha=alpha,
            batch=2 * pairs,
            seq_len=seq_len,
            top_k=1,
            loss=LossConfig("forward_kl", tau=1.0),
            optim=optim,
            vocab_chunk=vocab_chunk,
            layers=layers,
            grad_accum=grad_accum,
            precision=precision,
        )
        self.pairs, self.dpo = pairs, dpo
        self.last_terms: PairTerms | None = None
        self._mask = np.zeros(self.rows, bool)
        self._ref: np.ndarray | None = None
        self._row_scale: np.ndarray | None = None
        self._micro_losses = np.zeros(grad_accum, np.float32)

    def write_batch(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 -- the KD signature, refused
        raise TypeError("GPUPreferenceStudent takes pairs: call write_pairs(ids, mask, ref_logps)")

    def write_pairs(self, ids: np.ndarray, mask: np.ndarray, ref_logps: np.ndarray | None = None) -> None:
        """As PreferenceEngine.write_pairs: ids, mask [2P, T] (chosen rows first), ref_logps [2P] or None."""
        bt = (self.batch, self.seq_len)
        ids = np.asarray(ids).reshape(bt).astype(np.int64)
        mask = np.asarray(mask).reshape(bt) != 0
        mask[:, -1] = False
        targets = np.zeros(bt, np.int64)
        targets[:, :-1] = ids[:, 1:]
        zeros = np.zeros((*bt, 1), np.float32)
        super().write_batch(ids, targets, mask.astype(np.uint8), targets[..., None], zeros, None)
        self._mask = mask.reshape(-1)
        self._ref = None if ref_logps is None else np.asarray(ref_logps, np.float64).reshape(self.batch)

    # ---- pass 1: log-probs and the preference loss ----------------------------------------------------
    def sequence_logps(self) -> tuple[np.ndarray, np.ndarray]:
        """Forward only: (summed response log-prob [2P], response tokens [2P]) of the written pairs."""
        ce = GPUStudent.evaluate_batch(self)["ce"]
        self.dev.write(self.losses, self._micro_losses)  # evaluate_batch wrote slot 0: restore the step's losses
        rows = np.flatnonzero(self._mask)
        seq = rows // self.seq_len
        logp = np.bincount(seq, weights=-ce[rows], minlength=self.batch)
        return logp, np.bincount(seq, minlength=self.batch)

    def _terms(self, logp: np.ndarray, count: np.ndarray) -> PairTerms:
        p = self.pairs
        if self._ref is None and not self.dpo.reference_free:
            raise RuntimeError("GPUPreferenceStudent: write_pairs(..., ref_logps) is needed for a reference-based loss")
        rc, rr = (None, None) if self._ref is None else (self._ref[:p], self._ref[p:])
        return preference_loss(logp[:p], logp[p:], rc, rr, count[:p], count[p:], self.dpo)

    def evaluate_pairs(self) -> PairTerms:
        """Forward only: the preference loss terms of the written pairs."""
        return self._terms(*self.sequence_logps())

    def _prepare(self, micro: int) -> None:
        """Pass 1 for micro-batch `micro`: its loss and the per-row scale of the head's gradient."""
        terms = self._terms(*self.sequence_logps())
        rows = np.flatnonzero(self._mask)
        g = np.concatenate([terms.d_chosen, terms.d_rejected])[rows // self.seq_len]
        scale = np.zeros(self.rows, np.float32)
        scale[rows] = -g * max(1, len(rows))
        self._row_scale, self.last_terms = scale, terms
        self._micro_losses[micro] = terms.loss

    # ---- pass 2: the recorded step with the scaled head gradient ---------------------------------------
    def _kd_head(self, loss_index: int, backward: bool, h16: Any) -> None:
        super()._kd_head(loss_index, backward, h16)
        if backward and self._row_scale is not None:
            dh = self.dev.read(self.a["tmp"], np.float32, (self.rows, self.cfg.hidden))
            self.dev.write(self.a["tmp"], dh * self._row_scale[:, None])
            self.dev.write(self.losses, self._micro_losses[loss_index : loss_index + 1], offset=4 * loss_index)

    def loss_and_grads(self) -> float:
        self._prepare(0)
        try:
            super().loss_and_grads()
        finally:
            self._row_scale = None
        return float(self._micro_losses[0])

    def accumulate(self, micro: int) -> None:
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{self.grad_accum - 1}")
        self._prepare(micro)
        try:
            super().accumulate(micro)
        finally:
            self._row_scale = None

    def train_step(self, lr: float) -> StepStats:
        if self.grad_accum != 1:
            raise ValueError("train_step is for grad_accum=1: call accumulate() per micro-batch, then apply()")
        self.accumulate(0)
        return self.apply(lr)

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        raise TypeError("GPUPreferenceStudent: use evaluate_pairs() / sequence_logps()")
