"""The teacher's top-k next-token distribution on the CPU, through the numpy reference forward.

gpu.teacher.GPUTeacher.topk computes the same on the GPU; both feed data.topk.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from model.config import ModelConfig
from model.reference import forward


def topk_from_logits(logits: np.ndarray, k: int, temperature: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [T, k] int64, logprobs [T, k] f32, tail [T] f32) from logits [T, V], computed in float64.

    logprobs = log_softmax(logits / temperature) at the k most probable ids, sorted by descending logprob
    (ties: smaller id first). tail = the probability mass of the other V - k ids, summed over them (equal to
    max(0, 1 - sum(exp(logprobs))) up to rounding, without the cancellation of a small tail).
    """
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2:
        raise ValueError(f"logits must be [T, V], got shape {z.shape}")
    n_tok, vocab = z.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, vocab={vocab}], got {k}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not np.isfinite(z).all():
        raise ValueError("teacher logits contain NaN or inf")
    z = z / temperature
    top = z.max(axis=1, keepdims=True)
    lse = top + np.log(np.exp(z - top).sum(axis=1, keepdims=True))
    logp = z - lse
    part = np.argpartition(-logp, k - 1, axis=1)[:, :k] if k < vocab else np.tile(np.arange(vocab), (n_tok, 1))
    vals = np.take_along_axis(logp, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)  # by -logprob, then id
    ids = np.take_along_axis(part, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1)
    # A tie at the k-th value: argpartition may have kept any of the tied ids; keep the smallest ones.
    kth = vals[:, -1:]
    if k < vocab:
        for row in np.flatnonzero((logp >= kth).sum(axis=1) > k):
            ids[row], vals[row] = _exact_row(logp[row], k)
    p = np.exp(logp)
    np.put_along_axis(p, ids, 0.0, axis=1)
    tail = p.sum(axis=1)
    return ids.astype(np.int64), vals.astype(np.float32), tail.astype(np.float32)


def _exact_row(logp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one row by (descending logprob, ascending id), among the ids at or above the k-th value."""
    kth = np.partition(logp, len(logp) - k)[len(logp) - k]
    cand = np.flatnonzero(logp >= kth)
    pick = cand[np.lexsort((cand, -logp[cand]))[:k]]
    return pick, logp[pick]


def reference_topk(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    k: int,
    temperature: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher top-k at every position of one sequence `ids` [T]: (ids [T, k], logprobs [T, k], tail [T]).

    Row t is the distribution of the token after ids[t] (see topk_from_logits for the exact semantics).
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} shape {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() >= cfg.vocab):
        raise ValueError(f"ids outside the teacher vocabulary [0, {cfg.vocab})")
    return topk_from_logits(forward(weights, cfg, ids.astype(np.int64)), k, temperature)
