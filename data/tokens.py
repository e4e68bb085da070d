"""Training data: local files -> documents -> packed token windows -> Arrow token shards (through `datasets`).

Sequence convention (every consumer relies on it): a row holds exactly `seq_len` input ids. The prediction
at position t is of `input_ids[t + 1]`, and `loss_mask[t] = 1` when that prediction is trained (as in
schemas/files.py); the last position (and any position whose next token is padding or prompt) has mask 0.
So a consumer runs the model on `input_ids` and takes logits[t] against target `input_ids[t + 1]` where
`loss_mask[t] = 1`; nothing else is needed. Packed windows overlap by one token (stride seq_len - 1), so
every next-token transition of the stream is trained exactly once. Rows are padded (pad id, else EOS) to
seq_len; padding is never a target.

Documents are separated by EOS (trained after text, not after a chat, whose mask is assistant-only). The
held-out split is chosen per document, before packing, by a hash of (seed, document index): no document is
in both splits, and the same seed gives byte-identical shards. Or the held-out documents come from a source of
their own (data.eval_path): then the split is by source.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.atomic import atomic_write_bytes
from model.chat import tokenize_chat
from schemas.files import TOKEN_SHARD_SCHEMA, check_token_shard
from schemas.manifests import FileRef, TokenizeManifest, TokenSplit

if TYPE_CHECKING:
    import datasets

    from model.tokenizer import GGUFTokenizer
    from schemas.config import DataSection

from data.records import DataError, Document, dataset_fingerprint, load_records

SPLITS = ("train", "eval")
MANIFEST_NAME = "tokenize_manifest.json"

# ---------------------------------------------------------------------------------------------- tokenizing


def _document_tokens(
    doc: Document, tokenizer: GGUFTokenizer, text_ids: list[int] | None, assistant_only: bool, eos: int
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target flags) of a document followed by EOS; flag 1 = predicting this token is trained."""
    if doc.messages is not None:
        if not tokenizer.chat_template:
            raise DataError(f"{doc.where}: chat record, but the GGUF has no tokenizer.chat_template")
        try:
            ids, mask = tokenize_chat(tokenizer, tokenizer.chat_template, doc.messages)
        except ValueError as exc:
            raise DataError(f"{doc.where}: {exc}") from None
        flags = mask if assistant_only else [1] * len(ids)
        sep_flag = 0
    else:
        assert text_ids is not None
        ids = text_ids
        flags = [1] * len(ids)
        if ids and tokenizer.add_bos and ids[0] == tokenizer.bos_id:
            flags[0] = 0  # never train predicting BOS
        sep_flag = 1
    if ids and ids[-1] != eos:
        ids = [*ids, eos]
        flags = [*flags, sep_flag]
    return np.asarray(ids, dtype=np.int32), np.asarray(flags, dtype=np.uint8)


def _split_hash(seed: int, doc_id: int) -> float:
    """A uniform number in [0, 1) from (seed, document index)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big") / 2.0**64


def split_documents(usable: Sequence[bool], eval_fraction: float, seed: int) -> np.ndarray:
    """Boolean per document: held out for evaluation. Document d is held out when hash(seed, d) < fraction.

    When at least two documents have trainable tokens, at least one of them lands in each split (the one with
    the smallest hash moves to eval, or the one with the largest back to train).
    """
    u = np.array([_split_hash(seed, d) for d in range(len(usable))])
    ok = np.asarray(usable, dtype=bool)
    is_eval = (u < eval_fraction) & ok
    if ok.sum() >= 2:
        if not is_eval.any():
            is_eval[np.flatnonzero(ok)[np.argmin(u[ok])]] = True
        if is_eval.sum() == ok.sum():
            is_eval[np.flatnonzero(ok)[np.argmax(u[ok])]] = False
    return is_eval


def _windows(
    docs: list[tuple[int, np.ndarray, np.ndarray]], seq_len: int, pad: int, pack: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids [W, L], loss_mask [W, L], doc_id [W]) of a split, rows without targets dropped."""
    if not docs:
        return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.uint8), np.zeros(0, np.int64)
    if pack:
        stream = np.concatenate([ids for _, ids, _ in docs])
        flags = np.concatenate([f for _, _, f in docs])
        owner = np.concatenate([np.full(len(ids), d, np.int64) for d, ids, _ in docs])
        n = len(stream)
        stride = seq_len - 1
        starts = np.arange(0, max(n - 1, 0), stride, dtype=np.int64)
        idx = starts[:, None] + np.arange(seq_len)[None, :]
        ids = np.where(idx < n, stream[np.minimum(idx, n - 1)], pad).astype(np.int32)
        nxt = idx + 1
        mask = np.where(nxt < n, flags[np.minimum(nxt, n - 1)], 0).astype(np.uint8)
        mask[:, -1] = 0
        doc_id = owner[starts]
    else:
        ids = np.full((len(docs), seq_len), pad, np.int32)
        mask = np.zeros((len(docs), seq_len), np.uint8)
        for row, (_, d_ids, d_flags) in enumerate(docs):
            m = min(len(d_ids), seq_len)
            ids[row, :m] = d_ids[:m]
            mask[row, : m - 1] = d_flags[1:m]
        doc_id = np.array([d for d, _, _ in docs], np.int64)
    keep = mask.any(axis=1)
    return ids[keep], mask[keep], doc_id[keep]


def _list_array(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    rows, width = matrix.shape
    if rows * width >= 2**31:
        raise DataError(f"split too large for one token table ({rows * width} tokens); use max_documents")
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width, pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), value_type))


def _to_dataset(
    ids: np.ndarray, mask: np.ndarray, doc_id: np.ndarray, first_seq: int, split: str, n_docs: int
) -> datasets.Dataset:
    seq_id = np.arange(first_seq, first_seq + len(ids), dtype=np.int64)
    table = pa.Table.from_arrays(
        [
            _list_array(ids, pa.int32()),
            _list_array(mask, pa.uint8()),
            pa.array(doc_id, pa.int64()),
            pa.array(seq_id, pa.int64()),
        ],
        schema=TOKEN_SHARD_SCHEMA,
    )
    digest = hashlib.sha256(split.encode())
    for arr in (ids, mask, doc_id, seq_id):
        digest.update(np.ascontiguousarray(arr).tobytes())
    import datasets

    info = datasets.DatasetInfo(description=json.dumps({"split": split, "n_documents": n_docs}))
    return datasets.Dataset(table, info=info, fingerprint=digest.hexdigest()[:16])


def tokenize_dataset(
    records: Sequence[Document],
    tokenizer: GGUFTokenizer,
    seq_len: int,
    eval_fraction: float,
    seed: int,
    pack: bool = True,
    assistant_only: bool = True,
    eval_records: Sequence[Document] | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) datasets of TOKEN_SHARD_SCHEMA rows, each exactly seq_len ids (see the module docstring).

    pack=True: documents end to end (EOS between), windows of seq_len overlapping by one token. pack=False:
    one document per row, truncated to seq_len. seq_id counts train rows first, then eval rows; doc_id is
    the index in `records` (then `eval_records`, numbered after them) of the document the row starts in.
    `info.description` holds the split's document count as JSON. eval_records: the held-out documents, given
    apart (a split by source, e.g. other books); then every document of `records` trains and eval_fraction is
    not used.
    """
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if not records:
        raise DataError("no documents to tokenize")
    n_train_docs = len(records)
    if eval_records is not None:
        if not eval_records:
            raise DataError("no held-out documents to tokenize (data.eval_path)")
        records = [*records, *eval_records]
    eos = tokenizer.eos_id
    if eos is None:
        raise DataError("the GGUF has no tokenizer.ggml.eos_token_id: cannot separate documents")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos

    plain = [i for i, d in enumerate(records) if d.messages is None]
    encoded = tokenizer.hf.encode_batch([records[i].text for i in plain], add_special_tokens=False)
    text_ids: dict[int, list[int]] = {}
    for i, enc in zip(plain, encoded, strict=True):
        ids = enc.ids
        if ids and tokenizer.add_bos and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
        text_ids[i] = ids
    empty = (np.zeros(0, np.int32), np.zeros(0, np.uint8))
    tokens = [
        _document_tokens(doc, tokenizer, text_ids.get(i), assistant_only, eos) if doc.text or doc.messages else empty
        for i, doc in enumerate(records)
    ]
    usable = [bool(f[1:].any()) for _, f in tokens]
    if not any(usable):
        raise DataError(
            f"{records[0].source}: no trainable tokens after tokenization ({len(records)} documents; "
            "empty texts, or chats without assistant turns?)"
        )
    if eval_records is None:
        is_eval = split_documents(usable, eval_fraction, seed)
    else:
        is_eval = np.arange(len(records)) >= n_train_docs
    out = []
    first_seq = 0
    for split, held_out in (("train", False), ("eval", True)):
        docs = [(d, *tokens[d]) for d in range(len(records)) if usable[d] and is_eval[d] == held_out]
        ids, mask, doc_id = _windows(docs, seq_len, pad, pack)
        out.append(_to_dataset(ids, mask, doc_id, first_seq, split, len(docs)))
        first_seq += len(ids)
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ shards


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move `tmp` to `final`, replacing a previous `final` (rename it away, then remove it)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_split(table: pa.Table, source: str, seq_len: int, vocab_size: int | None = None) -> None:
    """check_token_shard, plus: every row exactly seq_len ids, ids inside the vocabulary."""
    check_token_shard(table, source, seq_len)
    if not len(table):
        return
    ids = table.column("input_ids").combine_chunks()
    lengths = ids.value_lengths().to_numpy()
    if (lengths != seq_len).any():
        row = int(np.flatnonzero(lengths != seq_len)[0])
        raise DataError(f"{source}: column 'input_ids' row {row} has {lengths[row]} ids, expected {seq_len}")
    values = ids.flatten().to_numpy()
    if vocab_size is not None and len(values) and (values.min() < 0 or values.max() >= vocab_size):
        raise DataError(f"{source}: column 'input_ids' has ids outside [0, {vocab_size})")


def _split_documents_count(ds: datasets.Dataset) -> int:
    try:
        return int(json.loads(ds.info.description or "{}").get("n_documents", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0


def write_token_shards(
    train: datasets.Dataset,
    eval: datasets.Dataset,
    out_dir: str | Path,
    *,
    dataset_fingerprint: str,
    tokenizer_sha256: str,
    vocab_size: int,
    seq_len: int,
    root: str | Path | None = None,
) -> TokenizeManifest:
    """Write both splits as Arrow (datasets.save_to_disk into a temp dir, then renamed into place).

    Layout: out_dir/train/, out_dir/eval/, and out_dir/tokenize_manifest.json (written last). The manifest's
    shard FileRefs are the .arrow data files, stored relative to `root` when given.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, TokenSplit] = {}
    for name, ds in (("train", train), ("eval", eval)):
        if getattr(ds, "_indices", None) is not None:  # a select()/shuffle() view: write the rows it shows
            ds = ds.flatten_indices()
        _check_split(ds.data.table, f"{name} split", seq_len, vocab_size)
        tmp = out / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with _quiet_datasets():
            ds.save_to_disk(str(tmp))
        _fsync_tree(tmp)
        final = out / name
        _replace_dir(tmp, final)
        files = sorted(final.glob("*.arrow"))
        base = None if root is None else Path(root).resolve()
        refs = tuple(FileRef.of(f.resolve() if base else f, base) for f in files)
        mask = ds.data.table.column("loss_mask").combine_chunks()
        n_positions = int(mask.flatten().to_numpy(zero_copy_only=False).sum(dtype=np.int64)) if len(ds) else 0
        splits[name] = TokenSplit(
            shards=refs, n_documents=_split_documents_count(ds), n_sequences=len(ds), n_positions=n_positions
        )
    manifest = TokenizeManifest(
        dataset_fingerprint=dataset_fingerprint,
        tokenizer_sha256=tokenizer_sha256,
        vocab_size=vocab_size,
        seq_len=seq_len,
        train=splits["train"],
        eval=splits["eval"],
    )
    atomic_write_bytes(out / MANIFEST_NAME, manifest.model_dump_json(indent=2).encode())
    return manifest


def read_tokenize_manifest(out_dir: str | Path) -> TokenizeManifest:
    """The TokenizeManifest that write_token_shards left in out_dir."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: token manifest missing (tokenize did not finish)")
    try:
        return TokenizeManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"{path}: invalid token manifest ({exc})") from None


def _split_dir(out_dir: str | Path, split: str, manifest: TokenizeManifest | None, root: str | Path | None) -> Path:
    """The directory of one split written by write_token_shards, its .arrow files checked against the manifest's
    sha256s when one is given."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    path = Path(out_dir) / split
    if not path.is_dir():
        raise DataError(f"{path}: token split missing")
    if manifest is not None:
        want = getattr(manifest, split).shards
        have = sorted(path.glob("*.arrow"))
        if len(have) != len(want):
            raise DataError(f"{path}: {len(have)} .arrow files, manifest lists {len(want)}")
        for ref in want:
            try:
                ref.verify(root)
            except ValueError as exc:
                raise DataError(f"{path}: {exc}") from None
    return path


def _check_table(table: pa.Table, path: Path, manifest: TokenizeManifest | None) -> None:
    if manifest is not None:
        _check_split(table, str(path), manifest.seq_len, manifest.vocab_size)
    else:
        check_token_shard(table, str(path))


def read_token_split(
    out_dir: str | Path,
    split: str,
    manifest: TokenizeManifest | None = None,
    root: str | Path | None = None,
) -> datasets.Dataset:
    """Load one split written by write_token_shards and check it against TOKEN_SHARD_SCHEMA.

    With a manifest: the .arrow files must match its sha256s (and rows its seq_len).
    """
    import datasets

    path = _split_dir(out_dir, split, manifest, root)
    with _quiet_datasets():
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise DataError(f"{path}: not a readable token split ({exc})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path}: expected one dataset, found a DatasetDict")
    _check_table(ds.data.table, path, manifest)
    return ds


def read_token_table(
    out_dir: str | Path,
    split: str,
    manifest: TokenizeManifest | None = None,
    root: str | Path | None = None,
) -> pa.Table:
    """read_token_split's rows as one Arrow table, read with pyarrow alone (the .arrow files are Arrow IPC
    streams, in file order): what the stages read (no `datasets` on a GPU or Ray worker); read_token_split is
    the same split as a `datasets.Dataset`."""
    path = _split_dir(out_dir, split, manifest, root)
    files = sorted(path.glob("*.arrow"))
    if not files:
        raise DataError(f"{path}: not a readable token split (no .arrow files)")
    try:
        tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
        table = pa.concat_tables(tables)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{path}: not a readable token split ({exc})") from None
    _check_table(table, path, manifest)
    return table


def token_rows(table: pa.Table, name: str, seq_len: int, dtype: type) -> np.ndarray:
    """A list column of equal-length rows as a [rows, length] array ([0, seq_len] without rows)."""
    if not table.num_rows:
        return np.zeros((0, seq_len), dtype)
    col = table.column(name).combine_chunks()
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    if (lengths != lengths[0]).any():
        raise DataError(f"token split: column {name!r} has rows of {sorted(set(lengths.tolist()))} tokens")
    return np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype).reshape(len(lengths), int(lengths[0]))


def tokenize_from_config(
    data: DataSection, tokenizer: GGUFTokenizer, tokenizer_sha256: str, out_dir: str | Path, seed: int = 0
) -> TokenizeManifest:
    """load_records -> tokenize_dataset -> write_token_shards with the settings of a DataSection."""
    docs = load_records(data.path, data.format, data.text_field, data.messages_field, data.max_documents)
    train, held_out = tokenize_dataset(
        docs, tokenizer, data.seq_len, data.eval_fraction, seed, data.pack, data.assistant_only
    )
    fingerprint = dataset_fingerprint(data.path, data.format, data.text_field, data.messages_field, data.max_documents)
    return write_token_shards(
        train,
        held_out,
        out_dir,
        dataset_fingerprint=fingerprint,
        tokenizer_sha256=tokenizer_sha256,
        vocab_size=tokenizer.vocab_size,
        seq_len=data.seq_len,
    )
