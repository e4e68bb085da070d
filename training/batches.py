"""Token splits as dense arrays and the [B, T] KdBatches (with teacher top-k and the frozen-prefix cache) an engine
takes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from data.prefix import PrefixReader
from data.records import DataError
from data.tokens import read_token_table, read_tokenize_manifest, token_rows
from data.topk import TopkReader
from model.engine_spec import KdBatch


# ---- data -------------------------------------------------------------------------------------------------
@dataclass
class Split:
    """One token split as dense arrays. seq_len is the tokenize manifest's (the one source of a run's sequence
    length after tokenize: not cfg.data.seq_len, not the arrays' width, which read_split checks against it)."""

    seq_ids: np.ndarray  # [N]
    ids: np.ndarray  # [N, seq_len]
    mask: np.ndarray  # [N, seq_len]
    seq_len: int


def read_split(token_dir: Path, split: str) -> Split:
    """Split `split` of the token shards in token_dir, its seq_len from the tokenize manifest next to them."""
    seq_len = read_tokenize_manifest(token_dir).seq_len
    table = read_token_table(token_dir, split)
    ids = token_rows(table, "input_ids", seq_len, np.int64)
    mask = token_rows(table, "loss_mask", seq_len, np.uint8)
    if ids.shape[1] != seq_len:
        raise DataError(f"{token_dir}/{split}: rows of {ids.shape[1]} tokens, the tokenize manifest says {seq_len}")
    return Split(table.column("seq_id").to_numpy().astype(np.int64), ids, mask, seq_len)


def kd_batch(split: Split, rows: np.ndarray, batch: int, reader: TopkReader, k: int) -> KdBatch:
    """The dense [B, T] KdBatch of split rows `rows` (teacher tail included, no prefix; a sampled split's counts
    instead of the tail) for Engine.write_batch; missing rows (the last partial batch) are masked out. k: the
    teacher width of the split's shards (TeacherManifest.k_of)."""
    seq_len = split.seq_len
    ids = np.zeros((batch, seq_len), np.int64)
    mask = np.zeros((batch, seq_len), np.uint8)
    ids[: len(rows)] = split.ids[rows]
    mask[: len(rows)] = split.mask[rows]
    targets = np.zeros((batch, seq_len), np.int64)
    targets[:, :-1] = ids[:, 1:]
    tids = np.zeros((batch, seq_len, k), np.int64)
    tlp = np.zeros((batch, seq_len, k), np.float32)
    tail = np.zeros((batch, seq_len), np.float32)
    top = reader.read(split.seq_ids[rows].tolist(), masks=list(split.mask[rows])) if len(rows) else None
    sampled = reader.manifest.store == "sampled" if top is None else top.counts is not None
    counts = np.zeros((batch, seq_len, k), np.uint8) if sampled else None
    if top is not None:
        b_idx, t_idx = np.nonzero(mask)
        tids[b_idx, t_idx] = top.ids
        tlp[b_idx, t_idx] = top.logprobs
        tail[b_idx, t_idx] = top.tail
        if counts is not None:
            counts[b_idx, t_idx] = top.counts
    if sampled:  # no tail: the draws cover the whole vocabulary
        return KdBatch(ids, targets, mask, tids, tlp, None, teacher_counts=counts)
    return KdBatch(ids, targets, mask, tids, tlp, tail)


def batch_prefix(split: Split, rows: np.ndarray, batch: int, reader: PrefixReader) -> np.ndarray:
    """[batch, T, hidden] float32 for KdBatch.prefix: the cached input of the engine's start block
    for each row (missing rows of the last partial batch are zero; their mask is 0)."""
    m = reader.manifest
    out = np.zeros((batch, split.seq_len, m.hidden), np.float32)
    if len(rows):
        out[: len(rows)] = reader.read(split.seq_ids[rows].tolist())
    return out


@dataclass
class KdSource:
    """A token split with its teacher top-k shards and, when the run has one, its frozen-prefix cache: where the
    KdBatches of training and evaluation come from."""

    split: Split
    reader: TopkReader
    prefix: PrefixReader | None = None

    @classmethod
    def open(cls, split: Split, topk_dir: Path, prefix_dir: Path | None = None) -> KdSource:
        return cls(split, TopkReader(topk_dir), None if prefix_dir is None else PrefixReader(prefix_dir))

    @property
    def start_layer(self) -> int:
        """The block an engine fed from here starts its forward at: the prefix cache's, else 0."""
        return 0 if self.prefix is None else self.prefix.manifest.layer

    def batch(self, rows: np.ndarray, batch: int, k: int, tail: bool = True) -> KdBatch:
        """The KdBatch of split rows `rows` (kd_batch), without the teacher tail unless `tail`, with the cached
        prefix when there is a cache."""
        out = kd_batch(self.split, rows, batch, self.reader, k)
        prefix = None if self.prefix is None else batch_prefix(self.split, rows, batch, self.prefix)
        return replace(out, teacher_tail=out.teacher_tail if tail else None, prefix=prefix)  # sampled: tail None
