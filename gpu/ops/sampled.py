"""The sampled teacher store on the GPU (model/sampled.py's draw): per row, n draws by stratified inverse CDF over
the vocabulary in id order, streamed over vocabulary chunks of the LM head's logits in two passes, then encoded as
the numpy teacher stores them (distinct ids ascending, counts, uint8 log-prob codes).

Pass 1 (sample_stats, per piece of <= PIECE columns): the piece's max m_c and sum s_c of exp(z / tau - m_c).
Between (sample_thresholds, per row): m = max m_c, the piece bases Base[c] (running sum of exp(m_c - m) s_c in
piece order, Base[last] = S) and the thresholds t_i = (i + U_i) / n * S from Philox4x32-10 (philox.wgsl).
Pass 2 (sample_draw, per piece): the logits again; each threshold lies in exactly one piece's [Base[c],
Base[c + 1]) and is located there by the piece's segment scan (sample_piece.wgsl). Last (sample_encode, per
row): distinct ids, counts, codes. Fixed orders throughout (no atomics): a row's bytes depend on its logits, its
key and the vocabulary chunking only, not on the batch around it. The CDF is f32 (the reference's float64), so a
draw differs from model/sampled.py's only where a threshold lies within rounding of a CDF boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.ops.common import grid, need, pack
from gpu.ops.head import Int8Head, logits_chunk
from gpu.registry import pipeline

PIECE = 4096  # columns per workgroup of the passes (sample_piece.wgsl: 16 KiB of workgroup memory)
MAX_SAMPLES = 255  # counts are stored in a byte


def n_pieces(vocab: int, chunk: int) -> int:
    """Pieces per row when the logits come `chunk` columns at a time and each chunk is cut into PIECE columns."""
    return sum(-(-min(chunk, vocab - c0) // PIECE) for c0 in range(0, vocab, chunk))


@dataclass(frozen=True)
class SampledState:
    """Buffers of the draw for n_rows rows of n draws over n_pieces pieces; the outputs ids / counts / codes are
    u32 [rows, n] (sample_encode.wgsl), keys (pos, seq_id lo, seq_id hi, 0) u32 [rows, 4] written per call."""

    n_rows: int
    n: int
    n_pieces: int
    keys: Any
    stats: Any
    base: Any
    row_stat: Any
    thresholds: Any
    draws: Any
    zv: Any
    ids: Any
    counts: Any
    codes: Any

    @classmethod
    def build(cls, dev: Device, n_rows: int, n: int, vocab: int, chunk: int) -> SampledState:
        if not 1 <= n <= MAX_SAMPLES:
            raise ValueError(f"sampled store: {n} draws per position must be in 1..{MAX_SAMPLES}")
        np_ = n_pieces(vocab, chunk)
        r = n_rows

        def buf(words: int, label: str) -> Any:
            return dev.buffer(4 * words, label=f"sampled {label}")

        return cls(r, n, np_, buf(4 * r, "keys"), buf(2 * r * np_, "piece stats"), buf(r * (np_ + 1), "bases"),
                   buf(2 * r, "row stats"), buf(r * n, "thresholds"), buf(r * n, "draws"), buf(r * n, "draw logits"),
                   buf(r * n, "ids"), buf(r * n, "counts"), buf(r * n, "codes"))  # fmt: skip

    def write_keys(self, dev: Device, seq_ids: np.ndarray, pos: np.ndarray) -> None:
        """The rows' generator counters: seq_ids and positions [rows] (integers < 2^64 / 2^32)."""
        seq = np.asarray(seq_ids, np.uint64).reshape(self.n_rows)
        keys = np.zeros((self.n_rows, 4), np.uint32)
        keys[:, 0] = np.asarray(pos, np.uint64).reshape(self.n_rows)
        keys[:, 1] = seq & np.uint64(0xFFFFFFFF)
        keys[:, 2] = seq >> np.uint64(32)
        dev.write(self.keys, keys.reshape(-1))


def hidden_sampled(
    dev: Device,
    h: Any,
    w: Any,
    st: SampledState,
    hidden: int,
    vocab: int,
    tau: float,
    seed: int,
    *,
    logits_scratch: Any,
    chunk: int,
    h16: Any = None,
    i8: Int8Head | None = None,
) -> None:
    """The sampled rows of logits = h [rows, H] . W^T at temperature tau into st.ids / counts / codes: two passes
    over the vocabulary `chunk` columns at a time (the LM head's GEMM runs twice), keyed by st.keys and seed."""
    t, n = st.n_rows, st.n
    chunk = min(chunk, vocab)
    if st.n_pieces != n_pieces(vocab, chunk):
        raise ValueError("sampled state built for another vocabulary chunking")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed {seed} must be in [0, 2^64)")
    need(logits_scratch, t * chunk, "sampled logits chunk")
    inv_tau = 1.0 / tau
    if i8 is not None:
        i8.quantize(dev, h)

    def sweep(name: str, bindings: list[Any]) -> None:
        pipe, piece = pipeline(dev, name), 0
        for c0 in range(0, vocab, chunk):
            nv = min(chunk, vocab - c0)
            logits_chunk(dev, h, w, logits_scratch, t, hidden, c0, nv, chunk, h16, i8)
            for p0 in range(0, nv, PIECE):
                params = pack(t, min(PIECE, nv - p0), chunk, p0, c0 + p0, piece, st.n_pieces, n, inv_tau, 0, 0, 0)
                dev.dispatch(pipe, [params, logits_scratch, *bindings], grid(t, 1))
                piece += 1

    sweep("sample_stats", [st.stats])
    params = pack(t, st.n_pieces, n, seed & 0xFFFFFFFF, seed >> 32, 0, 0, 0)
    dev.dispatch(pipeline(dev, "sample_thresholds"), [params, st.stats, st.keys, st.base, st.row_stat,
                 st.thresholds], grid(t, 64))  # fmt: skip
    sweep("sample_draw", [st.stats, st.base, st.thresholds, st.row_stat, st.draws, st.zv])
    dev.dispatch(pipeline(dev, "sample_encode"), [pack(t, n, 0, 0), st.draws, st.zv, st.row_stat, st.ids, st.counts,
                 st.codes], grid(t, 64))  # fmt: skip


def philox_words(dev: Device, counters: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Philox4x32-10 on the GPU (philox.wgsl) of counters u32 [R, 4] under keys u32 [R, 2]: words u32 [R, 4]."""
    counters = np.ascontiguousarray(counters, np.uint32).reshape(-1, 4)
    keys = np.ascontiguousarray(keys, np.uint32).reshape(-1, 2)
    r = len(counters)
    out = dev.buffer(16 * r, label="philox words")
    with dev.step():
        dev.dispatch(pipeline(dev, "philox_words"), [pack(r, 0, 0, 0), dev.upload(counters), dev.upload(keys), out],
                     grid(r, 64))  # fmt: skip
    return dev.read(out, np.uint32, (r, 4))
