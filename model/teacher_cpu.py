"""The teacher's top-k next-token distribution on the CPU, through the numpy reference forward.

gpu.teacher.GPUTeacher.topk computes the same on the GPU; both feed data.topk. reference_sampled_batch: the sampled
store's draws instead (model/sampled.py); gpu.teacher.GPUTeacher.sampled is its GPU twin (gpu/ops/sampled.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from model.config import ModelConfig
from model.reference import block_forward, embed, forward, lm_head_weight, rmsnorm_forward
from model.sampled import sample_positions


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


# ---------------------------------------------------------------- batched, chunked over the vocabulary


def reference_topk_batch(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    k: int,
    temperature: float,
    *,
    mask: np.ndarray | None = None,
    vocab_chunk: int = 8192,
    max_rows: int = 4096,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """reference_topk for many sequences per call: ids [N, T] -> (ids [N, T, k], logprobs [N, T, k], tail [N, T]).

    The forward runs batched in float32 (at most max_rows = N' * T tokens at a time); the lm_head and the top-k
    run over vocab_chunk ids at a time (topk_chunked), never a [T, V] array. Positions with mask == 0 (when given)
    are skipped by the head and come back as id 0, logprob 0, tail 0. Same semantics as reference_topk; against it
    logprobs differ by float32 rounding of the logits (~1e-6 relative: 1.5e-5 absolute on SmolLM2-135M, ~1e-6 on
    the tiny test model against float64), tails by ~1e-6 relative; ids agree except between near-equal logits.
    """
    ids = _sequence_ids(ids, cfg)
    n_seq, t = ids.shape
    out_ids = np.zeros((n_seq, t, k), np.int64)
    out_lp = np.zeros((n_seq, t, k), np.float32)
    out_tail = np.zeros((n_seq, t), np.float32)
    for sl, keep, h, lm_head in _final_hidden(weights, cfg, ids, mask, max_rows):
        top_ids, top_lp, tail = topk_chunked(h, lm_head, k, temperature, vocab_chunk)
        out_ids[sl][keep], out_lp[sl][keep], out_tail[sl][keep] = top_ids, top_lp, tail
    return out_ids, out_lp, out_tail


def _sequence_ids(ids: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """ids as a 2-D [N, T] integer array inside the teacher's vocabulary (else ValueError)."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be a 2-D [N, T] integer array, got {ids.dtype} shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab):
        raise ValueError(f"ids outside the teacher vocabulary [0, {cfg.vocab})")
    return ids


def _final_hidden(
    weights: Mapping[str, np.ndarray], cfg: ModelConfig, ids: np.ndarray, mask: np.ndarray | None, max_rows: int
) -> Iterator[tuple[slice, np.ndarray, np.ndarray, np.ndarray]]:
    """(sequences, their kept positions [n', T], the normed final hidden states there [rows, H], lm_head) per group
    of at most max_rows tokens: the batched float32 forward of both teachers."""
    n_seq, t = ids.shape
    keep = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).reshape(ids.shape) != 0
    w = {name: np.asarray(a, np.float32) for name, a in weights.items()}
    lm_head = lm_head_weight(w)
    group = max(1, max_rows // max(t, 1))
    for s0 in range(0, n_seq, group):
        sl = slice(s0, min(n_seq, s0 + group))
        x = embed(w, cfg, ids[sl].astype(np.intp))
        for layer in range(cfg.n_layers):
            x = block_forward(x, w, cfg, layer, {}, 1.0)[0]
        yield sl, keep[sl], rmsnorm_forward(x, w["output_norm.weight"], cfg.eps)[keep[sl]], lm_head


SAMPLE_BLOCK_FLOATS = 1 << 22  # logits per block of rows of the sampled teacher (32 MiB of float64)


def reference_sampled_batch(
    weights: Mapping[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    n: int,
    temperature: float,
    seed: int,
    seq_ids: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    max_rows: int = 4096,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sampled store's rows for many sequences: ids [N, T] of the sequences seq_ids [N] -> (ids [N, T, n],
    logp codes uint8 [N, T, n], counts uint8 [N, T, n]) (model/sampled.py's sample_positions, keyed by seed,
    seq_id and position; float32 logits a block of rows at a time, the draw in float64). Positions with mask 0
    come back as zeros. A position's row depends on its logits and key only, not on the batch around it."""
    ids = _sequence_ids(ids, cfg)
    n_seq, t = ids.shape
    seq_ids = np.asarray(seq_ids, np.int64).reshape(n_seq)
    out = [np.zeros((n_seq, t, n), np.int64), np.zeros((n_seq, t, n), np.uint8), np.zeros((n_seq, t, n), np.uint8)]
    for sl, keep, h, lm_head in _final_hidden(weights, cfg, ids, mask, max_rows):
        rows, cols = np.nonzero(keep)
        seq, pos = seq_ids[sl][rows], cols
        block = max(1, SAMPLE_BLOCK_FLOATS // lm_head.shape[0])
        parts = [
            sample_positions(h[r : r + block] @ lm_head.T, temperature, n, seed, seq[r : r + block], pos[r : r + block])
            for r in range(0, len(rows), block)
        ]
        if parts:
            s_ids, s_counts, s_codes = (np.concatenate(p) for p in zip(*parts, strict=True))
            out[0][sl][keep], out[1][sl][keep], out[2][sl][keep] = s_ids, s_codes, s_counts
    return out[0], out[1], out[2]


def topk_chunked(
    h: np.ndarray, w: np.ndarray, k: int, temperature: float, chunk: int = 8192
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """topk_from_logits(h W^T) for h [n, H], W [V, H] float32, over `chunk` vocabulary rows at a time.

    Per chunk: z = h W_c^T / tau (float32 GEMM), its k best ids merged into the running k best; the exp-sum of
    everything outside the running top-k (rescaled to the running max, summed in float64) is the tail, so the
    tail needs no 1 - sum(top) cancellation. Rows whose k-th value ties with a value left out are redone
    exactly on their full row (ties keep the smaller ids, as topk_from_logits does)."""
    n, vocab = h.shape[0], w.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, vocab={vocab}], got {k}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inv_tau = np.float32(1.0 / temperature)
    best = np.full((n, k), -np.inf, np.float32)
    best_ids = np.zeros((n, k), np.int64)
    m = np.full(n, -np.inf, np.float32)  # running max of z / tau
    rest = np.zeros(n, np.float64)  # sum exp(z / tau - m) over the ids outside the running top-k
    runner_up = np.full(n, -np.inf, np.float32)  # the largest value left out so far
    rows = np.arange(n)[:, None]
    for c0 in range(0, vocab, chunk):
        z = h @ w[c0 : c0 + chunk].T
        z *= inv_tau
        if not np.isfinite(z).all():
            raise ValueError("teacher logits contain NaN or inf")
        nv = z.shape[1]
        if nv > k:
            part = np.argpartition(-z, k, axis=1)  # [:, :k] the chunk's k best, [:, k] the next one
            runner_up = np.maximum(runner_up, z[rows[:, 0], part[:, k]])
            part = part[:, :k]
        else:
            part = np.broadcast_to(np.arange(nv), (n, nv))
        m_new = np.maximum(m, z.max(axis=1))
        rest *= np.exp(m - m_new).astype(np.float64)
        cand = z[rows, part]
        np.subtract(z, m_new[:, None], out=z)
        np.exp(z, out=z)
        z[rows, part] = 0.0  # the candidates are counted below, when they leave the top-k
        rest += z.sum(axis=1, dtype=np.float64)
        vals = np.concatenate([best, cand], axis=1)
        cols = np.concatenate([best_ids, part + c0], axis=1)
        order = np.argpartition(-vals, k - 1, axis=1)
        keep, drop = order[:, :k], order[:, k:]
        out_vals = vals[rows, drop]
        rest += np.exp(out_vals - m_new[:, None]).sum(axis=1, dtype=np.float64)
        runner_up = np.maximum(runner_up, out_vals.max(axis=1, initial=-np.inf))
        best, best_ids, m = vals[rows, keep], cols[rows, keep], m_new
    top = np.exp(best - m[:, None]).sum(axis=1, dtype=np.float64)
    lse = m.astype(np.float64) + np.log(top + rest)
    order = np.lexsort((best_ids, -best), axis=1)  # by -logprob, then id
    best_ids = np.take_along_axis(best_ids, order, axis=1)
    logp = np.take_along_axis(best, order, axis=1).astype(np.float64) - lse[:, None]
    tail = rest / (top + rest)
    for row in np.flatnonzero(runner_up >= best.min(axis=1)):  # a tie at the k-th value: redo the row exactly
        r_ids, r_lp, r_tail = topk_from_logits((h[row] @ w.T)[None], k, temperature)
        best_ids[row], logp[row], tail[row] = r_ids[0], r_lp[0], r_tail[0]
    return best_ids, logp.astype(np.float32), tail.astype(np.float32)
