"""Teacher-vs-student agreement metrics over full-vocabulary logits (numpy)."""

from __future__ import annotations

import numpy as np


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
