"""Teacher-vs-student agreement metrics over full-vocabulary logits (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ECE_BINS = 10  # equal-width confidence bins of the expected calibration error (Guo et al. 2017 use 10-15)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis (float64)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def distribution_gap(teacher_logits: np.ndarray, student_logits: np.ndarray) -> dict[str, float]:
    """Mean full-vocab KL(teacher || student) per token and top-1 agreement over rows [T, V]."""
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"logit shapes differ: teacher {teacher_logits.shape}, student {student_logits.shape}")
    lt, ls = log_softmax(teacher_logits), log_softmax(student_logits)
    kl = (np.exp(lt) * (lt - ls)).sum(axis=-1)
    top1 = teacher_logits.argmax(axis=-1) == student_logits.argmax(axis=-1)
    return {"kl": float(kl.mean()), "top1": float(top1.mean()), "tokens": int(kl.shape[0])}


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross-entropy (nats) of rows [T, V] against integer targets [T]."""
    lp = log_softmax(logits)
    return float(-lp[np.arange(len(targets)), targets].mean())


@dataclass
class Calibration:
    """Expected calibration error of the student's top-1: over positions binned by the student's top-1 probability
    (ECE_BINS equal-width bins), sum_b (n_b / n) |agree_b - confidence_b|, where agree_b is the fraction of bin b
    whose top-1 is right (the true next token, or the teacher's top-1). Accumulated batch by batch (add)."""

    bins: int = ECE_BINS
    n: np.ndarray = field(init=False)
    confidence: np.ndarray = field(init=False)
    agree: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.n, self.confidence, self.agree = (np.zeros(self.bins, np.float64) for _ in range(3))

    def add(self, top1_logp: np.ndarray, agree: np.ndarray) -> None:
        """Positions with the student's top-1 log-prob top1_logp [n] and whether that top-1 is right [n]."""
        p = np.exp(np.minimum(np.asarray(top1_logp, np.float64), 0.0))
        b = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        self.n += np.bincount(b, minlength=self.bins)
        self.confidence += np.bincount(b, weights=p, minlength=self.bins)
        self.agree += np.bincount(b, weights=np.asarray(agree, np.float64), minlength=self.bins)

    def ece(self) -> float:
        """The expected calibration error of what was added (0 when nothing was)."""
        total = self.n.sum()
        return float(np.abs(self.agree - self.confidence).sum() / total) if total else 0.0
