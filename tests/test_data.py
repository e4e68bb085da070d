"""Teacher top-k (CPU reference) and the Parquet top-k store: plan, write, verify, resume, read, vocab."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.records import DataError, Document, dataset_fingerprint, load_records
from data.tokens import (
    read_token_split,
    read_token_table,
    read_tokenize_manifest,
    tokenize_dataset,
    tokenize_from_config,
    write_token_shards,
)
from model.tokenizer import GGUFTokenizer, load_tokenizer
from schemas.config import DataSection
from schemas.files import SchemaError
from schemas.manifests import TokenizeManifest

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a red fruit."},
    {"role": "assistant", "content": "A cherry."},
    {"role": "user", "content": "And a yellow one?"},
    {"role": "assistant", "content": "A lemon, usually."},
]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> GGUFTokenizer:
    return load_tokenizer(smollm2_path)


def _texts(n: int) -> list[str]:
    fruits = ["apples", "pears", "plums", "figs", "dates", "limes"]
    return [f"Document number {i} talks about {fruits[i % 6]} and {fruits[(i * 5 + 1) % 6]}." for i in range(n)]


def _write_jsonl(path: Path, items: list[Any]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    return path


def _trained_targets(ds: datasets.Dataset) -> np.ndarray:
    """The tokens whose prediction is trained, in row order: input_ids[t + 1] where loss_mask[t] = 1."""
    ids, mask = np.array(ds["input_ids"]), np.array(ds["loss_mask"])
    return np.concatenate([ids[r, 1:][mask[r, :-1] == 1] for r in range(len(ids))])


def _doc_numbers(tok: GGUFTokenizer, ds: datasets.Dataset) -> set[int]:
    return {int(m) for m in re.findall(r"number (\d+)", tok.decode(_trained_targets(ds)))}


def _docs(n: int) -> list[Document]:
    return [Document("mem", f"record {i}", text=t) for i, t in enumerate(_texts(n))]


# ---------------------------------------------------------------------------------------------- formats


def test_jsonl_text_and_max_documents(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t, "id": i} for i, t in enumerate(_texts(5))])
    docs = load_records(path)
    assert [d.text for d in docs] == _texts(5) and not any(d.is_chat for d in docs)
    assert docs[3].where == f"{path} line 4"
    assert [d.text for d in load_records(path, max_documents=2)] == _texts(2)


def test_json_list_parquet_text_and_hf_dir(tmp_path: Path) -> None:
    texts = _texts(4)
    (tmp_path / "d.json").write_text(json.dumps([{"body": t} for t in texts]), encoding="utf-8")
    assert [d.text for d in load_records(tmp_path / "d.json", text_field="body")] == texts

    pq.write_table(pa.table({"text": texts, "n": [1, 2, 3, 4]}), tmp_path / "d.parquet")
    assert [d.text for d in load_records(tmp_path / "d.parquet")] == texts

    # Plain text: one document per blank-line-separated paragraph; single newlines stay inside a document.
    (tmp_path / "d.txt").write_text(f"{texts[0]}\nsecond line\n\n\n{texts[1]}\n  \n{texts[2]}\n", encoding="utf-8")
    got = [d.text for d in load_records(tmp_path / "d.txt")]
    assert got == [f"{texts[0]}\nsecond line", texts[1], texts[2]]

    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    assert [d.text for d in load_records(tmp_path / "hf")] == texts
    assert [d.text for d in load_records(tmp_path / "hf", fmt="hf_dir", max_documents=3)] == texts[:3]


def test_directory_of_jsonl_files_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    texts = _texts(6)
    _write_jsonl(folder / "b.jsonl", [{"text": t} for t in texts[3:]])
    _write_jsonl(folder / "a.jsonl", [{"text": t} for t in texts[:3]])
    assert [d.text for d in load_records(folder)] == texts
    (folder / "c.parquet").write_bytes(b"x")
    with pytest.raises(DataError, match="mixes formats"):
        load_records(folder)


def test_chat_records_mask_only_assistant_tokens(tmp_path: Path, tok: GGUFTokenizer) -> None:
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"text": "A plain text record."}])
    docs = load_records(path)
    assert docs[0].is_chat and not docs[1].is_chat
    train, _ = tokenize_dataset(docs[:1], tok, seq_len=256, eval_fraction=0.5, seed=0, pack=False)
    row = train[0]
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
    assert len(ids) == 256 and mask[-1] == 0
    trained = tok.decode(ids[1:][mask[:-1] == 1])
    # Exactly the assistant contents, each with its end-of-turn token; no system/user text, no padding.
    assert trained == "A cherry.<|im_end|>A lemon, usually.<|im_end|>"
    rendered = tok.decode(ids[: int(np.flatnonzero(mask)[-1]) + 2])
    assert "Name a red fruit." in rendered and "You are terse." in rendered

    all_tokens, _ = tokenize_dataset(docs[:1], tok, 256, 0.5, 0, pack=False, assistant_only=False)
    assert int(np.sum(all_tokens[0]["loss_mask"])) > int(mask.sum())


# ---------------------------------------------------------------------------------------------- errors


def test_missing_file_and_non_local_names(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: no such local file"):
        load_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="hub names are not downloaded"):
        load_records("HuggingFaceFW/fineweb-edu")
    with pytest.raises(DataError, match="remote URLs are not read"):
        load_records("hf://datasets/foo/bar")
    with pytest.raises(DataError, match="remote URLs"):
        dataset_fingerprint("https://example.com/d.jsonl")


def _refused(path: Path, text: str, match: str) -> None:
    """load_records of a file holding `text` raises a DataError matching `match`."""
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match=match):
        load_records(path)


def test_empty_dataset_and_unknown_extension(tmp_path: Path) -> None:
    _refused(tmp_path / "e.jsonl", "\n\n", r"e\.jsonl: empty dataset")
    _refused(tmp_path / "e.txt", "  \n\n \n", "empty dataset")
    _refused(tmp_path / "d.csv", "text\nhello\n", r"d\.csv: unknown extension '\.csv'")


def test_missing_field_lists_available_fields(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"body": "x", "title": "y"}])
    with pytest.raises(
        DataError, match=r"d\.jsonl line 1: no field 'messages' or 'text'; available fields: body, title"
    ):
        load_records(path)
    pq.write_table(pa.table({"body": ["x"], "lang": ["en"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: no field 'messages' or 'text'; available fields: body, lang"):
        load_records(tmp_path / "d.parquet")
    datasets.Dataset.from_dict({"content": ["x"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DataError, match="available fields: content"):
        load_records(tmp_path / "hf")


def test_wrong_types_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"line 2: field 'text' must be a string, got int"):
        load_records(_write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"text": 3}]))
    with pytest.raises(DataError, match=r"line 1: field 'messages': messages\[0\] has no 'content'"):
        load_records(_write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user"}]}]))
    _refused(tmp_path / "c.jsonl", '{"text": "a"}\n{"text": \n', r"c\.jsonl line 2: invalid JSON")
    _refused(tmp_path / "d.json", '{"text": "a"}', "must be a list of objects, got dict")


def test_no_tokens_after_tokenization(tmp_path: Path, tok: GGUFTokenizer) -> None:
    prompts_only = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    docs = load_records(_write_jsonl(tmp_path / "p.jsonl", prompts_only))
    with pytest.raises(DataError, match=r"p\.jsonl: no trainable tokens"):
        tokenize_dataset(docs, tok, 32, 0.1, 0)
    with pytest.raises(DataError, match=r"e\.jsonl: every document \(2, e\.g\. line 1\) is empty or whitespace only"):
        load_records(_write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": " "}]))  # refused when read
    with pytest.raises(DataError, match="no trainable tokens"):
        tokenize_dataset([Document("e.jsonl", f"line {i}", text="") for i in (1, 2)], tok, 32, 0.1, 0)


# ---------------------------------------------------------------------------------------------- split


def test_packing_trains_every_transition_once(tok: GGUFTokenizer) -> None:
    docs = _docs(30)
    seq_len = 13
    train, held = tokenize_dataset(docs, tok, seq_len, eval_fraction=0.2, seed=3)
    for ds in (train, held):
        assert len(ds) >= 1
        ids = np.array(ds["input_ids"])
        mask = np.array(ds["loss_mask"])
        assert ids.shape[1] == seq_len and (mask[:, -1] == 0).all()
        # The trained targets, in row order, are the split's token stream (docs + EOS) minus its first token.
        targets = _trained_targets(ds)
        doc_ids = sorted(_doc_numbers(tok, ds))
        stream = np.concatenate([tok.encode(docs[d].text) + [tok.eos_id] for d in doc_ids])
        np.testing.assert_array_equal(targets, stream[1:])
    assert train["seq_id"] == list(range(len(train)))
    assert held["seq_id"] == list(range(len(train), len(train) + len(held)))


def test_split_is_deterministic_disjoint_and_seeded(tmp_path: Path, tok: GGUFTokenizer) -> None:
    docs = _docs(40)

    def eval_docs(seed: int) -> tuple[set[int], set[int]]:
        train, held = tokenize_dataset(docs, tok, 16, 0.25, seed)
        return _doc_numbers(tok, train), _doc_numbers(tok, held)

    train0, eval0 = eval_docs(0)
    assert eval0 and train0 and not train0 & eval0
    assert train0 | eval0 == set(range(40))
    assert eval_docs(0) == (train0, eval0)
    assert eval_docs(1)[1] != eval0

    # Same seed -> byte-identical shards; another seed -> other bytes.
    refs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train, held = tokenize_dataset(docs, tok, 16, 0.25, seed)
        manifest = write_token_shards(
            train, held, tmp_path / name, dataset_fingerprint="f", tokenizer_sha256="0" * 64,
            vocab_size=tok.vocab_size, seq_len=16,
        )  # fmt: skip
        refs.append(manifest)
    assert refs[0].shards_hash() == refs[1].shards_hash() != refs[2].shards_hash()
    a, b = (tmp_path / n / "train" / "data-00000-of-00001.arrow" for n in "ab")
    assert a.read_bytes() == b.read_bytes()


def test_at_least_one_eval_sequence(tok: GGUFTokenizer) -> None:
    train, held = tokenize_dataset(_docs(3), tok, 8, eval_fraction=0.001, seed=0)
    assert len(held) >= 1 and len(train) >= 1
    train, held = tokenize_dataset(_docs(2), tok, 8, eval_fraction=0.999, seed=0)
    assert len(held) >= 1 and len(train) >= 1


def test_unpacked_rows_are_truncated_and_padded(tok: GGUFTokenizer) -> None:
    docs = [Document("mem", "r0", text="short"), Document("mem", "r1", text=" ".join(["word"] * 50))]
    train, held = tokenize_dataset(docs, tok, 10, 0.5, 0, pack=False)
    rows = {r["doc_id"]: r for ds in (train, held) for r in ds}
    short = tok.encode("short") + [tok.eos_id]
    assert rows[0]["input_ids"][: len(short)] == short
    assert rows[0]["loss_mask"] == [1] * (len(short) - 1) + [0] * (10 - len(short) + 1)
    assert len(rows[1]["input_ids"]) == 10 and sum(rows[1]["loss_mask"]) == 9


# ---------------------------------------------------------------------------------------------- shards


def test_token_shards_schema_manifest_and_tamper(tmp_path: Path, tok: GGUFTokenizer) -> None:
    train, held = tokenize_dataset(_docs(12), tok, 12, 0.25, 0)
    out = tmp_path / "tok"

    def write() -> TokenizeManifest:
        return write_token_shards(
            train, held, out, dataset_fingerprint="fp", tokenizer_sha256="1" * 64, vocab_size=tok.vocab_size, seq_len=12
        )

    manifest = write()
    assert read_tokenize_manifest(out) == manifest
    assert manifest.train.n_sequences == len(train) and manifest.eval.n_sequences == len(held)
    assert manifest.train.n_positions == int(np.sum(train["loss_mask"]))
    assert manifest.train.n_documents + manifest.eval.n_documents == 12
    back = read_token_split(out, "train", manifest)
    assert back.data.table.column("input_ids").type == pa.list_(pa.int32())
    assert back.data.table.column("loss_mask").type == pa.list_(pa.uint8())
    assert back["input_ids"] == train["input_ids"] and back["seq_id"] == train["seq_id"]
    table = read_token_table(out, "train", manifest)  # pyarrow alone: the same rows
    assert table.equals(back.data.table.select(table.column_names))
    assert not list(out.glob(".*tmp*"))

    # Rewriting replaces the split in place.
    write()
    assert sorted(p.name for p in out.iterdir()) == ["eval", "tokenize_manifest.json", "train"]

    arrow = out / "eval" / "data-00000-of-00001.arrow"
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    arrow.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="sha256"):
        read_token_split(out, "eval", manifest)
    with pytest.raises(DataError, match="sha256"):
        read_token_table(out, "eval", manifest)


@pytest.mark.parametrize("reader", [read_token_split, read_token_table])
def test_read_token_split_rejects_wrong_schema(tmp_path: Path, reader) -> None:
    bad = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2]], "loss_mask": [[1, 0]], "doc_id": [0], "seq_id": [0]}
    )  # loss_mask inferred as int64 (datasets itself stores input_ids as int32)
    bad.save_to_disk(str(tmp_path / "train"))
    with pytest.raises(SchemaError, match=r"train: column 'loss_mask' has type list<item: int64>, expected"):
        reader(tmp_path, "train")


def test_training_and_evaluation_import_without_datasets() -> None:
    """The train and evaluate stages read token shards with pyarrow alone: a GPU worker needs no `datasets`."""
    code = (
        "import sys; sys.modules['datasets'] = None\n"
        "import stages.train, stages.evaluate, stages.prefix, stages.teacher, training.loop, training.evaluation\n"
        "assert 'datasets' not in [m for m in sys.modules if sys.modules[m] is not None]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_dataset_fingerprint_tracks_bytes_and_fields(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in _texts(3)])
    base = dataset_fingerprint(path)
    assert base == dataset_fingerprint(path) and re.fullmatch(r"[0-9a-f]{64}", base)
    assert dataset_fingerprint(path, text_field="body") != base
    assert dataset_fingerprint(path, max_documents=2) != base
    _write_jsonl(path, [{"text": t} for t in _texts(3)[::-1]])
    assert dataset_fingerprint(path) != base


def test_views_root_relative_paths_and_config_entry(tmp_path: Path, tok: GGUFTokenizer) -> None:
    train, held = tokenize_dataset(_docs(12), tok, 12, 0.25, 0)
    out = tmp_path / "run" / "tok"
    manifest = write_token_shards(
        train.select([2, 0]), held, out, dataset_fingerprint="fp", tokenizer_sha256="1" * 64,
        vocab_size=tok.vocab_size, seq_len=12, root=tmp_path / "run",
    )  # fmt: skip
    assert manifest.train.n_sequences == 2 and manifest.train.shards[0].path.startswith("tok/train/")
    assert read_token_split(out, "train", manifest, root=tmp_path / "run")["seq_id"] == [2, 0]

    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in _texts(10)])
    data = DataSection(path=path, seq_len=16, eval_fraction=0.3, max_documents=8)
    got = tokenize_from_config(data, tok, "2" * 64, tmp_path / "cfg")
    assert got.seq_len == 16 and got.train.n_documents + got.eval.n_documents == 8
    assert got.dataset_fingerprint == dataset_fingerprint(path, max_documents=8)
