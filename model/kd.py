"""Knowledge-distillation losses over a teacher's top-k: the numpy oracle (forward and hand-written backward).

Inputs per position t (only rows with mask != 0 count):
  logits z [V] of the student; teacher ids [k] (distinct) and teacher log-probs lt [k] at temperature tau,
  as stored by the precompute; optionally the teacher tail = 1 - sum(exp(lt)), clipped >= 0 (computed from
  lt when not given); the true next token (target) for the optional cross-entropy.

Semantics (EPS = 1e-12, every logarithm of a probability is taken of max(prob, EPS)):
  q = softmax(z / tau) over the full vocabulary; a = log q[ids] (k values).
  Support S: the k ids, plus one tail bucket when cfg.use_tail.
  Teacher over S: no tail  p = exp(lt) renormalised over the k ids;  tail  p = (exp(lt), tail).
  Student over S, forward_kl without tail: q_S = q[ids] (full softmax, NOT renormalised: the standard
    sparse-KD form, which pushes student mass into the teacher's top-k).
  Student over S otherwise: no tail  qhat = q[ids] / sum(q[ids]);  tail  qhat = (q[ids], 1 - sum(q[ids])).
  forward_kl = sum_S p (log p - log q_S)
  reverse_kl = sum_S qhat (log qhat - log p)
  jsd(beta)  = beta KL(p || m) + (1 - beta) KL(qhat || m),  m = beta p + (1 - beta) qhat,  0 < beta < 1.
  per position: tau^2 * KD + ce_weight * CE,  CE = -log softmax(z)[target] (at tau = 1).
  loss = sum over positions with mask != 0 / max(1, count).

Sampled store (cfg.samples = n > 0; model/sampled.py draws them): per position the distinct ids of n draws from
the teacher at tau, their counts c (sum n) and stored log-probs lt. Only forward_kl over the full vocabulary:
  KD_hat = sum_ids (c / n) (lt - a),  a = log q[ids] (the full softmax),
an unbiased estimate of KL(p_T || q) (up to the log-prob code's rounding, which touches the value only), whose
gradient dKD_hat/dz = (q - c / n) / tau is unbiased for the full-vocabulary (q - p_T) / tau, since E[c] = n p_T.
Padding columns (count 0) contribute nothing. No tail, no renormalisation, no EPS floor.

Guards (so nothing is NaN or infinite for finite logits): teacher probabilities over S are floored at EPS
(a zero tail becomes EPS, so a 0 log 0 term contributes ~EPS |log EPS|, not NaN); the student tail
1 - sum(q[ids]) is computed as -expm1(logsumexp(a)) and floored at EPS; its gradient is zero while floored.

Chunked form (what the GPU mirrors): the KD term depends on the logits only through
a = z[ids]/tau - lse(z/tau), so a vocab-chunked online logsumexp gives everything the forward needs. With
da = dL/da (kd_support_backward), the backward is a dense term from the logsumexps plus a sparse scatter:
  dz = (scatter(da, ids) - q * sum(da)) / tau  [+ ce_weight / n * (softmax(z) - onehot(target))].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EPS = 1e-12
LOG_EPS = math.log(EPS)
KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class LossConfig:
    """KD loss settings: kind, temperature tau, JSD beta, CE weight lambda, use of the tail bucket."""

    kind: str = "forward_kl"
    tau: float = 1.0
    beta: float = 0.5
    ce_weight: float = 0.0
    use_tail: bool = False
    samples: int = 0  # > 0: the sampled store, n draws per position (forward_kl only, no tail)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"LossConfig.kind={self.kind!r} is not one of {KINDS}")
        if self.samples < 0:
            raise ValueError(f"LossConfig.samples={self.samples} must be >= 0")
        if self.samples and (self.kind != "forward_kl" or self.use_tail):
            raise ValueError(
                f"LossConfig.samples={self.samples}: the sampled store estimates forward_kl without a tail only, "
                f"not kind={self.kind!r} use_tail={self.use_tail}"
            )
        if not self.tau > 0:
            raise ValueError(f"LossConfig.tau={self.tau} must be > 0")
        if self.kind == "jsd" and not 0 < self.beta < 1:
            raise ValueError(f"LossConfig.beta={self.beta} must be in (0, 1) for jsd")
        if self.ce_weight < 0:
            raise ValueError(f"LossConfig.ce_weight={self.ce_weight} must be >= 0")


def logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Stable log(sum(exp(x))) along axis, keepdims."""
    m = np.max(x, axis=axis, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return x - logsumexp(x, axis)


# ---------------------------------------------------------------- teacher side (constants, no gradient)


def teacher_support(
    teacher_logprobs: np.ndarray, teacher_tail: np.ndarray | None, cfg: LossConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(p, log p) of the teacher over S: [N, k] without tail, [N, k+1] with; p floored at EPS."""
    lt = np.asarray(teacher_logprobs)
    if cfg.use_tail:
        if teacher_tail is None:
            tail = -np.expm1(logsumexp(lt)[:, 0])
        else:
            tail = np.asarray(teacher_tail, dtype=lt.dtype)
        lp = np.concatenate([lt, np.log(np.maximum(tail, EPS))[:, None]], axis=1)
    else:
        lp = log_softmax(lt)
    lp = np.maximum(lp, LOG_EPS)
    return np.exp(lp), lp


# ---------------------------------------------------------------- student: a = log q[ids] -> log q over S


def student_support_forward(a: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """Student log-probs over S from a = log q[ids] [N, k]."""
    if cfg.use_tail:
        q_tail = -np.expm1(logsumexp(a))  # 1 - sum(q[ids]), [N, 1]
        return np.concatenate([a, np.log(np.maximum(q_tail, EPS))], axis=1)
    if cfg.kind == "forward_kl":
        return a
    return log_softmax(a)


def student_support_backward(dls: np.ndarray, a: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """dL/da from dL/d(log q_S)."""
    if cfg.use_tail:
        k = a.shape[1]
        q_tail = -np.expm1(logsumexp(a))
        live = q_tail > EPS  # floored tail: zero gradient
        dlog_tail = np.where(live, dls[:, k:], 0.0) / np.where(live, q_tail, 1.0)
        return dls[:, :k] - dlog_tail * np.exp(a)  # d log(1 - sum e^a) / da_i = -e^a_i / q_tail
    if cfg.kind == "forward_kl":
        return dls
    ls = log_softmax(a)
    return dls - np.exp(ls) * np.sum(dls, axis=1, keepdims=True)


# ---------------------------------------------------------------- divergence over S


def divergence_forward(ls: np.ndarray, p: np.ndarray, lp: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """Per-row divergence [N] between teacher (p, lp) and student log-probs ls over S."""
    if cfg.kind == "forward_kl":
        return np.sum(p * (lp - ls), axis=1)
    s = np.exp(ls)
    if cfg.kind == "reverse_kl":
        return np.sum(s * (ls - lp), axis=1)
    b = cfg.beta
    lm = np.logaddexp(math.log(b) + lp, math.log1p(-b) + ls)
    return np.sum(b * p * (lp - lm) + (1 - b) * s * (ls - lm), axis=1)


def divergence_backward(ls: np.ndarray, p: np.ndarray, lp: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """d divergence / d ls [N, |S|]."""
    if cfg.kind == "forward_kl":
        return -p
    s = np.exp(ls)
    if cfg.kind == "reverse_kl":
        return s * (ls - lp + 1.0)
    b = cfg.beta
    lm = np.logaddexp(math.log(b) + lp, math.log1p(-b) + ls)
    return (1 - b) * s * (ls - lm)  # the d lm terms cancel: sum (beta p + (1-beta) s) / m = 1 per entry


# ---------------------------------------------------------------- KD over S (the chunk-independent core)


def sampled_weights(counts: np.ndarray | None, cfg: LossConfig) -> np.ndarray:
    """c / n [N, k] of a sampled batch (refused without counts)."""
    if counts is None:
        raise ValueError(f"LossConfig.samples={cfg.samples}: the sampled loss needs the teacher's counts")
    return np.asarray(counts, np.float64) / cfg.samples


def kd_support_forward(
    a: np.ndarray,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    cfg: LossConfig,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """Per-row KD [N] (without the tau^2 factor) from a = log softmax(z/tau)[ids] [N, k]; counts [N, k] of the
    sampled store (cfg.samples > 0)."""
    if cfg.samples:
        return np.sum(sampled_weights(counts, cfg) * (np.asarray(teacher_logprobs, a.dtype) - a), axis=1)
    p, lp = teacher_support(teacher_logprobs, teacher_tail, cfg)
    return divergence_forward(student_support_forward(a, cfg), p, lp, cfg)


def kd_support_backward(
    a: np.ndarray,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    cfg: LossConfig,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """d KD / d a [N, k] (without the tau^2 factor)."""
    if cfg.samples:
        return -sampled_weights(counts, cfg).astype(a.dtype)
    p, lp = teacher_support(teacher_logprobs, teacher_tail, cfg)
    ls = student_support_forward(a, cfg)
    return student_support_backward(divergence_backward(ls, p, lp, cfg), a, cfg)


# ---------------------------------------------------------------- full loss over logits


def _rows(mask: np.ndarray) -> tuple[np.ndarray, int]:
    rows = np.flatnonzero(np.asarray(mask) != 0)
    return rows, max(1, rows.size)


def _teacher_rows(
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    teacher_counts: np.ndarray | None,
    rows: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The teacher's log-probs, tail and (sampled store) counts of the masked rows."""
    lt = np.asarray(teacher_logprobs)[rows].astype(dtype)
    tail = None if teacher_tail is None else np.asarray(teacher_tail)[rows].astype(dtype)
    return lt, tail, None if teacher_counts is None else np.asarray(teacher_counts)[rows]


def _student_rows(
    logits: np.ndarray, teacher_ids: np.ndarray, mask: np.ndarray, cfg: LossConfig
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """(masked rows, their count, their logits z, the teacher ids there, log softmax(z / tau))."""
    rows, n = _rows(mask)
    z = logits[rows]
    return rows, n, z, np.asarray(teacher_ids)[rows].astype(np.intp), log_softmax(z / cfg.tau)


def kd_loss_forward(
    logits: np.ndarray,
    teacher_ids: np.ndarray,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    targets: np.ndarray,
    mask: np.ndarray,
    cfg: LossConfig,
    teacher_counts: np.ndarray | None = None,
) -> float:
    """Masked mean of tau^2 * KD + ce_weight * CE (see the module docstring)."""
    rows, n, z, ids, logq = _student_rows(logits, teacher_ids, mask, cfg)
    a = np.take_along_axis(logq, ids, axis=1)
    lt, tail, counts = _teacher_rows(teacher_logprobs, teacher_tail, teacher_counts, rows, z.dtype)
    per_row = cfg.tau**2 * kd_support_forward(a, lt, tail, cfg, counts)
    if cfg.ce_weight:
        tgt = np.asarray(targets)[rows].astype(np.intp)
        per_row = per_row - cfg.ce_weight * np.take_along_axis(log_softmax(z), tgt[:, None], axis=1)[:, 0]
    return float(np.sum(per_row) / n)


def kd_loss_backward(
    logits: np.ndarray,
    teacher_ids: np.ndarray,
    teacher_logprobs: np.ndarray,
    teacher_tail: np.ndarray | None,
    targets: np.ndarray,
    mask: np.ndarray,
    cfg: LossConfig,
    teacher_counts: np.ndarray | None = None,
) -> np.ndarray:
    """d loss / d logits [T, V]; zero on rows with mask == 0."""
    rows, n, z, ids, logq = _student_rows(logits, teacher_ids, mask, cfg)
    a = np.take_along_axis(logq, ids, axis=1)
    lt, tail, counts = _teacher_rows(teacher_logprobs, teacher_tail, teacher_counts, rows, z.dtype)
    da = kd_support_backward(a, lt, tail, cfg, counts) * (cfg.tau**2 / n)
    g = np.zeros_like(z)
    np.add.at(g, (np.arange(len(rows))[:, None], ids), da)  # scatter (add: safe even for repeated ids)
    dz = (g - np.exp(logq) * np.sum(da, axis=1, keepdims=True)) / cfg.tau
    if cfg.ce_weight:
        tgt = np.asarray(targets)[rows].astype(np.intp)
        dce = np.exp(log_softmax(z))
        dce[np.arange(len(rows)), tgt] -= 1.0
        dz = dz + (cfg.ce_weight / n) * dce
    dlogits = np.zeros_like(logits)
    dlogits[rows] = dz
    return dlogits
