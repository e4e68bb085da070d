"""Arrow schemas of every table distillery writes, and a validator readers run before trusting a file.

Conventions shared by the token and top-k files:
- `seq_id` numbers the packed sequences of the whole dataset, unique across the train and eval splits.
- `loss_mask[t] = 1` means the prediction made at position t (of the token `input_ids[t + 1]`) is trained.
  The last position of a sequence therefore always has mask 0, and so does any position whose next token is
  padding or (with assistant-only loss) part of a prompt.
- A top-k shard has exactly one row per position with `loss_mask = 1`, sorted by (seq_id, pos), where `pos` is
  that position t: its logits, its mask, its teacher row, its target `input_ids[t + 1]` all share the index t.
  A shard holds whole sequences, from `seq_start` (inclusive) to `seq_end` (exclusive), of one split.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_KEY = b"distillery.schema"


class SchemaError(ValueError):
    """A table does not have the columns/types we wrote; the message names the file and the column."""


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={SCHEMA_KEY: name.encode()})


# One row per packed sequence (Arrow IPC files written through datasets).
TOKEN_SHARD_SCHEMA = _schema(
    "token_shard/1",
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),  # same length as input_ids, 0/1
        pa.field("doc_id", pa.int64(), nullable=False),  # the document the sequence starts in
        pa.field("seq_id", pa.int64(), nullable=False),
    ],
)


TOPK_SHARD, SAMPLED_SHARD = "topk_shard/1", "sampled_shard/1"  # the versioned shard schemas of teacher.store
SHARD_SCHEMAS = {"topk": TOPK_SHARD, "sampled": SAMPLED_SHARD}
TOPK_COMPACT_SHARD = "topk_shard/3"  # teacher.topk_format compact: top-k shards coded small (topk_compact_schema)


def topk_id_type(vocab_size: int) -> pa.DataType:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return pa.uint16() if vocab_size <= 65536 else pa.uint32()


def topk_rank_width(vocab_size: int) -> int:
    """Bytes per id rank gap of topk_shard/3: enough for any rank below vocab_size (a shard's dictionary of
    distinct ids is never larger)."""
    return max(1, (max(vocab_size - 1, 1).bit_length() + 7) // 8)


def _position_fields(k: int, vocab_size: int) -> list[pa.Field]:
    """The key columns of a top-k shard row (seq_id, pos), after checking k against the vocabulary."""
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in [1, vocab_size={vocab_size}], got {k}")
    return [pa.field("seq_id", pa.int64(), nullable=False), pa.field("pos", pa.int32(), nullable=False)]


def topk_schema(vocab_size: int, k: int) -> pa.Schema:
    """Top-k shard (Parquet, zstd): one row per trained position, position-major.

    ids / logprobs are fixed-size lists of length k (no offsets to store; Parquet round-trips them), sorted
    by descending logprob. logprobs are the teacher's log-probabilities over the full vocabulary at
    teacher.temperature (not renormalised over the k ids), in float16. tail is the teacher probability mass
    outside the k ids, summed in f32 over the other ids' probabilities (not 1 - sum of the rounded
    logprobs, which loses small tails).
    """
    return _schema(
        TOPK_SHARD,
        [
            *_position_fields(k, vocab_size),
            pa.field("ids", pa.list_(topk_id_type(vocab_size), k), nullable=False),
            pa.field("logprobs", pa.list_(pa.float16(), k), nullable=False),
            pa.field("tail", pa.float32(), nullable=False),
        ],
    )


def sampled_schema(vocab_size: int, n: int) -> pa.Schema:
    """Sampled shard (Parquet, zstd; model/sampled.py): one row per trained position, position-major.

    ids: the distinct ids among n draws from the teacher at teacher.temperature, ascending (uint16 when the
    vocabulary allows, else uint32); counts: how often each was drawn (uint8, summing to n); logp: the teacher's
    log-prob of each as a uint8 code, log p = -code / 16. Lists of 1 to n entries.
    """
    if not 1 <= n <= 255:
        raise ValueError(f"samples must be in [1, 255], got {n}")
    return _schema(
        SAMPLED_SHARD,
        [
            pa.field("seq_id", pa.int64(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),
            pa.field("ids", pa.list_(topk_id_type(vocab_size)), nullable=False),
            pa.field("counts", pa.list_(pa.uint8()), nullable=False),
            pa.field("logp", pa.list_(pa.uint8()), nullable=False),
        ],
    )


def topk_compact_schema(vocab_size: int, k: int) -> pa.Schema:
    """Compact top-k shard (topk_shard/3, Parquet zstd; data/topk.py writes and reads it, data/topk_codes.py holds
    the codes): the same k ids as topk_shard/1, the log-probs and the tail quantized.

    ids: per row, the k ids as their ranks in the shard's `dictionary` (the shard's distinct ids, most frequent
    first), ascending, as gaps (rank - previous rank - 1, the first from -1) of w = topk_rank_width(vocab_size)
    bytes, stored as byte planes (the k low bytes, then the k next, ...). codes: a byte per id in that order, d =
    top - log-prob in nats in steps of 1/8 below 2 nats (codes 0-15), 1/4 below 4 (16-23), 1/2 below 7 (24-29),
    then 1 (30-255; clipped at 232 nats). top: the row's top-1 log-prob as uint16 round(-256 top). tail: the tail
    mass as uint16 round(-256 ln tail), 65535 for 0. dictionary: a list in row 0 only (empty after).
    Stated error: |log-prob| within 1/512 nat at the top-1, plus half a step below it (1/16, 1/8, 1/4, 1/2 nat by
    segment); the tail within a relative exp(1/512) - 1 (0.2 %).
    """
    return _schema(
        TOPK_COMPACT_SHARD,
        [
            *_position_fields(k, vocab_size),
            pa.field("ids", pa.binary(k * topk_rank_width(vocab_size)), nullable=False),
            pa.field("codes", pa.binary(k), nullable=False),
            pa.field("top", pa.uint16(), nullable=False),
            pa.field("tail", pa.uint16(), nullable=False),
            pa.field("dictionary", pa.list_(topk_id_type(vocab_size)), nullable=False),
        ],
    )


def shard_schema(store: str, vocab_size: int, k: int, topk_format: str = "plain") -> pa.Schema:
    """The shard schema of teacher store `store` (topk: k ids per position; sampled: k = samples); top-k shards
    of teacher.topk_format compact are topk_shard/2."""
    if store not in SHARD_SCHEMAS:
        raise ValueError(f"teacher.store {store!r}: expected one of {', '.join(SHARD_SCHEMAS)}")
    if store == "topk" and topk_format == "compact":
        return topk_compact_schema(vocab_size, k)
    return topk_schema(vocab_size, k) if store == "topk" else sampled_schema(vocab_size, k)


# The top-k shard manifest (Parquet, next to the shards): one row per shard. A shard is complete only when
# its row says so, with the sha256 of the file as renamed into place; readers verify it.
TOPK_MANIFEST = _schema(
    "topk_manifest/1",
    [
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("file", pa.string(), nullable=False),  # name relative to the manifest's directory
        pa.field("split", pa.string(), nullable=False),  # "train" or "eval"
        pa.field("seq_start", pa.int64(), nullable=False),
        pa.field("seq_end", pa.int64(), nullable=False),  # exclusive
        pa.field("n_positions", pa.int64(), nullable=False),
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("complete", pa.bool_(), nullable=False),
    ],
)


def validate_table(table: pa.Table | pa.Schema, schema: pa.Schema, source: str) -> None:
    """Raise SchemaError naming `source` and the column when names, order or types differ from `schema`.

    Types compare by value (list item field names and nullability flags are ignored, since Parquet and
    datasets rewrite them); for a Table, a column the schema marks non-nullable must hold no nulls.
    """
    got = table if isinstance(table, pa.Schema) else table.schema
    want_names, got_names = schema.names, got.names
    missing = [n for n in want_names if n not in got_names]
    extra = [n for n in got_names if n not in want_names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing column(s) {missing}")
        if extra:
            parts.append(f"unexpected column(s) {extra}")
        raise SchemaError(f"{source}: {'; '.join(parts)} (expected columns {want_names})")
    if got_names != want_names:
        raise SchemaError(f"{source}: columns in order {got_names}, expected {want_names}")
    for want in schema:
        have = got.field(want.name)
        if not have.type.equals(want.type):
            raise SchemaError(f"{source}: column '{want.name}' has type {have.type}, expected {want.type}")
        nulls = table.column(want.name).null_count if isinstance(table, pa.Table) else 0
        if nulls and not want.nullable:
            raise SchemaError(f"{source}: column '{want.name}' has {nulls} null(s)")


def check_token_shard(table: pa.Table, source: str, seq_len: int | None = None) -> None:
    """validate_table against TOKEN_SHARD_SCHEMA, plus: loss_mask as long as input_ids, lengths <= seq_len."""
    validate_table(table, TOKEN_SHARD_SCHEMA, source)
    n_ids = pc.list_value_length(table.column("input_ids"))
    n_mask = pc.list_value_length(table.column("loss_mask"))
    bad = pc.not_equal(n_ids, n_mask)
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise SchemaError(
            f"{source}: column 'loss_mask' row {row} has length {n_mask[row]}, input_ids has {n_ids[row]}"
        )
    if seq_len is not None and len(table) and pc.max(n_ids).as_py() > seq_len:
        raise SchemaError(f"{source}: column 'input_ids' has a row longer than seq_len={seq_len}")
