"""eval.precision: the held-out evaluation's matmul path, apart from the training's (int8 trains fast; its 8-bit
activations would round the held-out forward itself, so auto evaluates int8 training on the f16 tensor cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.config import ModelConfig
from model.engine_spec import EngineSpec
from schemas.config import ConfigError, load_config
from training import engines

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@pytest.mark.parametrize(
    ("train", "evaluated", "want"),
    [
        ("int8", "auto", "tensorcore"),
        ("tensorcore", "auto", "tensorcore"),
        ("f32", "auto", "f32"),
        ("auto", "auto", "auto"),
        ("int8", "train", "int8"),
        ("int8", "f32", "f32"),
        ("tensorcore", "int8", "int8"),
    ],
)
def test_eval_precision_follows_the_training_but_int8(train: str, evaluated: str, want: str) -> None:
    cfg = load_config(DEMO, [f"train.precision={train}", f"eval.precision={evaluated}"])
    assert engines.eval_precision(cfg) == want
    spec = EngineSpec.from_run(cfg, ModelConfig(n_layers=1, hidden=32, ffn=64, n_heads=2, n_kv_heads=1, vocab=50), 8)
    assert spec.precision == train  # the training's own spec keeps train.precision
    assert EngineSpec.from_run(cfg, spec.cfg, 8, precision=want).precision == want


def test_eval_precision_is_checked() -> None:
    with pytest.raises(ConfigError, match="eval.precision"):
        load_config(DEMO, ["eval.precision=int4"])
    cfg = load_config(DEMO, ["train.backend=numpy", "train.precision=int8"])  # evaluated on tensor cores (auto)
    with pytest.raises(ValueError, match=r"eval.precision: tensorcore needs the GPU engine \(train.backend=gpu\)"):
        engines.build_engine(cfg, Path("unused.gguf"), 8, eval_mode=True)
    with pytest.raises(ValueError, match="train.precision: int8 needs the GPU engine"):
        engines.build_engine(cfg, Path("unused.gguf"), 8)
