"""The GPU pieces of the model families against model/reference.py on lavapipe: NEOX RoPE and Llama 3 frequency
factors (forward, backward), the q/k/v bias add, the per-head q/k RMSNorm (the rmsnorm ops over rows of head_dim),
and a whole GPUStudent step (loss and every LoRA gradient) on tiny qwen3, qwen2 and Llama 3 models.
Error measure: max |gpu - ref| / max |ref| (float64 reference), bound 1e-4; every op run twice, bitwise equal."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu.device import Device
from gpu.model import ModelWeights
from gpu.objectives import GpuKd
from gpu.ops.add import add_bias
from gpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gpu.student import GPUStudent
from model import reference as ref
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.gguf import llama3_rope_factors
from model.kd import LossConfig, log_softmax
from tests.gpu_fixtures import tensor_core_device_or_skip
from tests.gpu_helpers import make_device, random_student_problem, rel_err, rope_matches_reference, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _factors(d: int, base: float) -> np.ndarray:
    """Llama 3 factors of a tiny head: kept, blended and divided frequencies (original context 32)."""
    return llama3_rope_factors(d, base, 8.0, 1.0, 4.0, 32).astype(np.float64)


@pytest.mark.parametrize(
    ("neox", "scaled", "use_buf"), [(True, False, False), (True, False, True), (False, True, True), (True, True, False)]
)
def test_rope_variants(dev: Device, neox: bool, scaled: bool, use_buf: bool) -> None:
    rng = np.random.default_rng(int(neox) + 2 * int(scaled) + 4 * int(use_buf))
    factors = _factors(16, 100.0) if scaled else None
    y, x, pos = rope_matches_reference(dev, rng, 7, 3, 16, 100.0, 2, use_buf, factors=factors, neox=neox)
    # the variant matters: the other pair layout is far off
    assert rel_err(y, ref.rope_forward(x, pos, 100.0, factors, not neox)) > 100 * TOL


def test_add_bias(dev: Device) -> None:
    rng = np.random.default_rng(0)
    rows, width = 13, 48
    y0 = rng.standard_normal((rows, width)).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    bb = up(dev, b)

    def run() -> list[np.ndarray]:
        y = up(dev, y0)
        add_bias(dev, y, bb, rows, width)
        return [dev.read(y, np.float32, y0.shape)]

    (got,) = twice(run)
    assert rel_err(got, y0.astype(np.float64) + b) <= 1e-6


@pytest.mark.parametrize(("heads", "d"), [(4, 16), (2, 128)])
def test_qk_norm_per_head(dev: Device, heads: int, d: int) -> None:
    """qwen3's q/k norm is the rmsnorm op over rows*heads rows of head_dim, the weight [D] shared by the heads."""
    rng = np.random.default_rng(heads)
    t, eps = 6, 1e-6
    x = (2 * rng.standard_normal((t, heads, d))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    dy = rng.standard_normal((t, heads, d)).astype(np.float32)
    xb, wb, dyb = up(dev, x), up(dev, w), up(dev, dy)

    def run() -> list[np.ndarray]:
        y, dx = dev.buffer(x.nbytes), dev.buffer(x.nbytes)
        rmsnorm_forward(dev, xb, wb, y, t * heads, d, eps)
        rmsnorm_backward(dev, dyb, xb, wb, dx, t * heads, d, eps)
        return [dev.read(b, np.float32, x.shape) for b in (y, dx)]

    y, dx = twice(run)
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    assert rel_err(y, ref.rmsnorm_forward(x64, w64, eps)) <= TOL
    assert rel_err(dx, ref.rmsnorm_backward(dy64, x64, w64, eps)) <= TOL


# ---------------------------------------------------------------- a whole training step per family

_BASE = {"n_layers": 2, "hidden": 32, "ffn": 64, "vocab": 300, "context_length": 64, "rope_base": 100.0}
FAMILIES = {
    "qwen3": ModelConfig(
        **_BASE, n_heads=4, n_kv_heads=2, head_dim=16, eps=1e-6, arch="qwen3", rope_type="neox", qk_norm=True
    ),
    "qwen2": ModelConfig(**_BASE, n_heads=4, n_kv_heads=2, arch="qwen2", rope_type="neox", qkv_bias=True),
    "llama3": ModelConfig(**_BASE, n_heads=4, n_kv_heads=1, rope_freq_factors=tuple(_factors(8, 100.0))),
}
T, B, K, RANK, SCALE = 12, 2, 8, 4, 2.0


def _problem(cfg: ModelConfig, seed: int, qtype: int):
    w, lora, ids, targets, mask, rng = random_student_problem(cfg, seed, qtype, RANK, B, T)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, cfg.vocab)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    tlp = np.take_along_axis(lp, tids, -1).astype(np.float32)
    return w, lora, ids, targets, mask, tids, tlp


@pytest.mark.parametrize(("name", "qtype"), [("qwen3", Q.F32), ("qwen3", Q.Q8_0), ("qwen2", Q.F32), ("llama3", Q.F32)])
def test_student_step_matches_reference(name: str, qtype: int) -> None:
    dev = make_device()
    cfg = FAMILIES[name]
    w, lora, ids, targets, mask, tids, tlp = _problem(cfg, 7, qtype)
    loss_cfg = LossConfig("forward_kl", tau=1.0, ce_weight=0.2)
    weights = ModelWeights.from_arrays(dev, cfg, w, qtype)
    spec = EngineSpec(weights.cfg, targets=LORA_TARGETS, r=RANK, alpha=SCALE * RANK, batch=B, seq_len=T)
    st = GPUStudent(dev, weights, spec, GpuKd(loss_cfg, K))
    st.set_adapter(lora)
    st.write_batch(KdBatch(ids, targets, mask, tids, tlp, None))
    loss = st.loss_and_grads()
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    l64 = {k: ref.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in lora.items()}
    args = (tids, tlp.astype(np.float64), None, targets, mask, loss_cfg)
    want_loss, want = ref.loss_and_grads(w64, cfg, ids, l64, SCALE, *args)  # the batched reference: one mean
    got = st.get_grads()
    worst = max(max(rel_err(got[k].A, da), rel_err(got[k].B, db)) for k, (da, db) in want.items())
    loss_err = abs(loss - want_loss) / abs(want_loss)
    print(f"{name} {Q(qtype).name}: GPU step vs reference: loss rel err {loss_err:.1e}, grads {worst:.1e}")
    assert loss_err < TOL and worst < TOL, (loss_err, worst)


TC_REL = 2e-2  # tensor cores: activations and dequantized weights rounded to f16, f32 accumulation


@pytest.mark.tensorcore
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tensorcore_step_matches_reference(name: str) -> None:
    """The same step with every frozen projection on tensor cores (Dawn subgroup matrices; H200 only)."""
    dev = tensor_core_device_or_skip()
    cfg = FAMILIES[name]
    w, lora, ids, targets, mask, tids, tlp = _problem(cfg, 9, Q.Q4_0)
    loss_cfg = LossConfig("forward_kl", tau=1.0)
    weights = ModelWeights.from_arrays(dev, cfg, w, Q.Q4_0)
    st = GPUStudent(
        dev,
        weights,
        EngineSpec(
            weights.cfg, targets=LORA_TARGETS, r=RANK, alpha=SCALE * RANK, batch=B, seq_len=T, precision="tensorcore"
        ),
        GpuKd(loss_cfg, K),
    )
    st.set_adapter(lora)
    st.write_batch(KdBatch(ids, targets, mask, tids, tlp, None))
    loss = st.loss_and_grads()
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    l64 = {k: ref.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in lora.items()}
    want_loss, want = ref.loss_and_grads(
        w64, cfg, ids, l64, SCALE, tids, tlp.astype(np.float64), None, targets, mask, loss_cfg
    )
    got = st.get_grads()
    worst = max(max(rel_err(got[k].A, da), rel_err(got[k].B, db)) for k, (da, db) in want.items())
    loss_err = abs(loss - want_loss) / abs(want_loss)
    print(f"{name} tensorcore step: loss rel err {loss_err:.1e}, grads {worst:.1e}")
    assert loss_err < TC_REL and worst < TC_REL, (loss_err, worst)
