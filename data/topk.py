"""Teacher shards: Parquet (zstd) files of schemas.files.topk_schema (teacher.store topk) or sampled_schema
(teacher.store sampled, model/sampled.py), a Parquet manifest, resumable. One reader and writer for both: rows
carry counts exactly when they are sampled.

Layout of a top-k directory:
  topk-<split>-<shard:05d>.parquet   one row per trained position (loss_mask = 1), sorted by (seq_id, pos)
  topk_manifest.parquet              TOPK_MANIFEST rows, one per planned shard; the schema metadata holds the
                                     header (teacher sha256, k, temperature, vocab size, token-shards hash)
A shard is complete only when its manifest row says so with the sha256 of the file renamed into place. Files
are written to a temp name, fsynced, then renamed; the manifest is rewritten the same way (under a lock)
after every shard. A crash leaves at worst a temp file and a row still marked incomplete: it is redone.

Workflow: plan_shards -> open_manifest -> for each of missing_shards: compute_shard_rows (a batched teacher:
many sequences per call) -> write_shard -> record_shard. The trainer reads with TopkReader / read_topk.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import topk_codes as C
from data.atomic import atomic_file
from model.sampled import logp_code, logp_value
from schemas.files import (
    SHARD_SCHEMAS,
    TOPK_MANIFEST,
    SchemaError,
    sampled_schema,
    shard_schema,
    topk_compact_schema,
    topk_rank_width,
    topk_schema,
    validate_table,
)
from schemas.manifests import ManifestError, ShardRecord, TeacherManifest, sha256_file

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MANIFEST_NAME = "topk_manifest.parquet"
PENDING_SHA256 = "0" * 64  # sha256 field of a planned, not yet written shard
ZSTD_LEVEL = 7
F16_MIN = float(np.finfo(np.float16).min)
_HEADER_KEYS = (
    "teacher_sha256",
    "k",
    "temperature",
    "vocab_size",
    "token_shards_hash",
    "store",
    "shard_schema",
    "seed",
    "eval_k",
    "topk_format",
    "engine",
)
# manifests written before these fields
_HEADER_DEFAULTS = {
    "store": "topk",
    "shard_schema": SHARD_SCHEMAS["topk"],
    "seed": "0",
    "eval_k": "0",
    "topk_format": "plain",
    "engine": "",
}
_manifest_lock = threading.Lock()

# A teacher: ids [N, T] and loss mask [N, T] of N sequences -> (ids [N, T, k], logprobs [N, T, k], tail [N, T]) at
# every position; rows whose mask is 0 are not stored and may hold anything.
TeacherFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


class ShardError(ManifestError):
    """A top-k shard is missing, corrupt, or does not match its manifest row; the message names the file."""


class VocabMismatchError(ValueError):
    """Teacher and student tokenizers differ: top-k ids of one would be read as other tokens by the other."""


@dataclass(frozen=True)
class TopkRows:
    """Rows of a teacher shard (or a batch read back): one per trained position, sorted by (seq_id, pos).

    Sampled rows (counts given): ids the distinct drawn ids ascending, padded to k = samples with id 0, count 0;
    logprobs their stored log-probs (-code / 16; codes uint8 from compute_shard_rows); tail zeros (not stored)."""

    seq_id: np.ndarray  # [N] int64
    pos: np.ndarray  # [N] int32
    ids: np.ndarray  # [N, k] (uint16/uint32 on disk; int64 from compute_shard_rows, int32 from readers)
    logprobs: np.ndarray  # [N, k] float32 (float16 on disk; sampled: uint8 codes on disk and from the teacher)
    tail: np.ndarray  # [N] float32
    counts: np.ndarray | None = None  # [N, k] uint8: the sampled store's counts; None for top-k

    def __len__(self) -> int:
        return len(self.seq_id)


def _empty_rows(k: int, sampled: bool = False) -> TopkRows:
    z = np.zeros
    counts = z((0, k), np.uint8) if sampled else None
    return TopkRows(
        z(0, np.int64), z(0, np.int32), z((0, k), np.int32), z((0, k), np.float32), z(0, np.float32), counts
    )


def shard_file(split: str, shard: int) -> str:
    return f"topk-{split}-{shard:05d}.parquet"


# ---------------------------------------------------------------------------------------------- planning


def _mask_counts(token_split: pa.Table) -> np.ndarray:
    """Trained positions per row of a token table (sum of loss_mask)."""
    mask = token_split.column("loss_mask").combine_chunks()
    if not len(mask):
        return np.zeros(0, np.int64)
    offsets = mask.offsets.to_numpy()
    cumsum = np.concatenate([[0], np.cumsum(mask.values.to_numpy(zero_copy_only=False), dtype=np.int64)])
    return cumsum[offsets[1:]] - cumsum[offsets[:-1]]


def _table(token_split: object) -> pa.Table:
    """A pyarrow table from a datasets.Dataset or a pyarrow table."""
    data = getattr(token_split, "data", token_split)
    return getattr(data, "table", data)


def _seq_ids(table: pa.Table, source: str) -> np.ndarray:
    seq = table.column("seq_id").to_numpy()
    if len(seq) and not (np.diff(seq) == 1).all():
        raise ShardError(f"{source}: seq_id must be consecutive and ascending to plan shards")
    return seq


def plan_shards(token_split: object, shard_positions: int, split: str, first_shard: int = 0) -> list[ShardRecord]:
    """Shard boundaries over a token split (datasets.Dataset or Arrow table): whole sequences, in order.

    A shard closes once it holds >= shard_positions trained positions, so shards hold about that many; the
    plan depends only on the split's loss masks. Records come back pending (complete=False, sha256 zeros).
    """
    if shard_positions < 1:
        raise ValueError(f"shard_positions must be >= 1, got {shard_positions}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    table = _table(token_split)
    counts = _mask_counts(table)
    seq = _seq_ids(table, f"{split} split")
    plans: list[ShardRecord] = []
    start, acc = 0, 0
    for row, n in enumerate(counts):
        acc += int(n)
        if acc >= shard_positions or row == len(counts) - 1:
            shard = first_shard + len(plans)
            plans.append(
                ShardRecord(
                    shard=shard,
                    file=shard_file(split, shard),
                    split=split,
                    seq_start=int(seq[start]),
                    seq_end=int(seq[row]) + 1,
                    n_positions=acc,
                    sha256=PENDING_SHA256,
                    complete=False,
                )
            )
            start, acc = row + 1, 0
    return plans


def plan_all(train: object, eval: object, shard_positions: int) -> list[ShardRecord]:
    """plan_shards over both splits, numbered train first."""
    plans = plan_shards(train, shard_positions, "train")
    return plans + plan_shards(eval, shard_positions, "eval", first_shard=len(plans))


def compute_shard_rows(
    token_split: object,
    plan: ShardRecord,
    teacher: TeacherFn,
    rows_per_call: int = 4096,
    on_sequences: Callable[[int], None] | None = None,
) -> TopkRows:
    """Run `teacher` on the shard's sequences, about rows_per_call positions per call (sequences of one length
    together), and keep the rows of positions with loss_mask = 1. on_sequences(n) after each call. A teacher whose
    `store` is "sampled" is called with the sequences' seq_ids too and returns (ids, logp codes, counts)."""
    sampled = getattr(teacher, "store", "topk") == "sampled"
    table = _table(token_split)
    seq = _seq_ids(table, f"{plan.split} split")
    if not len(seq) or plan.seq_start < seq[0] or plan.seq_end > seq[-1] + 1:
        raise ShardError(f"{plan.file}: seq range [{plan.seq_start}, {plan.seq_end}) is not in the token split")
    lo = plan.seq_start - int(seq[0])
    part = table.slice(lo, plan.seq_end - plan.seq_start)
    seq_ids = np.asarray(part.column("seq_id").to_numpy(), np.int64)
    ids_rows = part.column("input_ids").to_pylist()
    mask_rows = [np.asarray(m, np.uint8) for m in part.column("loss_mask").to_pylist()]
    trained = [i for i, m in enumerate(mask_rows) if m.any()]
    skipped = len(seq_ids) - len(trained)
    if skipped and on_sequences is not None:
        on_sequences(skipped)
    results: dict[int, tuple[np.ndarray, ...]] = {}
    by_length: dict[int, list[int]] = {}
    for i in trained:
        by_length.setdefault(len(ids_rows[i]), []).append(i)
    for t, rows in by_length.items():
        per_call = max(1, rows_per_call // max(t, 1))
        for s in range(0, len(rows), per_call):
            group = rows[s : s + per_call]
            ids = np.asarray([ids_rows[i] for i in group], np.int64).reshape(len(group), t)
            mask = np.stack([mask_rows[i] for i in group])
            if sampled:
                t_ids, t_lp, t_counts = (np.asarray(a) for a in teacher(ids, mask, seq_ids[group]))
            else:
                t_ids, t_lp, t_tail = teacher(ids, mask)
                t_ids, t_lp, t_tail = np.asarray(t_ids), np.asarray(t_lp, np.float32), np.asarray(t_tail, np.float32)
            for j, i in enumerate(group):
                positions = np.flatnonzero(mask_rows[i])
                results[i] = (
                    np.full(len(positions), seq_ids[i], np.int64),
                    positions.astype(np.int32),
                    t_ids[j, positions].astype(np.int64),
                    t_lp[j, positions],
                    np.zeros(len(positions), np.float32) if sampled else t_tail[j, positions],
                    *((t_counts[j, positions],) if sampled else ()),
                )
            if on_sequences is not None:
                on_sequences(len(group))
    if not results:  # write_shard reshapes the empty [0, 0] arrays to [0, k]
        return _empty_rows(0, sampled)
    cols = [np.concatenate(c) for c in zip(*(results[i] for i in trained), strict=True)]
    return TopkRows(*cols)


# ---------------------------------------------------------------------------------------------- writing


def _write_parquet_atomic(table: pa.Table, path: Path, **options: object) -> str:
    """Write `table` to `path` atomically (data.atomic); return its sha256 (of the bytes written)."""
    with atomic_file(path) as fh:
        pq.write_table(table, fh, **options)
        fh.flush()
        digest = sha256_file(Path(fh.name))
    return digest


def _sorted_keys(rows: TopkRows, source: str) -> None:
    key = np.asarray(rows.seq_id, np.int64) * (1 << 32) + np.asarray(rows.pos, np.int64)
    if len(key) > 1 and not (np.diff(key) > 0).all():
        raise ValueError(f"{source}: rows must be sorted by (seq_id, pos) without duplicates")


def _sampled_table(rows: TopkRows, vocab_size: int, n: int, source: str) -> pa.Table:
    """The sampled_schema table of sampled rows (ids/codes/counts [N, n], the distinct ids first, then padding)."""
    schema = sampled_schema(vocab_size, n)
    count = len(rows.seq_id)
    ids, counts = np.asarray(rows.ids).reshape(count, -1), np.asarray(rows.counts).reshape(count, -1)
    codes = np.asarray(rows.logprobs)
    if codes.dtype != np.uint8:  # log-probs given as values: encode them
        codes = logp_code(codes)
    codes = codes.reshape(count, -1)
    if ids.shape != (count, n) or counts.shape != (count, n) or codes.shape != (count, n) or len(rows.pos) != count:
        raise ValueError(f"{source}: expected sampled ids/logp/counts [{count}, {n}], got {ids.shape}, {counts.shape}")
    live = counts > 0
    width = live.sum(axis=1)
    if count and (
        (counts.sum(axis=1) != n).any() or (live != (np.arange(n)[None, :] < width[:, None])).any() or width.min() < 1
    ):
        raise ValueError(f"{source}: column 'counts' must sum to {n} per row, its non-zero entries first")
    kept = ids[live]
    if count and (kept.min() < 0 or kept.max() >= vocab_size):
        raise ValueError(f"{source}: column 'ids' holds ids outside [0, {vocab_size})")
    if count and n > 1 and ((np.diff(ids, axis=1) <= 0) & live[:, 1:]).any():
        raise ValueError(f"{source}: column 'ids' must be distinct and ascending within a row")
    _sorted_keys(rows, source)
    offsets = pa.array(np.concatenate([[0], np.cumsum(width)]).astype(np.int32))
    id_type = schema.field("ids").type.value_type

    def lists(values: np.ndarray, kind: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(values, kind))

    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(rows.seq_id, np.int64), pa.int64()),
            pa.array(np.asarray(rows.pos, np.int32), pa.int32()),
            lists(kept.astype(id_type.to_pandas_dtype()), id_type),
            lists(counts[live], pa.uint8()),
            lists(codes[live], pa.uint8()),
        ],
        schema=schema,
    )


def _rows_table(rows: TopkRows, vocab_size: int, k: int, source: str) -> pa.Table:
    if rows.counts is not None:
        return _sampled_table(rows, vocab_size, k, source)
    schema = topk_schema(vocab_size, k)
    n = len(rows.seq_id)
    ids = np.asarray(rows.ids)
    lp = np.asarray(rows.logprobs, dtype=np.float32)
    tail = np.asarray(rows.tail, dtype=np.float32)
    if n == 0:
        ids, lp = ids.reshape(0, k), lp.reshape(0, k)
    if ids.shape != (n, k) or lp.shape != (n, k) or tail.shape != (n,) or len(rows.pos) != n:
        raise ValueError(
            f"{source}: expected ids/logprobs [{n}, {k}] and pos/tail [{n}], got {ids.shape}, {lp.shape}, "
            f"{np.shape(rows.pos)}, {tail.shape}"
        )
    if n and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{source}: column 'ids' holds ids outside [0, {vocab_size})")
    if not (np.isfinite(lp).all() and np.isfinite(tail).all()) or (lp > 1e-4).any():
        raise ValueError(f"{source}: column 'logprobs' or 'tail' is not finite, or a logprob is > 0")
    if k > 1 and n and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
        raise ValueError(f"{source}: column 'ids' repeats an id within a row")
    _sorted_keys(rows, source)
    id_type = schema.field("ids").type.value_type
    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(rows.seq_id, np.int64), pa.int64()),
            pa.array(np.asarray(rows.pos, np.int32), pa.int32()),
            pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1).astype(id_type.to_pandas_dtype())), k),
            pa.FixedSizeListArray.from_arrays(
                pa.array(np.clip(lp, F16_MIN, 0.0).astype(np.float16).reshape(-1), pa.float16()), k
            ),
            pa.array(np.clip(tail, 0.0, 1.0), pa.float32()),
        ],
        schema=schema,
    )


# pyarrow.parquet.write_table options of a shard: every writer uses them, so equal rows give equal bytes.
SHARD_OPTIONS: dict[str, object] = {
    "compression": "zstd",
    "compression_level": ZSTD_LEVEL,
    "use_dictionary": ["ids.list.element"],
    "use_byte_stream_split": ["logprobs.list.element", "tail"],
}
SAMPLED_OPTIONS: dict[str, object] = {"compression": "zstd", "compression_level": ZSTD_LEVEL, "use_dictionary": False}
# topk_shard/3 (teacher.topk_format compact): byte columns, zstd at its strongest (a shard is written once); its
# codes and their stated error: data/topk_codes.py
COMPACT_OPTIONS: dict[str, object] = {"compression": "zstd", "compression_level": 19, "use_dictionary": False}


def shard_options(topk_format: str = "plain", sampled: bool = False) -> dict[str, object]:
    """pyarrow.parquet.write_table options of a shard: sampled, top-k plain (/1) or compact (/2)."""
    if sampled:
        return SAMPLED_OPTIONS
    return COMPACT_OPTIONS if topk_format == "compact" else SHARD_OPTIONS


def _compact_table(rows: TopkRows, vocab_size: int, k: int, source: str) -> pa.Table:
    """The topk_shard/3 table of top-k rows (checked as topk_shard/1's: _rows_table)."""
    plain = _rows_table(rows, vocab_size, k, source)
    n = len(plain)
    ids = np.asarray(rows.ids, np.int64).reshape(n, k)
    lp = np.clip(np.asarray(rows.logprobs, np.float32).reshape(n, k), F16_MIN, 0.0).astype(np.float64)
    uniq, counts = np.unique(ids, return_counts=True)
    dictionary = uniq[np.lexsort((uniq, -counts))]  # most frequent first, then by id
    rank_of_uniq = np.empty(len(uniq), np.int64)
    rank_of_uniq[np.searchsorted(uniq, dictionary)] = np.arange(len(uniq))
    ranks = rank_of_uniq[np.searchsorted(uniq, ids)]
    order = np.argsort(ranks, axis=1, kind="stable")
    ranks, lp = np.take_along_axis(ranks, order, 1), np.take_along_axis(lp, order, 1)
    top = C.top_codes(lp.max(axis=1, initial=-np.inf) if n else np.zeros(0))
    codes = C.logp_codes(C.top_values(top)[:, None] - lp)
    width = topk_rank_width(vocab_size)
    planes = C.gap_planes(np.diff(ranks, axis=1, prepend=-1) - 1, width)
    id_type = plain.schema.field("ids").type.value_type
    dict_offsets = np.full(n + 1, len(dictionary), np.int32)
    dict_offsets[0] = 0

    def fixed(data: np.ndarray, width: int) -> pa.Array:
        return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(data.tobytes())])

    return pa.Table.from_arrays(
        [
            plain.column("seq_id"),
            plain.column("pos"),
            fixed(planes, width * k),
            fixed(codes, k),
            pa.array(top, pa.uint16()),
            pa.array(C.tail_codes(plain.column("tail").to_numpy()), pa.uint16()),
            pa.ListArray.from_arrays(
                pa.array(dict_offsets), pa.array(dictionary.astype(id_type.to_pandas_dtype()), id_type)
            )
            if n
            else pa.array([], pa.list_(id_type)),
        ],
        schema=topk_compact_schema(vocab_size, k),
    )


def _fixed_bytes(table: pa.Table, name: str, n: int) -> np.ndarray:
    """Column `name` (fixed_size_binary) of `table` as uint8 [n, width]."""
    col = table.column(name).combine_chunks()
    width = col.type.byte_width
    data = np.frombuffer(col.buffers()[1], np.uint8) if n else np.zeros(0, np.uint8)
    return data[col.offset * width : (col.offset + n) * width].reshape(n, width)


def _compact_rows(table: pa.Table, k: int, path: Path) -> TopkRows:
    """Decoded topk_shard/3 rows, as topk_shard/1 stores them: ids by descending log-prob (ties by dictionary rank),
    log-probs float32 and the tail within the stated error (data/topk_codes.py)."""
    n = len(table)
    dictionary = table.column("dictionary").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    planes = _fixed_bytes(table, "ids", n)
    ranks = np.cumsum(C.plane_gaps(planes, planes.shape[1] // k) + 1, axis=1) - 1
    if n and ranks.max() >= len(dictionary):
        raise ShardError(f"corrupt shard {path}: ids past the shard's dictionary of {len(dictionary)}")
    top = C.top_values(table.column("top").to_numpy())
    lp = (top[:, None] - C.logp_deltas(_fixed_bytes(table, "codes", n))).astype(np.float32)
    order = np.argsort(-lp, axis=1, kind="stable")
    return TopkRows(
        seq_id=table.column("seq_id").to_numpy(),
        pos=table.column("pos").to_numpy(),
        ids=np.take_along_axis(dictionary.astype(np.int64)[ranks], order, 1).astype(np.int32),
        logprobs=np.take_along_axis(lp, order, 1),
        tail=C.tail_values(table.column("tail").to_numpy()),
    )


def shard_table(
    plan: ShardRecord, rows: TopkRows, vocab_size: int, k: int, source: str, topk_format: str = "plain"
) -> pa.Table:
    """The Arrow table of planned shard `plan` (write it with shard_options(topk_format, sampled): SHARD_OPTIONS for
    plain top-k); raises ValueError naming `source` unless rows are the plan's trained positions, sorted, in range
    and finite. Top-k rows with topk_format compact: topk_shard/3."""
    compact = topk_format == "compact" and rows.counts is None
    table = (_compact_table if compact else _rows_table)(rows, vocab_size, k, source)
    if len(table) != plan.n_positions:
        raise ValueError(f"{source}: {len(table)} rows, the plan counted {plan.n_positions} trained positions")
    seq = np.asarray(rows.seq_id)
    if len(seq) and (seq.min() < plan.seq_start or seq.max() >= plan.seq_end):
        raise ValueError(f"{source}: seq_id outside the shard's range [{plan.seq_start}, {plan.seq_end})")
    return table


def write_shard(
    out_dir: str | Path, plan: ShardRecord, rows: TopkRows, vocab_size: int, k: int, topk_format: str = "plain"
) -> ShardRecord:
    """Write the rows of planned shard `plan` to out_dir/plan.file atomically; return its complete record.

    Rows must be the trained positions of sequences [seq_start, seq_end), sorted by (seq_id, pos), as many as
    the plan counted. Logprobs are stored as float16 (clamped to the float16 range), tail as float32; sampled rows
    (counts given, k = samples) as sampled_schema; top-k rows with topk_format compact as topk_shard/3.
    """
    path = Path(out_dir) / plan.file
    table = shard_table(plan, rows, vocab_size, k, str(path), topk_format)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by an interrupted writer of this shard
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    digest = _write_parquet_atomic(table, path, **shard_options(topk_format, rows.counts is not None))
    return plan.model_copy(update={"sha256": digest, "complete": True})


# ---------------------------------------------------------------------------------------------- manifest


def _manifest_table(manifest: TeacherManifest) -> pa.Table:
    rows = [s.model_dump() for s in manifest.shards]
    table = pa.Table.from_pylist(rows, schema=TOPK_MANIFEST) if rows else TOPK_MANIFEST.empty_table()
    meta = dict(TOPK_MANIFEST.metadata or {})
    for key in _HEADER_KEYS:
        meta[f"distillery.{key}".encode()] = str(getattr(manifest, key)).encode()
    return table.replace_schema_metadata(meta)


def read_manifest(out_dir: str | Path) -> TeacherManifest | None:
    """The manifest of a top-k directory, or None when there is none yet."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ShardError(f"{path}: unreadable top-k manifest ({exc})") from None
    validate_table(table, TOPK_MANIFEST, str(path))
    meta = table.schema.metadata or {}
    try:
        header = {
            key: meta[f"distillery.{key}".encode()].decode()
            if key not in _HEADER_DEFAULTS
            else meta.get(f"distillery.{key}".encode(), _HEADER_DEFAULTS[key].encode()).decode()
            for key in _HEADER_KEYS
        }
    except KeyError as exc:
        raise ShardError(f"{path}: top-k manifest lacks header field {exc.args[0]!r}") from None
    try:
        return TeacherManifest(
            teacher_sha256=header["teacher_sha256"],
            store=header["store"],
            shard_schema=header["shard_schema"],
            seed=int(header["seed"]),
            eval_k=int(header["eval_k"]),
            topk_format=header["topk_format"],
            engine=header["engine"],
            k=int(header["k"]),
            temperature=float(header["temperature"]),
            vocab_size=int(header["vocab_size"]),
            token_shards_hash=header["token_shards_hash"],
            shards=tuple(ShardRecord(**row) for row in table.to_pylist()),
        )
    except ValueError as exc:
        raise ShardError(f"{path}: invalid top-k manifest ({exc})") from None


def write_manifest(out_dir: str | Path, manifest: TeacherManifest) -> None:
    """Atomically replace out_dir/topk_manifest.parquet."""
    _write_parquet_atomic(_manifest_table(manifest), Path(out_dir) / MANIFEST_NAME, compression="zstd")


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """Serialise manifest read-modify-write across threads and processes."""
    with _manifest_lock, open(out_dir / ".topk_manifest.lock", "a+b") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _pending(rec: ShardRecord) -> ShardRecord:
    return rec.model_copy(update={"sha256": PENDING_SHA256, "complete": False})


def _same_plan(a: Sequence[ShardRecord], b: Sequence[ShardRecord]) -> bool:
    def key(s: ShardRecord) -> tuple:
        return (s.shard, s.file, s.split, s.seq_start, s.seq_end, s.n_positions)

    return [key(s) for s in a] == [key(s) for s in b]


def open_manifest(out_dir: str | Path, planned: TeacherManifest) -> TeacherManifest:
    """Start or resume a top-k directory for `planned` (header + pending shard plan).

    An existing manifest with the same header and plan is kept (its complete rows count, after
    verification by missing_shards); anything else (other inputs, another plan, an unreadable manifest) is
    replaced by `planned`, every shard pending.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        try:
            current = read_manifest(out)
        except (ShardError, SchemaError) as exc:
            log.warning("%s; starting over", exc)
            current = None
        if current is not None:
            same_header = all(getattr(current, k) == getattr(planned, k) for k in _HEADER_KEYS)
            if same_header and _same_plan(current.shards, planned.shards):
                return current
            log.warning("%s: top-k manifest is for other inputs or another plan; starting over", out)
        fresh = planned.model_copy(update={"shards": tuple(_pending(s) for s in planned.shards)})
        write_manifest(out, fresh)
        return fresh


def record_shard(out_dir: str | Path, record: ShardRecord) -> TeacherManifest:
    """Mark `record` (from write_shard) in the manifest, atomically; return the updated manifest."""
    out = Path(out_dir)
    with _locked(out):
        current = read_manifest(out)
        if current is None:
            raise ShardError(f"{out / MANIFEST_NAME}: no top-k manifest (call open_manifest first)")
        rows = list(current.shards)
        at = [i for i, s in enumerate(rows) if s.shard == record.shard]
        if not at or not _same_plan([rows[at[0]]], [record]):
            raise ShardError(f"{out / record.file}: shard {record.shard} is not in the manifest's plan")
        rows[at[0]] = record
        updated = current.model_copy(update={"shards": tuple(rows)})
        write_manifest(out, updated)
        return updated


# ---------------------------------------------------------------------------------------------- verifying


def verify_shard(
    path: str | Path, record: ShardRecord, vocab_size: int, k: int, store: str = "topk", topk_format: str = "plain"
) -> None:
    """Raise ShardError ("corrupt shard <path>: ...") unless sha256, schema (of teacher store `store`, top-k shards
    coded as `topk_format`) and row count match the record."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"missing shard {path}: file not found")
    if not record.complete:
        raise ShardError(f"incomplete shard {path}: its manifest row is not marked complete")
    digest = sha256_file(path)
    if digest != record.sha256:
        raise ShardError(f"corrupt shard {path}: sha256 {digest}, manifest says {record.sha256}")
    try:
        pf = pq.ParquetFile(path)
        validate_table(pf.schema_arrow, shard_schema(store, vocab_size, k, topk_format), str(path))
    except (pa.ArrowException, OSError, SchemaError) as exc:
        raise ShardError(f"corrupt shard {path}: {exc}") from None
    if pf.metadata.num_rows != record.n_positions:
        raise ShardError(f"corrupt shard {path}: {pf.metadata.num_rows} rows, manifest says {record.n_positions}")


def missing_shards(manifest: TeacherManifest, out_dir: str | Path) -> list[ShardRecord]:
    """Shards to (re)compute: not marked complete, absent, or failing verify_shard (logged as corrupt).

    Returned as pending plan records, in shard order. Leftover temp files of interrupted writes are ignored.
    """
    out = Path(out_dir)
    todo = []
    for rec in manifest.shards:
        if rec.complete:
            try:
                k, store = manifest.k_of(rec.split), manifest.store_of(rec.split)
                verify_shard(out / rec.file, rec, manifest.vocab_size, k, store, manifest.format_of(rec.split))
                continue
            except ShardError as exc:
                log.warning("%s; it will be recomputed", exc)
        todo.append(_pending(rec))
    return todo


# ---------------------------------------------------------------------------------------------- reading


class TopkReader:
    """Top-k rows by seq_id for the trainer; verifies each shard once, keeps decoded shards in an LRU."""

    def __init__(self, out_dir: str | Path, cache_shards: int = 8, verify: bool = True) -> None:
        self.out_dir = Path(out_dir)
        manifest = read_manifest(self.out_dir)
        if manifest is None:
            raise ShardError(f"{self.out_dir / MANIFEST_NAME}: no top-k manifest")
        if not manifest.complete:
            pending = [s.file for s in manifest.shards if not s.complete]
            raise ShardError(f"{self.out_dir}: top-k shards not complete: {', '.join(pending[:5])}")
        self.manifest = manifest
        self.cache_shards = max(1, cache_shards)
        self.verify = verify
        self._cache: OrderedDict[int, TopkRows] = OrderedDict()
        shards = sorted(manifest.shards, key=lambda s: s.seq_start)
        self._starts = np.array([s.seq_start for s in shards], np.int64)
        self._shards = shards

    def _shard_of(self, seq_id: int) -> ShardRecord:
        i = int(np.searchsorted(self._starts, seq_id, side="right")) - 1
        if i < 0 or not self._shards[i].seq_start <= seq_id < self._shards[i].seq_end:
            raise ShardError(f"{self.out_dir}: no top-k shard holds seq_id {seq_id}")
        return self._shards[i]

    def _load(self, rec: ShardRecord) -> TopkRows:
        if rec.shard in self._cache:
            self._cache.move_to_end(rec.shard)
            return self._cache[rec.shard]
        path = self.out_dir / rec.file
        k, vocab, store = self.manifest.k_of(rec.split), self.manifest.vocab_size, self.manifest.store_of(rec.split)
        fmt = self.manifest.format_of(rec.split)
        if self.verify:
            verify_shard(path, rec, vocab, k, store, fmt)
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise ShardError(f"corrupt shard {path}: {exc}") from None
        validate_table(table, shard_schema(store, vocab, k, fmt), str(path))
        if fmt == "compact":
            rows = _compact_rows(table, k, path)
        else:
            rows = _sampled_rows(table, k, path) if store == "sampled" else _topk_rows(table, k)
        if len(rows) and (rows.seq_id.min() < rec.seq_start or rows.seq_id.max() >= rec.seq_end):
            raise ShardError(f"corrupt shard {path}: seq_id outside [{rec.seq_start}, {rec.seq_end})")
        self._cache[rec.shard] = rows
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return rows

    def read(self, seq_ids: Sequence[int], masks: Sequence[np.ndarray] | None = None) -> TopkRows:
        """Rows of the given sequences, in the order given, each by ascending pos: sequences stored alike (not both
        splits of a sampled store, whose eval split is top-k: manifest.store_of).

        With `masks` (each sequence's loss_mask), checks the rows sit exactly at its trained positions, so
        row j of the result belongs to the j-th position with mask 1 of the batch in row-major order.
        """
        parts = []
        splits = set()
        for j, s in enumerate(seq_ids):
            rec = self._shard_of(int(s))
            splits.add(rec.split)
            rows = self._load(rec)
            lo, hi = np.searchsorted(rows.seq_id, [int(s), int(s) + 1])
            cut = slice(lo, hi)
            counts = None if rows.counts is None else rows.counts[cut]
            part = TopkRows(rows.seq_id[cut], rows.pos[cut], rows.ids[cut], rows.logprobs[cut], rows.tail[cut], counts)
            if masks is not None:
                want = np.flatnonzero(np.asarray(masks[j]))
                if not np.array_equal(part.pos, want):
                    raise ShardError(
                        f"{self.out_dir}: top-k rows of seq_id {s} are at {part.pos[:8].tolist()}.., "
                        f"its loss_mask trains {want[:8].tolist()}.. (token and top-k shards disagree)"
                    )
            parts.append(part)
        stores = {(self.manifest.store_of(split), self.manifest.k_of(split)) for split in splits or ("train",)}
        if len(stores) > 1:
            raise ShardError(
                f"{self.out_dir}: one read takes sequences of one store, got the splits {sorted(splits)} "
                f"stored as {sorted(stores)}"
            )
        store, k = stores.pop()
        sampled = store == "sampled"
        if not parts:
            return _empty_rows(k, sampled)
        return TopkRows(
            seq_id=np.concatenate([p.seq_id for p in parts]),
            pos=np.concatenate([p.pos for p in parts]),
            ids=np.concatenate([p.ids for p in parts]),
            logprobs=np.concatenate([p.logprobs for p in parts]).astype(np.float32),
            tail=np.concatenate([p.tail for p in parts]).astype(np.float32),
            counts=np.concatenate([p.counts for p in parts]) if sampled else None,
        )


def _topk_rows(table: pa.Table, k: int) -> TopkRows:
    n = len(table)

    def matrix(name: str) -> np.ndarray:
        col = table.column(name).combine_chunks()
        return col.flatten().to_numpy(zero_copy_only=False).reshape(n, k)

    return TopkRows(
        seq_id=table.column("seq_id").to_numpy(),
        pos=table.column("pos").to_numpy(),
        ids=matrix("ids").astype(np.int32),
        logprobs=matrix("logprobs"),  # float16 while cached; float32 on the way out
        tail=table.column("tail").to_numpy(),
    )


def _sampled_rows(table: pa.Table, n: int, path: Path) -> TopkRows:
    """Sampled rows padded to n columns (id 0, count 0, log-prob 0 after each row's distinct ids)."""
    count = len(table)
    cols = {name: table.column(name).combine_chunks() for name in ("ids", "counts", "logp")}
    width = np.diff(cols["ids"].offsets.to_numpy())
    if any(not np.array_equal(np.diff(c.offsets.to_numpy()), width) for c in cols.values()) or (
        count and (width.min() < 1 or width.max() > n)
    ):
        raise ShardError(f"corrupt shard {path}: sampled lists of unequal or out-of-range lengths")
    live = np.arange(n)[None, :] < width[:, None]

    def padded(name: str, dtype: type) -> np.ndarray:
        out = np.zeros((count, n), dtype)
        out[live] = cols[name].flatten().to_numpy(zero_copy_only=False)
        return out

    counts = padded("counts", np.uint8)
    if count and (counts.sum(axis=1, dtype=np.int64) != n).any():
        raise ShardError(f"corrupt shard {path}: sampled counts do not sum to {n}")
    return TopkRows(
        seq_id=table.column("seq_id").to_numpy(),
        pos=table.column("pos").to_numpy(),
        ids=padded("ids", np.int32),
        logprobs=np.where(live, logp_value(padded("logp", np.uint8)), 0).astype(np.float16),
        tail=np.zeros(count, np.float32),
        counts=counts,
    )


def read_topk(out_dir: str | Path, seq_ids: Sequence[int], masks: Sequence[np.ndarray] | None = None) -> TopkRows:
    """TopkReader(out_dir).read(seq_ids, masks): ids int32 [N, k], logprobs f32 [N, k], tail f32 [N]."""
    return TopkReader(out_dir).read(seq_ids, masks)


def bytes_per_position(manifest: TeacherManifest, out_dir: str | Path, split: str | None = None) -> float:
    """Disk bytes of the complete shards (of split `split`; None: both) per stored position."""
    done = [s for s in manifest.shards if s.complete and split in (None, s.split)]
    n = sum(s.n_positions for s in done)
    return sum((Path(out_dir) / s.file).stat().st_size for s in done) / max(1, n)


# ---------------------------------------------------------------------------------------------- vocabularies


def check_vocab(
    teacher_tokens: Sequence[str], student_tokens: Sequence[str], teacher_path: object, student_path: object
) -> None:
    """Raise VocabMismatchError unless teacher and student have the same token strings in the same order."""
    n_t, n_s = len(teacher_tokens), len(student_tokens)
    first = next((i for i, (a, b) in enumerate(zip(teacher_tokens, student_tokens, strict=False)) if a != b), None)
    if first is None and n_t == n_s:
        return
    if first is None:
        first = min(n_t, n_s)
    t_tok = repr(teacher_tokens[first]) if first < n_t else "(none)"
    s_tok = repr(student_tokens[first]) if first < n_s else "(none)"
    raise VocabMismatchError(
        f"teacher and student vocabularies differ: teacher {teacher_path} has {n_t} tokens, student "
        f"{student_path} has {n_s}; first difference at index {first}: teacher {t_tok}, student {s_tok}. "
        "Distillation needs the same tokenizer."
    )
