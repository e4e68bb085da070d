"""The demo's inputs (flows/demo.py, configs/demo.yaml): the held-out book is never in the training text, and it
holds the >= 2,000 scored positions the demo reports on."""

from __future__ import annotations

import json
from pathlib import Path

from flows.demo import DEMO_CONFIG, EVAL_BOOKS, TRAIN_BOOKS, TRAIN_CHAPTERS, write_kjv_jsonl
from model.tokenizer import load_tokenizer
from schemas.config import load_config


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_demo_trains_and_evaluates_on_different_books(tmp_path: Path, kjv_dir: Path, smollm2_path: Path) -> None:
    cfg = load_config(DEMO_CONFIG)
    assert cfg.data.eval_path is not None and cfg.data.eval_path != cfg.data.path
    assert cfg.lora.kind == "mergeable" and cfg.export.merge and cfg.export.merge_quant is None  # folded (issue 23)
    assert not set(TRAIN_BOOKS) & set(EVAL_BOOKS)
    train = write_kjv_jsonl(tmp_path / "train.jsonl", TRAIN_BOOKS, TRAIN_CHAPTERS)
    held = write_kjv_jsonl(tmp_path / "eval.jsonl", EVAL_BOOKS)
    mtime = train.stat().st_mtime_ns
    assert write_kjv_jsonl(train, TRAIN_BOOKS, TRAIN_CHAPTERS).stat().st_mtime_ns == mtime  # unchanged: kept
    train_texts, held_texts = _texts(train), _texts(held)
    assert len(train_texts) == len(TRAIN_BOOKS) * TRAIN_CHAPTERS and len(held_texts) == 4  # Ruth: 4 chapters
    train_all = " ".join(train_texts)
    ruth = json.loads((kjv_dir / "Ruth.json").read_text(encoding="utf-8"))
    verses = [v.strip() for chapter in ruth.values() for v in chapter.values()]
    assert len(verses) == 85 and not any(v in train_all for v in verses if len(v) > 40)
    tok = load_tokenizer(smollm2_path)
    n_held = sum(len(tok.hf.encode(t, add_special_tokens=False).ids) + 1 for t in held_texts)  # + EOS each
    n_train = sum(len(tok.hf.encode(t, add_special_tokens=False).ids) + 1 for t in train_texts)
    # Packed windows of seq_len overlapping by one: every token but the last trains once.
    assert n_held - 1 >= 2000 and 6000 <= n_train <= 12000, (n_held, n_train)
    capped = write_kjv_jsonl(tmp_path / "capped.jsonl", TRAIN_BOOKS, TRAIN_CHAPTERS, n_verses=40)
    exodus = json.loads((kjv_dir / "Exodus.json").read_text(encoding="utf-8"))["1"]
    first_nine = " ".join(exodus[str(v)].strip() for v in range(1, 10))
    assert _texts(capped)[1:] == [first_nine]  # Genesis 1 has 31 verses: then 9 of Exodus 1
