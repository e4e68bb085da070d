"""Overflow is a handled event on the GPU student (lavapipe): a non-finite gradient or loss of any micro-batch
skips the optimizer step (parameters and AdamW moments unchanged, the skip counted), a finite step after it is
applied, and too many skips in a row stop training with TrainingDiverged (a one-line user error)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu.model import ModelWeights
from gpu.objectives import GpuKd
from gpu.student import GPUStudent, TrainingDiverged
from model import reference
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig
from tests.gpu_fixtures import device_or_skip

pytestmark = pytest.mark.gpu

CFG = ModelConfig(n_layers=1, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=128, context_length=16)
T, K, R = 8, 4, 2


def _student(grad_accum: int = 1, max_skips_in_a_row: int = 8) -> GPUStudent:
    dev = device_or_skip()
    weights = ModelWeights.from_arrays(dev, CFG, reference.random_weights(CFG, 0, np.float32), Q.Q8_0)
    st = GPUStudent(
        dev,
        weights,
        EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=1, seq_len=T, grad_accum=grad_accum),
        GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=False), K),
        max_skips_in_a_row=max_skips_in_a_row,
    )
    st.set_adapter(reference.init_lora(CFG, list(LORA_TARGETS), R, seed=1))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab, (1, T))
    tids = np.stack([rng.permutation(CFG.vocab)[:K] for _ in range(T)])[None]
    st.write_batch(KdBatch(ids, np.roll(ids, -1, 1), np.ones((1, T)), tids, np.full((1, T, K), np.log(1 / K)), None))
    return st


def _state(st: GPUStudent) -> bytes:
    """Parameters and both AdamW moments, as bytes."""
    n = st.layout.n_params
    params = st.dev.read(st.params, np.float32, (n,))
    return params.tobytes() + b"".join(v.tobytes() for v in st.optimizer_state().values())


def _poison(st: GPUStudent, buf: object, index: int, value: float = np.inf) -> None:
    st.dev.write(buf, np.array([value], np.float32), offset=4 * index)


def test_inf_gradient_skips_the_step_and_counts_it() -> None:
    st = _student()
    st.accumulate(0)
    st.apply(lr=1e-2)  # one applied step: moments non-zero, so "unchanged" is a real check
    before = _state(st)
    st.accumulate(0)
    _poison(st, st.grads, st.layout.n_params // 2)
    stats = st.apply(lr=1e-2)
    assert stats.skipped and not np.isfinite(stats.grad_norm) and np.isfinite(stats.loss)
    assert _state(st) == before
    assert (st.applied_steps, st.skipped_steps, st.skips_in_a_row) == (1, 1, 1)
    st.accumulate(0)
    assert not st.apply(lr=1e-2).skipped
    assert _state(st) != before
    assert (st.applied_steps, st.skipped_steps, st.skips_in_a_row) == (2, 1, 0)


def test_any_micro_batch_loss_non_finite_skips_the_step() -> None:
    """The loss of the first of two micro-batches is Inf, its gradients finite: the GPU must skip the update
    (before, only the last micro-batch's loss was checked there and the host only reported a skip)."""
    st = _student(grad_accum=2)
    before = _state(st)
    st.accumulate(0)
    st.accumulate(1)
    _poison(st, st.losses, 0)
    stats = st.apply(lr=1e-2)
    assert stats.skipped and np.isfinite(stats.grad_norm)
    assert _state(st) == before
    assert (st.applied_steps, st.skipped_steps) == (0, 1)


def test_too_many_skips_in_a_row_stop_training() -> None:
    st = _student(max_skips_in_a_row=3)
    for i in range(3):
        st.accumulate(0)
        _poison(st, st.grads, 0, np.nan)
        if i < 2:
            assert st.apply(lr=1e-2).skipped
    with pytest.raises(TrainingDiverged, match="3 training steps in a row skipped"):
        st.apply(lr=1e-2)
    assert isinstance(TrainingDiverged("x"), ValueError)  # the CLI prints ValueErrors as one line
    assert (st.applied_steps, st.skipped_steps) == (0, 3)
