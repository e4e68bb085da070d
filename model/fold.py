"""Folding a mergeable adapter's update into a quantized tensor (issue 23): W + dW stored without re-rounding W.

A mergeable adapter (lora.kind mergeable) has dW = s B A constant over each group of QK = 32 inputs of a row, the
block of Q4_0 .. Q8_0 and the sub-block of Q4_K. Where a block has an offset, dW adds to it and the codes and
scales stay as they are; where it has none, the type changes to one that has (same codes), or the block is
re-encoded. The policy, per stored type (`FOLD_TYPE`; measured in docs/merge.md, bench/fold_error.py):

| stored | folded as | how | error against base + dW (per element) | size |
|---|---|---|---|---|
| F32 | F32 | w + dW | f32 rounding | same |
| F16 | F16 | w + dW | f16 rounding of w + dW | same |
| Q4_1 / Q5_1 | same | m += dW, codes and d kept | f16 rounding of m + dW | same |
| Q4_0 | Q4_1 | m = -8 d + dW, codes and d kept | f16 rounding of m | 20/18 (+11 %) |
| Q5_0 | Q5_1 | m = -16 d + dW, codes and d kept | f16 rounding of m | 24/22 (+9 %) |
| Q4_K | Q4_1 | per sub-block d1 = d sc, m1 = -dmin m + dW, codes kept | f16 of d1 (x15) and m1 | 160/144 (+11 %) |
| Q8_0 | Q8_0 | w + dW re-encoded (8-bit codes) | half an 8-bit step | same |
| Q6_K | Q8_0 | w + dW re-encoded as Q8_0 | half an 8-bit step | 272/210 (+30 %) |

Q4_K's 6-bit sub-block mins cannot hold dW exactly (folding into them re-rounds every min to a 6-bit grid of the
new range; measured worse than the Q4_1 conversion); Q6_K and Q8_0 have no offset.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from model import quant as qc

FOLD_TYPE: dict[Q, Q] = {
    Q.F32: Q.F32,
    Q.F16: Q.F16,
    Q.Q4_0: Q.Q4_1,
    Q.Q4_1: Q.Q4_1,
    Q.Q5_0: Q.Q5_1,
    Q.Q5_1: Q.Q5_1,
    Q.Q4_K: Q.Q4_1,
    Q.Q8_0: Q.Q8_0,
    Q.Q6_K: Q.Q8_0,
}


class FoldError(ValueError):
    """The update is not constant over the quantization groups, or the stored type has no fold."""


def group_values(delta: np.ndarray, group: int = qc.QK) -> np.ndarray:
    """dW [rows, in] -> its value per group [rows, in / group]; FoldError unless dW is exactly group-constant."""
    rows, n_in = delta.shape
    if n_in % group:
        raise FoldError(f"{n_in} inputs are not whole groups of {group}")
    g = delta.reshape(rows, n_in // group, group)
    if not np.array_equal(g, np.broadcast_to(g[..., :1], g.shape)):
        raise FoldError(f"the update is not constant over groups of {group} inputs (not a mergeable adapter)")
    return g[..., 0]


def _f16(x: np.ndarray) -> np.ndarray:
    """f32/f64 [n] -> f16 bytes [n, 2] (round to nearest even); FoldError on overflow."""
    with np.errstate(over="ignore"):
        half = np.asarray(x, np.float32).astype(np.float16)
    if not np.isfinite(half).all():
        raise FoldError("a folded offset overflows f16")
    return np.ascontiguousarray(half.reshape(-1, 1)).view(np.uint8)


def _f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, off : off + 2]).view(np.float16).astype(np.float32).reshape(-1)


def _q4_k_as_q4_1(blocks: np.ndarray, dg: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [n, 144] + dW per sub-block [n * 8] -> Q4_1 blocks [n * 8, 20] with the same codes."""
    n = blocks.shape[0]
    d, dmin = _f16_at(blocks, 0)[:, None], _f16_at(blocks, 2)[:, None]
    sc, m = qc.Q4_K.scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(-1)
    offset = (-(dmin * m.astype(np.float32))).reshape(-1).astype(np.float64) + dg
    q = blocks[:, 16:].reshape((n, 4, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    q = (q & np.uint8(0x0F)).reshape((n * 8, 32))
    # d1 rounded to f16 moves every value by (d1' - d1) q: the offset takes back its mean over the block's codes
    d1 = _f16(scale).view(np.float16).astype(np.float64).reshape(-1)
    offset -= (d1 - scale) * q.mean(axis=1)
    return np.concatenate([_f16(scale), _f16(offset), _pack_nibbles(q)], axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] codes 0..15 -> Q4_0/Q4_1's 16 bytes (low nibble = elem j, high = elem j + 16)."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def fold(raw: np.ndarray, qtype: int, shape: tuple[int, int], delta: np.ndarray) -> tuple[Q, np.ndarray]:
    """(stored type, data for write_gguf) of W + dW: W stored as `qtype` in `raw` (uint8 rows, numpy `shape`
    [rows, in]), dW [rows, in] constant over each group of QK inputs. FoldError when it is not, or for a type
    without a fold (FOLD_TYPE lists them)."""
    qtype = Q(int(qtype))
    if qtype not in FOLD_TYPE:
        raise FoldError(f"no fold for {qtype.name} (folds: {', '.join(t.name for t in FOLD_TYPE)})")
    rows, n_in = shape
    delta = np.asarray(delta, np.float64)
    if delta.shape != (rows, n_in):
        raise FoldError(f"update shape {delta.shape} differs from the tensor's {shape}")
    dg = group_values(delta).reshape(-1)  # one value per 32 inputs, in block order
    out = FOLD_TYPE[qtype]
    base = qc.dequantize(raw, qtype, shape)
    if qtype in (Q.F32, Q.F16, Q.Q8_0, Q.Q6_K):  # no offset: the sum re-encoded (exact for F32 / F16 up to rounding)
        exact = (base.astype(np.float64) + delta).astype(np.float32)
        if out == Q.F32:
            return out, exact
        if out == Q.F16:
            return out, exact.astype(np.float16)
        return out, qc.quantize(exact, out)
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape((-1, qc.type_size(qtype)))
    if qtype in (Q.Q4_0, Q.Q5_0):  # x = d (q - c) = d q + (-c d): the offset of the _1 type, codes kept
        d = _f16_at(blocks, 0).astype(np.float64)
        centre = 8.0 if qtype == Q.Q4_0 else 16.0
        data = np.concatenate([blocks[:, :2], _f16(-centre * d + dg), blocks[:, 2:]], axis=-1)
    elif qtype in (Q.Q4_1, Q.Q5_1):
        m = _f16_at(blocks, 2).astype(np.float64)
        data = np.concatenate([blocks[:, :2], _f16(m + dg), blocks[:, 4:]], axis=-1)
    else:  # Q4_K -> Q4_1
        data = _q4_k_as_q4_1(blocks, dg)
    return out, data.reshape((rows, -1))
