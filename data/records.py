"""User datasets: local files (jsonl, json, parquet, text, a saved HF dataset) -> Documents, and the
dataset fingerprint that cache keys use. Errors name the file, record and field."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from model.chat import check_messages

if TYPE_CHECKING:
    pass

FORMATS = ("jsonl", "json", "parquet", "text", "hf_dir")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
log = logging.getLogger(__name__)
MAX_LINE_BYTES = 64 << 20  # a JSON Lines record longer than this is not a record (a file without newlines)


class DataError(ValueError):
    """Training data cannot be read or tokenized; the message names the file (and record, field)."""


@dataclass(frozen=True)
class Document:
    """One document: plain text or a chat (list of {role, content}); `source` + `locator` say where it is."""

    source: str
    locator: str
    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None

    @property
    def where(self) -> str:
        return f"{self.source} {self.locator}"

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


# ---------------------------------------------------------------------------------------------- loading


def _local_path(path: str | Path) -> Path:
    """The path, refusing anything that is not an existing local file or directory (never a hub name/URL)."""
    text = str(path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise DataError(f"{text}: remote URLs are not read; give a local file or directory")
    p = Path(text).expanduser()
    if not p.exists():
        raise DataError(
            f"{text}: no such local file or directory (data is read from disk; hub names are not downloaded)"
        )
    return p


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)


def resolve_format(path: str | Path, fmt: str = "auto") -> tuple[str, list[Path]]:
    """(format, files to read in order): a file, a directory of files of one format, or a saved HF dataset."""
    p = _local_path(path)
    if fmt not in ("auto", *FORMATS):
        raise DataError(f"{p}: unknown data format {fmt!r} (one of auto, {', '.join(FORMATS)})")
    if fmt == "hf_dir" or (fmt == "auto" and _is_hf_dir(p)):
        if not _is_hf_dir(p):
            raise DataError(f"{p}: format hf_dir needs a directory written by datasets' save_to_disk")
        return "hf_dir", [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.parts))
        files = [f for f in files if fmt != "auto" or f.suffix.lower() in _EXTENSIONS]
        if fmt != "auto":
            want = {e for e, name in _EXTENSIONS.items() if name == fmt}
            files = [f for f in files if f.suffix.lower() in want or fmt == "text"]
        if not files:
            raise DataError(f"{p}: directory holds no data files (known extensions: {', '.join(_EXTENSIONS)})")
        kinds = {_EXTENSIONS.get(f.suffix.lower(), fmt) for f in files} if fmt == "auto" else {fmt}
        if len(kinds) > 1:
            raise DataError(f"{p}: directory mixes formats {sorted(kinds)}; give one format per directory")
        return kinds.pop(), files
    if fmt == "auto":
        kind = _EXTENSIONS.get(p.suffix.lower())
        if kind is None:
            raise DataError(f"{p}: unknown extension {p.suffix!r}; set data.format ({', '.join(FORMATS)})")
        return kind, [p]
    return fmt, [p]


def read_records(kind: str, path: Path, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """(locator, record) of one file of a resolved format (resolve_format): jsonl, json, parquet or hf_dir
    records (parquet / hf_dir need one of `fields` as a column), or text paragraphs."""
    if kind == "jsonl":
        return _read_jsonl(path)
    if kind == "json":
        return _read_json(path)
    if kind == "parquet":
        return _read_parquet(path, fields)
    if kind == "hf_dir":
        return _read_hf_dir(path, fields)
    return _read_text(path)


def _decode(path: Path, data: bytes, lineno: int = 1) -> str:
    """`data` (the file `path` from line `lineno` on) as UTF-8 text; a UTF-8 byte-order mark at the start of the
    file is dropped (Windows tools write one); anything else that is not UTF-8 is a DataError naming the line."""
    if lineno == 1:
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise DataError(f"{path}: UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8")
        data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lineno + data.count(b"\n", 0, exc.start)
        raise DataError(
            f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}: {exc.reason}); save it as UTF-8"
        ) from None


def _lines(
    path: Path, hint: str = "JSON Lines holds one record per line (is this a JSON Lines file?)"
) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 file one line at a time, each at most MAX_LINE_BYTES (memory stays bounded
    on a huge file without newlines): DataError naming the file and line, then `hint`, otherwise."""
    with open(path, "rb") as fh:
        for lineno in itertools.count(1):
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{path} line {lineno}: longer than {MAX_LINE_BYTES / 2**20:g} MiB; {hint}")
            yield lineno, _decode(path, raw, lineno)


_TOO_DEEP = "JSON nested too deeply to read (arrays or objects inside each other beyond Python's recursion limit)"


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {lineno}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise DataError(f"{path} line {lineno}: {_TOO_DEEP}") from None
        yield f"line {lineno}", item


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(_decode(path, path.read_bytes()))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise DataError(f"{path}: {_TOO_DEEP}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must be a list of objects, got {type(data).__name__}")
    for i, item in enumerate(data):
        yield f"record {i}", item


def _columns_present(path: Path, columns: Sequence[str], fields: Sequence[str]) -> list[str]:
    present = [f for f in fields if f in columns]
    if not present:
        raise DataError(
            f"{path}: no field {' or '.join(repr(f) for f in fields)}; available fields: {', '.join(columns)} "
            "(set data.text_field or data.messages_field)"
        )
    return present


def _read_parquet(path: Path, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    present = _columns_present(path, pf.schema_arrow.names, fields)
    row = 0
    for batch in pf.iter_batches(columns=present, batch_size=1024):
        for item in batch.to_pylist():
            yield f"row {row}", item
            row += 1


def _read_hf_dir(path: Path, fields: Sequence[str]) -> Iterator[tuple[str, Any]]:
    import datasets  # only this format needs it (the stages that read finished shards import no `datasets`)

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable datasets directory ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if len(names) == 1 or "train" in names:
            loaded = loaded[names[0] if len(names) == 1 else "train"]
        else:
            raise DataError(f"{path}: DatasetDict without a 'train' split (splits: {', '.join(names)})")
    present = _columns_present(path, loaded.column_names, fields)
    table = loaded.select_columns(present).with_format("arrow")
    row = 0
    for start in range(0, len(table), 1024):
        for item in table[start : start + 1024].to_pylist():
            yield f"row {row}", item
            row += 1


_TEXT_HINT = "a text file is read line by line (is this a text file?)"


def _read_text(path: Path) -> Iterator[tuple[str, Any]]:
    """Paragraphs of a text file, read line by line as JSON Lines are (a line over MAX_LINE_BYTES or not UTF-8 is
    refused at that line, before the rest of the file is read)."""
    lines = _lines(path, _TEXT_HINT)
    text = "".join(line for _, line in lines)
    for i, para in enumerate(p.strip() for p in _PARAGRAPH.split(text)):
        if para:
            yield f"paragraph {i}", para


def _check_unicode(where: str, text: str, what: str) -> None:
    """A DataError naming the record when `text` holds a lone surrogate (JSON's "\\ud800"): not Unicode text,
    which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = f"\\u{ord(text[exc.start]):04x}"
        why = f"holds an unpaired surrogate {code} (character {exc.start}), not Unicode text"
        raise DataError(f"{where}: {what} {why}") from None


def _to_document(source: Path, locator: str, item: Any, text_field: str, messages_field: str) -> Document:
    where = f"{source} {locator}"
    if isinstance(item, str):
        _check_unicode(where, item, "the text")
        return Document(str(source), locator, text=item)
    if not isinstance(item, Mapping):
        raise DataError(f"{where}: a record must be an object with '{text_field}' or '{messages_field}'")
    messages = item.get(messages_field)
    if messages is not None:
        try:
            check_messages(messages)
        except ValueError as exc:
            raise DataError(f"{where}: field '{messages_field}': {exc} (data.messages_field)") from None
        for i, message in enumerate(messages):
            _check_unicode(where, message["content"], f"field '{messages_field}': messages[{i}].content")
        return Document(str(source), locator, messages=tuple(dict(m) for m in messages))
    if text_field not in item:
        raise DataError(
            f"{where}: no field '{messages_field}' or '{text_field}'; available fields: "
            f"{', '.join(map(str, item)) or '(none)'} (set data.text_field or data.messages_field)"
        )
    text = item[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field '{text_field}' must be a string, got {type(text).__name__} (data.text_field)")
    _check_unicode(where, text, f"field '{text_field}'")
    return Document(str(source), locator, text=text)


def load_records(
    path: str | Path,
    fmt: str = "auto",
    text_field: str = "text",
    messages_field: str = "messages",
    max_documents: int | None = None,
) -> list[Document]:
    """Read documents from a local file or directory (never the hub).

    Formats: jsonl (one object per line), json (a list of objects), parquet, hf_dir (datasets.save_to_disk
    output; a DatasetDict's 'train' split), text (UTF-8; one document per blank-line-separated paragraph,
    so a file without blank lines is one document). A record is a chat when it has `messages_field`
    (a list of {role, content}), else text from `text_field`. `max_documents` keeps the first N.
    """
    kind, files = resolve_format(path, fmt)
    fields = (messages_field, text_field)
    docs: list[Document] = []
    for file in files:
        for locator, item in read_records(kind, file, fields):
            if max_documents is not None and len(docs) >= max_documents:
                return docs
            docs.append(_to_document(file, locator, item, text_field, messages_field))
    if not docs:
        raise DataError(f"{path}: empty dataset (no documents found)")
    _check_blank(path, docs)
    return docs


def check_first_document(
    path: str | Path, fmt: str = "auto", text_field: str = "text", messages_field: str = "messages"
) -> None:
    """Read a dataset's first document as load_records reads it, so the mistakes it shows (a wrong field name or
    format, UTF-16, a file that is not Parquet, an empty file) are refused before any stage starts. Only what the
    first record needs is read: the first line of JSON Lines, a Parquet file's first batch, the first line of a
    text file; a .json list and a datasets directory are read whole, so they are left to load_records."""
    kind, files = resolve_format(path, fmt)  # at least one file, or a DataError
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"{path}: empty dataset (no documents found)")
    if kind == "text":
        next(_lines(files[0], _TEXT_HINT), None)
    elif kind in ("jsonl", "parquet"):
        for locator, item in read_records(kind, files[0], (messages_field, text_field)):
            _to_document(files[0], locator, item, text_field, messages_field)
            break


def _is_blank(doc: Document) -> bool:
    """No text but whitespace: an empty text, or a chat whose every message content is blank."""
    if doc.messages is not None:
        return all(not str(m.get("content") or "").strip() for m in doc.messages)
    return not (doc.text or "").strip()


def _check_blank(path: str | Path, docs: list[Document]) -> None:
    """Refuse a dataset of blank documents only; warn about some (they would train the model on whitespace)."""
    blank = [d for d in docs if _is_blank(d)]
    if len(blank) == len(docs):
        raise DataError(f"{path}: every document ({len(docs)}, e.g. {docs[0].locator}) is empty or whitespace only")
    if blank:
        log.warning(
            "%s: %d of %d documents are empty or whitespace only (first: %s); they train on whitespace",
            path,
            len(blank),
            len(docs),
            blank[0].locator,
        )


def dataset_fingerprint(
    path: str | Path,
    fmt: str = "auto",
    text_field: str = "text",
    messages_field: str = "messages",
    max_documents: int | None = None,
    **extra: Any,
) -> str:
    """sha256 over the data's bytes (every file read, by relative name) and the fields that select records.

    For cache keys: a change to any data file or to these fields changes it; `extra` adds other JSON values.
    """
    kind, files = resolve_format(path, fmt)
    root = Path(path)
    if kind == "hf_dir":
        files = sorted(f for f in root.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    header = {
        "format": kind,
        "text_field": text_field,
        "messages_field": messages_field,
        "max_documents": max_documents,
        **extra,
    }
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for f in files:
        name = f.relative_to(root).as_posix() if root.is_dir() else f.name
        digest.update(f"\n{name}\n{f.stat().st_size}\n".encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()
