"""PreferenceEngine: DPO-family training of LoRA on the numpy engine, through the same forward, CE head and backward.

A batch holds P pairs as 2P sequences: rows 0..P-1 the chosen responses, P..2P-1 the rejected ones, each the
rendered prompt + response, with mask[t] = 1 where the target ids[t+1] is a response token. One vocabulary pass
(cpu/head.py, tau = 1, weighted) gives per masked row the target's log-probability z[t] - lse(z) and
pW = sum_v softmax(z)_v W_v. Summed per sequence that is logπ(y); model/dpo.py turns the 2P sums (and the
reference's) into the loss and g_s = dL/dlogπ(s); since d logπ / dz_row = onehot(target) - softmax(z),

    dL/dh_row = g_s * (W[target] - pW)

is the CE head's gradient with a signed per-sequence weight, and the rest of the backward is NumpyEngine's.
With the adapter zeroed (B = 0) the same pass gives the reference log-probs of the default reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from cpu.engine import ACTIVATION_BUDGET, NumpyEngine
from model.config import ModelConfig
from model.dpo import DpoConfig, PairTerms, preference_loss
from model.kd import LossConfig
from schemas.optim import AdamWConfig


class PreferenceEngine(NumpyEngine):
    """NumpyEngine whose loss is a preference objective over pairs (model/dpo.py) instead of KD."""

    def __init__(
        self,
        cfg: ModelConfig | None,
        weights: Mapping[str, np.ndarray] | str | Path,
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
        activation_budget: int = ACTIVATION_BUDGET,
    ) -> None:
        super().__init__(
            cfg,
            weights,
            targets=targets,
            r=r,
            alpha=alpha,
            batch=2 * pairs,
            seq_len=seq_len,
            top_k=1,
            loss=LossConfig(),
            optim=optim,
            vocab_chunk=vocab_chunk,
            layers=layers,
            grad_accum=grad_accum,
            precision=precision,
            activation_budget=activation_budget,
        )
        self.pairs, self.dpo = pairs, dpo
        self.last_terms: PairTerms | None = None
        self.last_hidden: np.ndarray | None = None

    def write_batch(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 -- the KD signature, refused
        raise TypeError("PreferenceEngine takes pairs: call write_pairs(ids, mask, ref_logps)")

    def write_pairs(self, ids: np.ndarray, mask: np.ndarray, ref_logps: np.ndarray | None = None) -> None:
        """Take P pairs: ids and mask [2P, T] (chosen rows first, then rejected; mask[t] = 1 where ids[t+1] is a
        response token), ref_logps [2P] the reference's summed response log-probs (None: reference_free, or a
        forward-only pass)."""
        bt, v = (self.batch, self.seq_len), self.cfg.vocab
        ids = np.asarray(ids).reshape(bt).astype(np.intp)
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            raise ValueError(f"token ids outside the student's vocabulary [0, {v})")
        mask = np.asarray(mask).reshape(bt) != 0
        mask[:, -1] = False  # the last position has no target
        targets = np.zeros(bt, np.intp)
        targets[:, :-1] = ids[:, 1:]
        ref = None if ref_logps is None else np.asarray(ref_logps, np.float64).reshape(self.batch)
        self._batch = {
            "ids": ids,
            "targets": targets.reshape(-1),
            "mask": mask.reshape(-1),
            "ref": ref,
            "prefix": None,
        }

    # ---- the loss -------------------------------------------------------------------------------------
    def _token_pass(self, nf: np.ndarray, rows: np.ndarray, backward: bool):
        """(log p(target) per masked row, the vocabulary pass) for the normed rows nf[rows]."""
        b = self._inputs()
        targets = b["targets"][rows]
        no_ids = np.zeros((len(rows), 0), np.intp)
        vp = self.head.vocab_pass(nf[rows], no_ids, targets, 1.0, weighted="tau" if backward else "")
        return vp.gathered[:, 0].astype(np.float64) - vp.lse_1, vp

    def _sequence_sums(self, rows: np.ndarray, token_logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seq = rows // self.seq_len
        logp = np.bincount(seq, weights=token_logp, minlength=self.batch)
        count = np.bincount(seq, minlength=self.batch)
        return logp, count

    def _terms(self, logp: np.ndarray, count: np.ndarray) -> PairTerms:
        p, ref = self.pairs, self._inputs()["ref"]
        if ref is None and not self.dpo.reference_free:
            raise RuntimeError("PreferenceEngine: write_pairs(..., ref_logps) is needed for a reference-based loss")
        rc, rr = (None, None) if ref is None else (ref[:p], ref[p:])
        return preference_loss(logp[:p], logp[p:], rc, rr, count[:p], count[p:], self.dpo)

    def _head_loss_rows(self, backward: bool):
        """Forward, the CE head over the response rows, the preference loss and dL/dh of those rows."""
        b = self._inputs()
        x, nf, inputs, caches = self._forward(keep=backward)
        rows = np.flatnonzero(b["mask"])
        if len(rows) == 0:
            self.last_terms = None
            return 0.0, None, rows, (x, inputs, caches)
        token_logp, vp = self._token_pass(nf, rows, backward)
        logp, count = self._sequence_sums(rows, token_logp)
        terms = self._terms(logp, count)
        self.last_terms = terms
        dh = None
        if backward:
            g = np.concatenate([terms.d_chosen, terms.d_rejected])[rows // self.seq_len].astype(np.float32)
            dh = g[:, None] * (self.head.w[b["targets"][rows]] - vp.q_w)
        return terms.loss, dh, rows, (x, inputs, caches)

    # ---- forward only ---------------------------------------------------------------------------------
    def sequence_logps(self) -> tuple[np.ndarray, np.ndarray]:
        """Forward only on the written pairs: (summed response log-prob [2P] float64, response tokens [2P]);
        the normed final hidden states stay in last_hidden [2P * T, H]."""
        b = self._inputs()
        _, nf, _, _ = self._forward(keep=False)
        self.last_hidden = nf
        rows = np.flatnonzero(b["mask"])
        token_logp, _ = self._token_pass(nf, rows, backward=False)
        return self._sequence_sums(rows, token_logp)

    def final_hidden(self) -> np.ndarray:
        """Forward only: the normed final hidden states [2P * T, H] (rows of the lm_head's input)."""
        return self._forward(keep=False)[1]

    def evaluate_pairs(self) -> PairTerms:
        """Forward only: the preference loss terms of the written pairs (needs ref_logps unless reference_free)."""
        logp, count = self.sequence_logps()
        return self._terms(logp, count)

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        raise TypeError("PreferenceEngine: use evaluate_pairs() / sequence_logps()")


def kl_rows(h: np.ndarray, w: np.ndarray, h_ref: np.ndarray, w_ref: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """KL(softmax(h W^T) || softmax(h_ref W_ref^T)) per row [n] float64, one pass over vocabulary chunks:
    KL = sum_v p_v (z_v - z'_v) - lse(z) + lse(z'), the p-weighted sum kept rescaled to the running max."""
    n, vocab = h.shape[0], w.shape[0]
    m = np.full(n, -np.inf)
    m_ref = np.full(n, -np.inf)
    s, s_ref, acc = np.zeros(n), np.zeros(n), np.zeros(n)
    for c0 in range(0, vocab, chunk):
        z = (h @ w[c0 : c0 + chunk].T).astype(np.float64)
        zr = (h_ref @ w_ref[c0 : c0 + chunk].T).astype(np.float64)
        m_new = np.maximum(m, z.max(axis=1))
        alpha = np.exp(m - m_new)
        e = np.exp(z - m_new[:, None])
        s = s * alpha + e.sum(axis=1)
        acc = acc * alpha + (e * (z - zr)).sum(axis=1)
        m = m_new
        mr_new = np.maximum(m_ref, zr.max(axis=1))
        s_ref = s_ref * np.exp(m_ref - mr_new) + np.exp(zr - mr_new[:, None]).sum(axis=1)
        m_ref = mr_new
    return np.maximum(acc / s - (m + np.log(s)) + (m_ref + np.log(s_ref)), 0.0)
