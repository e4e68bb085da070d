"""The sampled teacher store's draw: n tokens per position from the teacher's distribution, reproducible anywhere.

Generator: Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_10), u32 arithmetic only, so a WGSL port
needs no 64-bit integers (the 32x32 -> 64 product is four 16-bit products there):
  key     (k0, k1)         = (seed mod 2^32, floor(seed / 2^32) mod 2^32)
  counter (c0, c1, c2, c3) = (pos, seq_id mod 2^32, floor(seq_id / 2^32) mod 2^32, block)
  round:  (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2 (full 64-bit products split in halves),
          c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); then k0 += W0, k1 += W1 (mod 2^32);
  10 rounds (the key is bumped between rounds, 9 times); M0 = 0xD2511F53, M1 = 0xCD9E8D57, W0 = 0x9E3779B9,
  W1 = 0xBB67AE85. Draw i of a position is word i mod 4 of block floor(i / 4); its uniform U_i = (x_i >> 8)
  * 2^-24 in [0, 1) (exact in float32 and float64). KNOWN_ANSWERS holds Random123's test vectors.

Draw (stratified inverse CDF: draw i takes the i-th of n equal slices of the CDF, so the draw of a uniformly chosen
slot has the teacher's law and E[count_v] = n p_v exactly, while the counts vary less than under n independent
draws, and never more):
  z' = float64(logit) / tau, m = max z', e_v = exp(z'_v - m), C_v = C_{v-1} + e_v summed in id order in float64
  (C_-1 = 0), S = C_{V-1}; threshold t_i = (i + U_i) / n * S; draw i = the first id v with C_v > t_i (a zero-mass
  id is never drawn). The thresholds ascend, so the draws come out sorted: one pass over the vocabulary.
What a GPU teacher must match: the generator bit for bit (KNOWN_ANSWERS and test vectors in tests), the
thresholds' definition and the first-C_v-above rule over ids in ascending order. Its CDF is a float32 (or
compensated) sum of its own float32 logits, so a draw may differ from this reference only where t_i lies within
that rounding of a boundary C_v: per draw about eps_f32 (6e-8) times the number of ids whose boundaries the
thresholds cross, so more for flat teachers and large vocabularies (gpu/ops/sampled.py; measured in
tests/test_gpu_sampled.py: 4 of 1,024 positions of a flat 5,000-id teacher, 1 of 2,048 on the tiny model): the
same backend (local or Ray) writes byte-identical shards; across backends the draws agree to that rate, as top-k's
ids agree up to ties.

Stored per position (encode): the distinct drawn ids ascending, their counts (uint8, summing to n) and the
teacher's log-prob of each, log p_v = z'_v - m - log S, as a uint8 code q = min(255, round(-16 log p_v)):
steps of 1/16 nat (error <= 1/32 nat) down to -15.9 nats. The log-probs serve only the reported loss (the
gradient needs the counts alone); a draw below e^-15.9 (p < 1.2e-7) is clamped there.
"""

from __future__ import annotations

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
ROUNDS = 10
LOGP_STEP = 16.0  # codes per nat of the stored log-probs
LOGP_MAX_CODE = 255
# Random123 kat_vectors, philox4x32 10: (counter, key) -> output.
KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Philox4x32-10 of counters (c0..c3, each an integer array, broadcast) under keys (k0, k1): uint32 [..., 4]."""
    c = [np.asarray(x, np.uint64) & MASK32 for x in counter]
    c = list(np.broadcast_arrays(*c, np.asarray(key[0], np.uint64), np.asarray(key[1], np.uint64)))
    k0, k1 = c[4] & MASK32, c[5] & MASK32
    c0, c1, c2, c3 = c[:4]
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        p0, p1 = M0 * c0, M1 * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & MASK32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def draw_bits(seed: int, seq_ids: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """The n generator words uint32 [R, n] of the positions (seq_ids [R], pos [R]) under `seed` (module docstring)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed {seed} must be in [0, 2^64)")
    seq = np.asarray(seq_ids, np.uint64)[:, None]
    p = np.asarray(pos, np.uint64)[:, None]
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)[None, :]
    key = (np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32))
    words = philox4x32((p, seq & MASK32, seq >> np.uint64(32), blocks), key)  # [R, blocks, 4]
    return words.reshape(len(seq), -1)[:, :n]


def uniforms(bits: np.ndarray) -> np.ndarray:
    """U = (x >> 8) * 2^-24 in [0, 1), float64 (exact)."""
    return (np.asarray(bits, np.uint32) >> np.uint32(8)).astype(np.float64) * 2.0**-24


def draw_from_logits(z: np.ndarray, tau: float, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(draws int64 [R, n] ascending, log p float64 [R, n] of each draw) from logits z [R, V] and generator words
    bits [R, n]: stratified inverse CDF in float64, ids in ascending order (module docstring)."""
    if not tau > 0:
        raise ValueError(f"temperature must be > 0, got {tau}")
    zt = np.asarray(z, np.float64) / tau
    if not np.isfinite(zt).all():
        raise ValueError("teacher logits contain NaN or inf")
    n_rows, n = bits.shape
    m = zt.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(zt - m), axis=1)  # sequential in id order
    total = cdf[:, -1]
    t = (np.arange(n)[None, :] + uniforms(bits)) / n * total[:, None]
    draws = np.empty((n_rows, n), np.int64)
    for r in range(n_rows):
        draws[r] = np.searchsorted(cdf[r], t[r], side="right")  # first v with C_v > t
    logp = np.take_along_axis(zt, draws, axis=1) - m - np.log(total)[:, None]
    return draws, logp


def encode(draws: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored form of ascending draws [R, n]: (ids int64 [R, n], counts uint8 [R, n], logp codes uint8 [R, n]),
    the distinct ids first (ascending), then padding (id 0, count 0, code 0)."""
    n_rows, n = draws.shape
    if n > 255:
        raise ValueError(f"{n} samples per position: counts are stored in a byte (at most 255)")
    first = np.ones(draws.shape, bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    slot = np.cumsum(first, axis=1) - 1
    rows = np.broadcast_to(np.arange(n_rows)[:, None], draws.shape)
    ids = np.zeros((n_rows, n), np.int64)
    counts = np.zeros((n_rows, n), np.uint8)
    codes = np.zeros((n_rows, n), np.uint8)
    ids[rows[first], slot[first]] = draws[first]
    codes[rows[first], slot[first]] = logp_code(logp[first])
    np.add.at(counts, (rows, slot), 1)
    return ids, counts, codes


def logp_code(logp: np.ndarray) -> np.ndarray:
    """uint8 code of log-probs (<= 0): min(255, round(-16 log p))."""
    return np.clip(np.rint(-LOGP_STEP * np.asarray(logp, np.float64)), 0, LOGP_MAX_CODE).astype(np.uint8)


def logp_value(code: np.ndarray) -> np.ndarray:
    """The log-prob of a stored code, float32: -code / 16."""
    return (np.asarray(code, np.float32) / np.float32(-LOGP_STEP)).astype(np.float32)


def sample_positions(
    z: np.ndarray, tau: float, n: int, seed: int, seq_ids: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stored rows (ids [R, n], counts [R, n], logp codes [R, n]) of positions (seq_ids, pos) with logits z."""
    draws, logp = draw_from_logits(z, tau, draw_bits(seed, seq_ids, pos, n))
    return encode(draws, logp)
