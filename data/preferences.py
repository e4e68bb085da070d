"""Preference pairs: (prompt, chosen, rejected) records -> chat-rendered token rows with response-only masks.

Records come from a local JSONL / JSON / Parquet file or a datasets save_to_disk folder (data.records' readers).
A prompt is a string (one user turn) or a chat ([{role, content}, ...]); chosen and rejected are strings (one
assistant turn) or lists of assistant-side messages. Each response is rendered after the prompt with the GGUF's
chat template (model/chat.py) and only the response's tokens (with the end-of-turn token that closes it) are
trained: mask[t] = 1 where ids[t + 1] is such a token, the convention of the token shards. Rows longer than
seq_len are cut at seq_len; a pair whose response then has no token left is dropped (counted).

Stored as one Parquet file per split (schemas: PAIR_SCHEMA below), written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.files import atomic_file
from data.records import DataError, read_records, resolve_format
from model.chat import check_messages, tokenize_chat
from model.tokenizer import GGUFTokenizer

PAIR_SCHEMA = pa.schema(
    [
        ("pair_id", pa.int64()),
        ("chosen_ids", pa.list_(pa.int32())),
        ("chosen_mask", pa.list_(pa.uint8())),
        ("rejected_ids", pa.list_(pa.int32())),
        ("rejected_mask", pa.list_(pa.uint8())),
    ]
)


@dataclass(frozen=True)
class PreferencePair:
    """One record: where it came from, the prompt chat and the two responses as assistant-side messages."""

    source: str
    locator: str
    prompt: tuple[dict[str, str], ...]
    chosen: tuple[dict[str, str], ...]
    rejected: tuple[dict[str, str], ...]

    @property
    def where(self) -> str:
        return f"{self.source} {self.locator}"


@dataclass(frozen=True)
class Fields:
    """Record fields of the prompt and the two responses (config preference.*_field)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


def _messages(value: Any, role: str, where: str, field: str, config: str) -> tuple[dict[str, str], ...]:
    """A string as one `role` turn, or a checked chat."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field '{field}' is empty ({config})")
        return ({"role": role, "content": value},)
    try:
        check_messages(value)
    except ValueError as exc:
        raise DataError(f"{where}: field '{field}': {exc} ({config})") from None
    if not value:
        raise DataError(f"{where}: field '{field}' is an empty chat ({config})")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def to_pair(source: Path, locator: str, item: Any, fields: Fields) -> PreferencePair:
    """One record as a pair; a DataError naming the file, the record and the field otherwise."""
    where = f"{source} {locator}"
    if not isinstance(item, Mapping):
        raise DataError(f"{where}: a preference record must be an object with '{fields.prompt}', "
                        f"'{fields.chosen}' and '{fields.rejected}'")  # fmt: skip
    parts = {}
    for name in ("prompt", "chosen", "rejected"):
        field = getattr(fields, name)
        config = f"preference.{name}_field"
        if field not in item or item[field] is None:
            raise DataError(
                f"{where}: no field '{field}'; available fields: {', '.join(map(str, item)) or '(none)'} ({config})"
            )
        parts[name] = _messages(item[field], "user" if name == "prompt" else "assistant", where, field, config)
    for name in ("chosen", "rejected"):
        if parts[name][-1]["role"] != "assistant":
            field = getattr(fields, name)
            raise DataError(f"{where}: field '{field}' must end with an assistant turn (preference.{name}_field)")
    return PreferencePair(str(source), locator, parts["prompt"], parts["chosen"], parts["rejected"])


def load_pairs(path: str | Path, fmt: str = "auto", fields: Fields = Fields(), max_pairs: int | None = None) -> list[
    PreferencePair
]:  # fmt: skip
    """Read preference records from a local file or directory (jsonl, json, parquet, hf_dir; never the hub)."""
    kind, files = resolve_format(path, fmt)
    columns = (fields.prompt, fields.chosen, fields.rejected)
    pairs: list[PreferencePair] = []
    for file in files:
        if kind == "text":
            raise DataError(f"{file}: preference pairs are read from jsonl, json, parquet or hf_dir, not {kind}")
        items = read_records(kind, file, columns)
        try:
            for locator, item in items:
                if max_pairs is not None and len(pairs) >= max_pairs:
                    return pairs
                pairs.append(to_pair(file, locator, item, fields))
        except DataError as exc:  # data.records names its own fields when none of ours is a column
            hint = "(preference.prompt_field, preference.chosen_field, preference.rejected_field)"
            raise DataError(str(exc).replace("(set data.text_field or data.messages_field)", hint)) from None
    if not pairs:
        raise DataError(f"{path}: empty dataset (no preference pairs found)")
    return pairs


# ---------------------------------------------------------------------------------------------- tokens


def response_tokens(
    tokenizer: GGUFTokenizer, template: str, prompt: Sequence[Mapping[str, str]], response: Sequence[Mapping[str, str]]
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n] int32, flags [n] uint8: 1 on the response's tokens) of prompt + response rendered as one chat."""
    ids, flags = tokenize_chat(tokenizer, template, [*prompt, *response])
    flags = np.asarray(flags, np.uint8)
    in_prompt = 0
    if any(m["role"] == "assistant" for m in prompt):  # earlier assistant turns belong to the prompt
        in_prompt = int(sum(tokenize_chat(tokenizer, template, list(prompt))[1]))
    if in_prompt:
        flags[np.flatnonzero(flags)[:in_prompt]] = 0
    return np.asarray(ids, np.int32), flags


def position_mask(flags: np.ndarray, seq_len: int) -> np.ndarray:
    """mask[t] = flags[t + 1] for the first seq_len positions (the last one has no target)."""
    n = min(len(flags), seq_len)
    mask = np.zeros(n, np.uint8)
    mask[: n - 1] = flags[1:n]
    return mask


@dataclass
class PairRows:
    """Tokenized pairs of one split, rows cut at seq_len."""

    pair_id: list[int]
    chosen_ids: list[np.ndarray]
    chosen_mask: list[np.ndarray]
    rejected_ids: list[np.ndarray]
    rejected_mask: list[np.ndarray]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.pair_id)


def tokenize_pairs(
    pairs: Sequence[PreferencePair], ids: Sequence[int], tokenizer: GGUFTokenizer, seq_len: int
) -> PairRows:
    """Tokenize pairs[i] for i in ids (their pair ids); a pair with an empty response after the cut is dropped."""
    template = tokenizer.chat_template
    if not template:
        raise DataError("the GGUF has no tokenizer.chat_template: preference prompts are rendered with it")
    out = PairRows([], [], [], [], [])
    for i in ids:
        pair = pairs[i]
        rows = []
        for response in (pair.chosen, pair.rejected):
            try:
                tok, flags = response_tokens(tokenizer, template, pair.prompt, response)
            except ValueError as exc:
                raise DataError(f"{pair.where}: {exc}") from None
            rows.append((tok[:seq_len], position_mask(flags, seq_len)))
        if any(not m.any() for _, m in rows):
            out.dropped += 1
            continue
        out.pair_id.append(int(i))
        out.chosen_ids.append(rows[0][0])
        out.chosen_mask.append(rows[0][1])
        out.rejected_ids.append(rows[1][0])
        out.rejected_mask.append(rows[1][1])
    return out


def write_pair_rows(rows: PairRows, path: Path) -> Path:
    """Write one split's rows as Parquet (PAIR_SCHEMA), atomically."""
    table = pa.table(
        {
            "pair_id": pa.array(rows.pair_id, pa.int64()),
            "chosen_ids": pa.array([r.tolist() for r in rows.chosen_ids], pa.list_(pa.int32())),
            "chosen_mask": pa.array([r.tolist() for r in rows.chosen_mask], pa.list_(pa.uint8())),
            "rejected_ids": pa.array([r.tolist() for r in rows.rejected_ids], pa.list_(pa.int32())),
            "rejected_mask": pa.array([r.tolist() for r in rows.rejected_mask], pa.list_(pa.uint8())),
        },
        schema=PAIR_SCHEMA,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh:
        pq.write_table(table, fh)
    return path


def read_pair_rows(path: Path) -> PairRows:
    """The rows write_pair_rows wrote."""
    try:
        table = pq.read_table(path, schema=PAIR_SCHEMA)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: unreadable preference pairs ({exc})") from None
    col = {name: table.column(name).to_pylist() for name in PAIR_SCHEMA.names}
    return PairRows(
        [int(x) for x in col["pair_id"]],
        [np.asarray(x, np.int32) for x in col["chosen_ids"]],
        [np.asarray(x, np.uint8) for x in col["chosen_mask"]],
        [np.asarray(x, np.int32) for x in col["rejected_ids"]],
        [np.asarray(x, np.uint8) for x in col["rejected_mask"]],
    )


def pair_batch(rows: PairRows, index: Sequence[int], pairs: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """ids, mask [2 * pairs, seq_len] for PreferenceEngine.write_pairs: rows[index] chosen first, then rejected;
    rows missing from a partial last batch are zero with mask 0 (no loss)."""
    ids = np.zeros((2 * pairs, seq_len), np.int64)
    mask = np.zeros((2 * pairs, seq_len), np.uint8)
    for slot, i in enumerate(index):
        for half, (tok, m) in enumerate(
            ((rows.chosen_ids[i], rows.chosen_mask[i]), (rows.rejected_ids[i], rows.rejected_mask[i]))
        ):
            ids[half * pairs + slot, : len(tok)] = tok
            mask[half * pairs + slot, : len(m)] = m
    return ids, mask
