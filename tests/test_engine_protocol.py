"""Every engine satisfies training/engine.py's Engine protocol: the numpy and GPU trunks with each objective (KD,
preference), and the data-parallel engine (its class; building one needs a Ray cluster: tests/test_ray_train.py).
Each one takes its objective's typed batch, refuses the other's with a TypeError, and evaluates what it wrote."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from cpu import NumpyEngine, NumpyKd, NumpyPreference
from model import reference as R
from model.config import ModelConfig
from model.dpo import DpoConfig
from model.engine_spec import EngineSpec, KdBatch, PairBatch
from model.kd import LossConfig
from tests.gpu_fixtures import device_or_skip
from training.engine import Engine

CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
B, T, K = 2, 8, 4
LOSS = LossConfig("forward_kl", tau=1.0, use_tail=True)
DPO = DpoConfig(beta=0.5)


def _spec() -> EngineSpec:
    return EngineSpec(CFG, targets=("q", "v", "down"), r=4, alpha=8.0, batch=B, seq_len=T)


def _kd_batch() -> KdBatch:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab, (B, T))
    tids = rng.integers(0, CFG.vocab, (B, T, K))
    tlp = np.log(np.full((B, T, K), 0.2, np.float32))
    return KdBatch(ids, np.roll(ids, -1, 1), np.ones((B, T), np.uint8), tids, tlp, np.full((B, T), 0.2, np.float32))


def _pair_batch() -> PairBatch:
    rng = np.random.default_rng(1)
    mask = np.zeros((B, T), np.uint8)
    mask[:, 3:] = 1
    return PairBatch(rng.integers(0, CFG.vocab, (B, T)), mask, np.array([-20.0, -21.0]))


def _check_protocol(cls: type) -> None:
    """cls has every method of the protocol, with the protocol's parameter names."""
    for name, want in vars(Engine).items():
        if inspect.isfunction(want) and name[0] != "_":
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(inspect.signature(want).parameters), f"{cls.__name__}.{name}{got}"


def _check_engine(engine: object, batch: object, other: object, result_keys: set[str]) -> None:
    assert isinstance(engine, Engine)
    _check_protocol(type(engine))
    assert isinstance(engine.cfg, ModelConfig) and engine.layout.slots
    assert isinstance(engine.applied_steps, int) and isinstance(engine.skipped_steps, int)
    engine.set_adapter(R.init_lora(CFG, ["q", "v", "down"], 4, seed=0))
    with pytest.raises(TypeError, match="takes a"):
        engine.write_batch(other)
    engine.write_batch(batch)
    assert result_keys <= set(engine.evaluate_batch())
    engine.accumulate(0)
    stats = engine.apply(1e-3)
    assert np.isfinite(stats.loss) and engine.applied_steps == 1


KD_RESULTS = {"kd_loss", "ce", "top1"}
PAIR_RESULTS = {"logps", "counts", "loss", "pair_loss", "margin", "chosen_reward", "rejected_reward", "valid"}


@pytest.mark.parametrize("objective", ["kd", "preference"])
def test_numpy_engine(objective: str) -> None:
    w = R.random_weights(CFG, 3, np.float32)
    if objective == "kd":
        _check_engine(NumpyEngine(w, _spec(), NumpyKd(LOSS, K)), _kd_batch(), _pair_batch(), KD_RESULTS)
    else:
        _check_engine(NumpyEngine(w, _spec(), NumpyPreference(DPO)), _pair_batch(), _kd_batch(), PAIR_RESULTS)


@pytest.mark.gpu
@pytest.mark.parametrize("objective", ["kd", "preference"])
def test_gpu_student(objective: str) -> None:
    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd, GpuPreference
    from gpu.student import GPUStudent

    dev = device_or_skip()
    weights = ModelWeights.from_arrays(dev, CFG, R.random_weights(CFG, 3, np.float32))
    if objective == "kd":
        _check_engine(GPUStudent(dev, weights, _spec(), GpuKd(LOSS, K)), _kd_batch(), _pair_batch(), KD_RESULTS)
    else:
        st = GPUStudent(dev, weights, _spec(), GpuPreference(DPO))
        _check_engine(st, _pair_batch(), _kd_batch(), PAIR_RESULTS)


def test_data_parallel_engine_class() -> None:
    from training.data_parallel import DataParallelEngine

    _check_protocol(DataParallelEngine)
    for name in ("cfg", "layout"):
        assert isinstance(inspect.getattr_static(DataParallelEngine, name), property)


def test_the_spec_holds_the_shape_and_the_scale() -> None:
    spec = _spec()
    assert spec.rows == B * T and spec.scale == 2.0 and spec.layout().r == 4
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        EngineSpec(CFG, targets=("q",), r=4, alpha=8.0, batch=1, seq_len=65)
    with pytest.raises(ValueError, match="2 sequences per pair"):
        NumpyEngine(R.random_weights(CFG, 3, np.float32), EngineSpec(CFG, ("q",), 4, 8.0, 3, T), NumpyPreference(DPO))
