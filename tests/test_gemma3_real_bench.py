"""bench/gemma3_real.py writes the config its documented run uses: the published file as teacher and as the
student's source, requantized; the demo's KJV training chapters; a held-out book that is not trained on."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gemma3_real import parser, write_config
from schemas.config import load_config


def test_config_is_the_documented_run(tmp_path: Path) -> None:
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")  # only its path is written; the run reads it
    args = parser().parse_args(
        [str(gguf), "--workdir", str(tmp_path / "run"), "--train-books", "Genesis", "Exodus", "--eval-verses", "5"]
    )
    cfg = load_config(write_config(args))
    assert cfg.model.teacher == cfg.model.student == gguf.resolve()
    assert tuple(cfg.model.student_quant) == ("Q4_K", "Q4_0")
    assert (cfg.teacher.backend, cfg.train.backend) == ("numpy", "numpy")
    lora = (cfg.lora.r, cfg.lora.alpha, cfg.lora.kind)
    assert (cfg.data.seq_len, cfg.train.epochs, lora) == (128, 2, (16, 32.0, "mergeable"))
    train = [json.loads(line)["text"] for line in cfg.data.path.read_text(encoding="utf-8").splitlines()]
    held_out = [json.loads(line)["text"] for line in cfg.data.eval_path.read_text(encoding="utf-8").splitlines()]
    assert len(train) == 4 and train[0].startswith("In the beginning God created")  # chapters 1-2 of each book
    assert len(held_out) == 1 and held_out[0].startswith("Now it came to pass in the days when the judges ruled")
    assert len(held_out[0]) < 1000 and not set(held_out) & set(train)  # Ruth 1:1-5 of its 22 verses
    assert cfg.run.workdir == (tmp_path / "run").resolve()
