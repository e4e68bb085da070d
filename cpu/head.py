"""lm_head + KD loss on the CPU, chunked over the vocabulary: never a [rows, V] logits array.

One pass over the vocabulary chunks W_c [nv, H] of the lm_head: Z_c = h W_c^T (one BLAS GEMM), folded into each
row's online logsumexp (at tau and at 1), the logits gathered at the teacher ids and the target, the running
arg-max (evaluation) and, for the backward, the softmax-weighted sums of the lm_head rows

    qW = sum_v softmax(z / tau)_v W_v,   pW = sum_v softmax(z)_v W_v,

kept rescaled to the running maximum exactly as the logsumexp is (flash-attention style). model/kd.py's chunked
form dz = (scatter(da, ids) - q sum(da)) / tau + ce_weight / n (softmax(z) - onehot(target)) then gives

    dh = dz W = sum_j da_j W[id_j] / tau - sum(da) / tau * qW + ce_weight / n * (pW - W[target])

without a second pass over the vocabulary (the GPU recomputes Z_c instead; the two agree to float32 rounding).
The per-row KD terms (a = log softmax(z / tau)[ids] -> loss, dL/da) are model/kd.py's kd_support_forward /
kd_support_backward, in float64 on [rows, k].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from model.kd import LossConfig, kd_support_backward, kd_support_forward

GATHER_ROWS = 64  # rows per block of the sparse term's W[ids] gather ([64, k, H] floats at a time)
Product = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass
class VocabPass:
    """What one pass over the vocabulary leaves per row."""

    lse_tau: np.ndarray  # [n] float64: logsumexp(z / tau)
    lse_1: np.ndarray  # [n] float64: logsumexp(z)
    gathered: np.ndarray  # [n, k + 1] float32: z at the teacher ids, then at the target
    top1: np.ndarray | None  # [n] int64: arg-max of z (ties: the smallest id)
    q_w: np.ndarray | None  # [n, H] float32: sum_v softmax(z / tau)_v W_v
    p_w: np.ndarray | None  # [n, H] float32: sum_v softmax(z)_v W_v (q_w itself when tau == 1)
    top1_z: np.ndarray | None = None  # [n] float32: z at top1 (its log-prob is top1_z - lse_1)


class _Online:
    """Running (max, sum exp) of one temperature, and optionally the matching softmax-weighted sum of W rows."""

    def __init__(self, n: int, hidden: int, weighted: bool) -> None:
        self.m = np.full(n, -np.inf, np.float32)
        self.s = np.zeros(n, np.float64)
        self.acc = np.zeros((n, hidden), np.float32) if weighted else None

    def fold(
        self, z: np.ndarray, w_c: np.ndarray, scratch: np.ndarray, tmp: np.ndarray | None, product: Product
    ) -> None:
        """Fold the chunk z [n, nv] (already divided by the temperature) in; overwrites scratch with exp(z - m);
        product(p, w_c, out): out = p w_c, the chunk's share of the softmax-weighted sum."""
        m_new = np.maximum(self.m, z.max(axis=1))
        alpha = np.exp(self.m - m_new)  # 0 on the first chunk (m = -inf)
        np.subtract(z, m_new[:, None], out=scratch)
        np.exp(scratch, out=scratch)
        self.s *= alpha
        self.s += scratch.sum(axis=1, dtype=np.float64)
        if self.acc is not None:
            self.acc *= alpha[:, None]
            product(scratch, w_c, tmp)
            self.acc += tmp
        self.m = m_new

    def lse(self) -> np.ndarray:
        return self.m.astype(np.float64) + np.log(self.s)

    def weighted(self) -> np.ndarray | None:
        return None if self.acc is None else (self.acc / self.s[:, None].astype(np.float32))


class VocabHead:
    """The chunked lm_head of one student: W [V, H] float32, `chunk` vocabulary rows at a time."""

    def __init__(self, w: np.ndarray, chunk: int = 4096) -> None:
        if w.dtype != np.float32 or w.ndim != 2:
            raise ValueError(f"lm_head must be float32 [V, H], got {w.dtype} {w.shape}")
        self.w = np.ascontiguousarray(w)
        self.vocab, self.hidden = w.shape
        self.chunk = max(1, min(chunk, self.vocab))
        self._buffers: dict[tuple[str, int, int], np.ndarray] = {}

    @staticmethod
    def logits(h: np.ndarray, w_c: np.ndarray, out: np.ndarray) -> None:
        """out = h W_c^T, the logits of one vocabulary chunk (a study may round its operands:
        bench/int8_activation_kl.py `:head`)."""
        np.matmul(h, w_c.T, out=out)

    @staticmethod
    def weighted_rows(p: np.ndarray, w_c: np.ndarray, out: np.ndarray) -> None:
        """out = p W_c: a chunk's exp(z - m) [n, nv] times its rows of W, the backward's softmax-weighted sum (a
        study may round its operands: bench/int8_activation_kl.py `:dh`)."""
        np.matmul(p, w_c, out=out)

    def _buf(self, name: str, n: int, nv: int) -> np.ndarray:
        key = (name, n, nv)
        if key not in self._buffers:
            self._buffers[key] = np.empty((n, nv), np.float32)
        return self._buffers[key]

    def vocab_pass(
        self, h: np.ndarray, ids: np.ndarray, targets: np.ndarray, tau: float, *, weighted: str = "", top1: bool = False
    ) -> VocabPass:
        """One pass over the vocabulary for the rows h [n, H] (float32), teacher ids [n, k], targets [n].

        weighted: "" (forward only), "tau" (qW) or "tau+1" (qW and pW: the CE term at tau != 1)."""
        n, k = ids.shape
        inv_tau = np.float32(1.0 / tau)
        same = tau == 1.0
        at_tau = _Online(n, self.hidden, "tau" in weighted)
        at_1 = None if same else _Online(n, self.hidden, weighted == "tau+1")
        cols = np.concatenate([ids, targets[:, None]], axis=1).astype(np.intp)
        gathered = np.zeros((n, k + 1), np.float32)
        best = np.full(n, -np.inf, np.float32)
        best_id = np.zeros(n, np.int64)
        row_idx = np.arange(n)[:, None]
        tmp = np.empty((n, self.hidden), np.float32) if weighted else None
        for c0 in range(0, self.vocab, self.chunk):
            nv = min(self.chunk, self.vocab - c0)
            w_c = self.w[c0 : c0 + nv]
            z = self._buf("z", n, nv)
            self.logits(h, w_c, z)
            hit = (cols >= c0) & (cols < c0 + nv)
            if hit.any():
                gathered[hit] = z[np.broadcast_to(row_idx, cols.shape)[hit], cols[hit] - c0]
            if top1:
                arg = z.argmax(axis=1)
                val = z[np.arange(n), arg]
                better = val > best  # strict: an earlier chunk keeps a tie (the smaller id)
                best[better], best_id[better] = val[better], arg[better] + c0
            scratch = self._buf("e", n, nv)
            if same:
                at_tau.fold(z, w_c, scratch, tmp, self.weighted_rows)
                continue
            at_1.fold(z, w_c, scratch, tmp, self.weighted_rows)
            zt = self._buf("zt", n, nv)
            np.multiply(z, inv_tau, out=zt)
            at_tau.fold(zt, w_c, scratch, tmp, self.weighted_rows)
        lse_tau = at_tau.lse()
        q_w = at_tau.weighted()
        if same:
            lse_1, p_w = lse_tau, q_w
        else:
            lse_1, p_w = at_1.lse(), at_1.weighted()
        return VocabPass(lse_tau, lse_1, gathered, best_id if top1 else None, q_w, p_w, best if top1 else None)

    def sparse_rows(self, coef: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """sum_j coef[:, j] W[ids[:, j]] -> [n, H], a block of rows at a time (bounded gather)."""
        n = coef.shape[0]
        out = np.empty((n, self.hidden), np.float32)
        for r0 in range(0, n, GATHER_ROWS):
            r1 = min(n, r0 + GATHER_ROWS)
            rows = self.w[ids[r0:r1]]  # [b, k, H]
            out[r0:r1] = np.matmul(coef[r0:r1, None, :].astype(np.float32), rows)[:, 0]
        return out


@dataclass
class KdRows:
    """The KD loss of n rows: their share of the (masked-mean) loss and dL/da."""

    row_loss: np.ndarray  # [n] float64, sums to the loss
    da: np.ndarray  # [n, k] float64: dL/da (scaled by tau^2 / count)


def kd_rows(
    vp: VocabPass,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    cfg: LossConfig,
    count: int,
    backward: bool,
    counts: np.ndarray | None = None,
) -> KdRows:
    """model/kd.py's per-row loss from a = z[ids] / tau - lse_tau, in float64; count = masked rows of the batch;
    counts: the sampled store's (cfg.samples > 0)."""
    k = teacher_logprobs.shape[1]
    a = vp.gathered[:, :k].astype(np.float64) / cfg.tau - vp.lse_tau[:, None]
    lt = np.asarray(teacher_logprobs, np.float64)
    tail = None if teacher_tail is None else np.asarray(teacher_tail, np.float64)
    n = max(1, count)
    per_row = cfg.tau**2 * kd_support_forward(a, lt, tail, cfg, counts)
    if cfg.ce_weight:
        per_row = per_row + cfg.ce_weight * (vp.lse_1 - vp.gathered[:, k].astype(np.float64))
    da = kd_support_backward(a, lt, tail, cfg, counts) * (cfg.tau**2 / n) if backward else np.zeros((0, k))
    return KdRows(per_row / n, da)


def head_backward(
    head: VocabHead, vp: VocabPass, kd: KdRows, ids: np.ndarray, targets: np.ndarray, cfg: LossConfig, count: int
) -> np.ndarray:
    """dL/dh [n, H] float32 of the rows of one vocab_pass (weighted as the loss needs)."""
    inv_tau = 1.0 / cfg.tau
    dh = head.sparse_rows(kd.da * inv_tau, ids)
    dense = (kd.da.sum(axis=1) * inv_tau).astype(np.float32)
    dh -= dense[:, None] * vp.q_w
    if cfg.ce_weight:
        cw = np.float32(cfg.ce_weight / max(1, count))
        dh += cw * (vp.p_w - head.w[targets])
    return dh


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
