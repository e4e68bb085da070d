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


class _Int8Gpu:
    """A device with f16 and (unless `int8` is False) integer subgroup matrices, as gpu/model.py asks of one."""

    def __init__(self, tensor_cores: bool = True, int8: bool = True) -> None:
        self.tensor_cores, self.int8 = tensor_cores, int8


@pytest.fixture
def capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpu.model

    monkeypatch.setattr(gpu.model, "has_tensor_cores", lambda dev: dev.tensor_cores)
    monkeypatch.setattr(gpu.model, "int8_emulated", lambda dev: False)
    monkeypatch.setattr(gpu.model, "int8_problem", lambda dev: None if dev.int8 else "no i8 subgroup matrices")


@pytest.mark.parametrize(
    ("device", "precision", "student", "model"),
    [
        (_Int8Gpu(), "auto", "int8", "tensorcore"),
        (_Int8Gpu(int8=False), "auto", "tensorcore", "tensorcore"),
        (_Int8Gpu(tensor_cores=False, int8=False), "auto", "f32", "f32"),
        (_Int8Gpu(), "tensorcore", "tensorcore", "tensorcore"),
        (_Int8Gpu(), "f32", "f32", "f32"),
        (_Int8Gpu(), "int8", "int8", "int8"),
    ],
)
def test_auto_trains_the_student_in_int8_where_the_gpu_has_it(
    capabilities: None, device: _Int8Gpu, precision: str, student: str, model: str
) -> None:
    from gpu.model import resolve_precision, student_precision

    assert student_precision(device, precision) == student  # type: ignore[arg-type]
    assert resolve_precision(device, precision) == model  # type: ignore[arg-type]  # teacher, evaluation, prefix


@pytest.mark.parametrize(
    ("train", "evaluated", "trained", "want"),
    [
        ("auto", "auto", "int8", "auto"),  # evaluated as auto resolves it for a model: tensorcore
        ("auto", "train", "int8", "int8"),
        ("auto", "f32", "int8", "f32"),
        ("tensorcore", "train", "tensorcore", "tensorcore"),
    ],
)
def test_the_engines_resolve_auto_for_the_student_alone(
    capabilities: None, monkeypatch: pytest.MonkeyPatch, train: str, evaluated: str, trained: str, want: str
) -> None:
    monkeypatch.setattr(engines, "chosen_backend", lambda cfg: "gpu")
    monkeypatch.setattr(engines, "get_device", lambda backend="auto", probe=False: _Int8Gpu())
    cfg = load_config(DEMO, [f"train.precision={train}", f"eval.precision={evaluated}"])
    assert engines.train_precision(cfg) == trained
    assert engines.eval_precision(cfg) == want


def test_auto_is_left_to_the_numpy_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "chosen_backend", lambda cfg: "numpy")
    cfg = load_config(DEMO, ["train.precision=auto", "eval.precision=train"])
    assert engines.train_precision(cfg) == engines.eval_precision(cfg) == "auto"
