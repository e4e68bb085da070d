"""cpu.NumpyEngine on a tiny random llama: loss and LoRA gradients against the float64 reference and against
GPUStudent on lavapipe, AdamW updates, gradient accumulation, skipped non-finite steps, evaluation, bitwise
resume through the optimizer state, recomputation, GGUF loading; the batched reference ops it calls."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cpu import NumpyEngine
from cpu.objectives import NumpyKd
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig, log_softmax
from model.quant import dequantize, quantize
from schemas.optim import AdamWConfig
from tests.gpu_fixtures import device_or_skip

CFG = ModelConfig(n_layers=3, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
T, B, K, RANK = 16, 2, 8, 4
SCALE = 2.0  # alpha / r
LAYERS = (1, 2)  # LoRA on the top two of three blocks: the backward stops at block 1
CHUNK = 64  # vocabulary chunk: 300 = 4 full chunks + a partial one
REL = 2e-5  # float32 vs float64 (or vs the GPU's float32): max |err| / max |ref| per tensor; measured ~2e-6

CASES = [
    LossConfig("forward_kl", tau=1.0, use_tail=True),
    LossConfig("jsd", tau=2.0, beta=0.3, ce_weight=0.25, use_tail=False),
]
CASE_IDS = ["forward_kl-tail", "jsd-ce"]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def _weights(seed: int, qtype: int = Q.Q8_0) -> dict[str, np.ndarray]:
    """Random float32 weights with the 2-D projections rounded through `qtype` (what the GPU decodes)."""
    w = R.random_weights(CFG, seed, np.float32)
    return {
        n: dequantize(quantize(a, qtype), qtype, a.shape) if a.ndim == 2 and n.startswith("blk.") else a
        for n, a in w.items()
    }


def _batch(rng: np.random.Generator, tau: float) -> tuple[np.ndarray, ...]:
    """ids, targets, mask [B, T] and a random teacher's top-k ids, logprobs [B, T, K] and tail [B, T]."""
    ids = rng.integers(0, CFG.vocab, (B, T))
    targets = np.concatenate([ids[:, 1:], rng.integers(0, CFG.vocab, (B, 1))], axis=1)
    mask = (rng.random((B, T)) > 0.2).astype(np.uint8)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, CFG.vocab)) / tau)
    tids = np.argsort(-lp, axis=-1)[..., :K]
    top = np.take_along_axis(lp, tids, -1)
    tail = np.clip(1 - np.exp(top).sum(-1), 0, None)
    return ids, targets, mask, tids, top.astype(np.float32), tail.astype(np.float32)


def _adapter(rng: np.random.Generator, layers=LAYERS) -> dict[tuple[int, str], R.LoraPair]:
    """PEFT init with a random (non-zero) B, so that every dA is non-zero too."""
    init = R.init_lora(CFG, list(LORA_TARGETS), RANK, seed=5)
    return {
        key: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(np.float32))
        for key, p in init.items()
        if key[0] in layers
    }


def _spec(**kw) -> EngineSpec:
    """The tests' EngineSpec; kw: other EngineSpec fields."""
    return EngineSpec(CFG, **{"targets": LORA_TARGETS, "r": RANK, "alpha": SCALE * RANK, "batch": B, "seq_len": T,
                              "layers": LAYERS, **kw})  # fmt: skip


def _engine(w, loss: LossConfig, optim: AdamWConfig | None = None, **kw) -> NumpyEngine:
    optim = optim or AdamWConfig(lr=1e-2, weight_decay=0.1)
    budget = {"activation_budget": kw.pop("activation_budget")} if "activation_budget" in kw else {}
    return NumpyEngine(w, _spec(**{"vocab_chunk": CHUNK, **kw}), NumpyKd(loss, K), optim, **budget)


def _gpu_student(dev, w, loss: LossConfig, optim: AdamWConfig | None = None, **kw):
    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd
    from gpu.student import GPUStudent

    optim = optim or AdamWConfig(lr=1e-2, weight_decay=0.1)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q8_0)
    return GPUStudent(dev, weights, _spec(**kw), GpuKd(loss, K), optim)


def _write(st, batch: tuple[np.ndarray, ...], loss: LossConfig) -> None:
    st.write_batch(KdBatch(*batch[:5], batch[5] if loss.use_tail else None))


def _grad_errors(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(max(_rel(got[key].A, da), _rel(got[key].B, db)) for key, (da, db) in want.items())


# ---------------------------------------------------------------- the batched reference ops


def test_batched_block_matches_per_sequence() -> None:
    """block_forward / block_backward on [B, T, H] equal B calls on [T, H] (float64, to rounding)."""
    rng = np.random.default_rng(0)
    w = R.random_weights(CFG, 1)
    lora = {k: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape)) for k, p in R.init_lora(CFG, ["q", "down"], 4, 2).items()}
    x, dout = rng.standard_normal((2, B, T, CFG.hidden))
    out, cache = R.block_forward(x, w, CFG, 1, lora, SCALE)
    grads: dict = {}
    dx = R.block_backward(dout, cache, w, CFG, 1, lora, SCALE, grads)
    want_grads: dict = {}
    for s in range(B):
        out_s, cache_s = R.block_forward(x[s], w, CFG, 1, lora, SCALE)
        np.testing.assert_allclose(out[s], out_s, rtol=1e-12, atol=1e-12)
        g_s: dict = {}
        np.testing.assert_allclose(dx[s], R.block_backward(dout[s], cache_s, w, CFG, 1, lora, SCALE, g_s), atol=1e-12)
        for key, (da, db) in g_s.items():
            prev = want_grads.get(key, (0.0, 0.0))
            want_grads[key] = (prev[0] + da, prev[1] + db)
    assert set(grads) == {(1, "q"), (1, "down")}
    for key, (da, db) in want_grads.items():
        np.testing.assert_allclose(grads[key][0], da, atol=1e-12)
        np.testing.assert_allclose(grads[key][1], db, atol=1e-12)


def test_batched_loss_is_mean_over_masked_positions() -> None:
    """reference.loss_and_grads on a batch = per-sequence losses weighted by their masked-position counts."""
    rng = np.random.default_rng(1)
    w, loss_cfg = R.random_weights(CFG, 2), CASES[1]
    ids, targets, mask, tids, tlp, _ = _batch(rng, loss_cfg.tau)
    lora = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in _adapter(rng).items()}
    loss, grads = R.loss_and_grads(w, CFG, ids, lora, SCALE, tids, tlp, None, targets, mask, loss_cfg)
    per_seq = [R.loss_and_grads(w, CFG, ids[s], lora, SCALE, tids[s], tlp[s], None, targets[s], mask[s], loss_cfg)
               for s in range(B)]  # fmt: skip
    share = mask.sum(axis=1) / mask.sum()
    assert loss == pytest.approx(sum(c * ls for c, (ls, _) in zip(share, per_seq, strict=True)), rel=1e-12)
    for key, (da, _) in grads.items():
        np.testing.assert_allclose(da, sum(c * g[key][0] for c, (_, g) in zip(share, per_seq, strict=True)), atol=1e-12)


# ---------------------------------------------------------------- against the float64 reference


@pytest.mark.parametrize("loss_cfg", CASES, ids=CASE_IDS)
def test_loss_and_grads_match_float64_reference(loss_cfg: LossConfig) -> None:
    rng = np.random.default_rng(3)
    w = _weights(3)
    adapter = _adapter(rng)
    batch = _batch(rng, loss_cfg.tau)
    st = _engine(w, loss_cfg)
    st.set_adapter(adapter)
    _write(st, batch, loss_cfg)
    loss = st.loss_and_grads()
    ids, targets, mask, tids, tlp, tail = batch
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    lora64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    want_loss, want = R.loss_and_grads(
        w64, CFG, ids, lora64, SCALE, tids, tlp, tail if loss_cfg.use_tail else None, targets, mask, loss_cfg
    )
    assert abs(loss - want_loss) / abs(want_loss) < REL
    assert _grad_errors(st.get_grads(), want) < REL
    assert min(np.abs(g.A).max() for g in st.get_grads().values()) > 0  # dA non-zero: B is random


def test_recomputed_blocks_give_identical_grads() -> None:
    """Keeping no block caches (recompute from block inputs) changes nothing, bit for bit."""
    rng = np.random.default_rng(4)
    w, loss_cfg = _weights(4), CASES[0]
    adapter, batch = _adapter(rng), _batch(rng, 1.0)
    out = []
    for budget in (1 << 40, 0):
        st = _engine(w, loss_cfg, activation_budget=budget)
        assert st.keep_caches == (budget > 0)
        st.set_adapter(adapter)
        _write(st, batch, loss_cfg)
        out.append((st.loss_and_grads(), st.grads.copy()))
    assert out[0][0] == out[1][0] and out[0][1].tobytes() == out[1][1].tobytes()


# ---------------------------------------------------------------- against GPUStudent (lavapipe)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_cfg", CASES, ids=CASE_IDS)
def test_step_and_evaluation_match_gpu_student(loss_cfg: LossConfig) -> None:
    dev = device_or_skip()
    rng = np.random.default_rng(6)
    w = _weights(6)
    adapter, batch = _adapter(rng), _batch(rng, loss_cfg.tau)
    cpu, gpu = _engine(w, loss_cfg), _gpu_student(dev, w, loss_cfg)
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        _write(st, batch, loss_cfg)
    loss_cpu, loss_gpu = cpu.loss_and_grads(), gpu.loss_and_grads()
    assert abs(loss_cpu - loss_gpu) / abs(loss_gpu) < REL
    want = {key: (p.A, p.B) for key, p in gpu.get_grads().items()}
    assert _grad_errors(cpu.get_grads(), want) < REL
    ev_cpu, ev_gpu = cpu.evaluate_batch(), gpu.evaluate_batch()
    assert _rel(ev_cpu["kd_loss"], ev_gpu["kd_loss"]) < REL
    assert _rel(ev_cpu["ce"], ev_gpu["ce"]) < REL
    np.testing.assert_array_equal(ev_cpu["top1"], ev_gpu["top1"])
    assert ev_cpu["top1"].dtype == ev_gpu["top1"].dtype and ev_cpu["ce"].shape == (B * T,)


@pytest.mark.gpu
def test_adamw_steps_match_gpu_student() -> None:
    """Four AdamW steps (clipping active, weight decay) land on the GPU's parameters; optimizer state too."""
    dev = device_or_skip()
    rng = np.random.default_rng(7)
    w, loss_cfg = _weights(7), CASES[0]
    adapter, batch = _adapter(rng), _batch(rng, 1.0)
    optim = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)
    cpu, gpu = _engine(w, loss_cfg, optim=optim), _gpu_student(dev, w, loss_cfg, optim=optim)
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        _write(st, batch, loss_cfg)
    for step in range(4):
        s_cpu, s_gpu = cpu.train_step(lr=1e-2 / (step + 1)), gpu.train_step(lr=1e-2 / (step + 1))
        assert s_cpu.clip_scale < 1 and abs(s_cpu.clip_scale - s_gpu.clip_scale) < REL * s_gpu.clip_scale
        assert abs(s_cpu.grad_norm - s_gpu.grad_norm) < REL * s_gpu.grad_norm
        assert abs(s_cpu.loss - s_gpu.loss) < REL * abs(s_gpu.loss) and not s_cpu.skipped
    start = cpu.layout.pack(adapter)
    p_cpu, p_gpu = cpu.layout.pack(cpu.get_adapter()), gpu.layout.pack(gpu.get_adapter())
    assert _rel(p_cpu - start, p_gpu - start) < 3e-3  # the updates (Adam's normalisation amplifies tiny grad diffs)
    assert cpu.applied_steps == gpu.applied_steps == 4
    o_cpu, o_gpu = cpu.optimizer_state(), gpu.optimizer_state()
    assert o_cpu.keys() == o_gpu.keys()
    for name in o_gpu:
        assert o_cpu[name].shape == o_gpu[name].shape and o_cpu[name].dtype == o_gpu[name].dtype
        assert _rel(o_cpu[name], o_gpu[name]) < 5e-5


@pytest.mark.gpu
def test_grad_accumulation_matches_gpu_student() -> None:
    dev = device_or_skip()
    rng = np.random.default_rng(8)
    w, loss_cfg = _weights(8), CASES[1]
    adapter = _adapter(rng)
    micro = [_batch(rng, loss_cfg.tau) for _ in range(2)]
    cpu, gpu = _engine(w, loss_cfg, grad_accum=2), _gpu_student(dev, w, loss_cfg, grad_accum=2)
    stats = []
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        for i, batch in enumerate(micro):
            _write(st, batch, loss_cfg)
            st.accumulate(i)
        stats.append(st.apply(lr=1e-2))
    assert abs(stats[0].loss - stats[1].loss) < REL * abs(stats[1].loss)
    assert abs(stats[0].grad_norm - stats[1].grad_norm) < REL * stats[1].grad_norm
    want = {key: (p.A, p.B) for key, p in gpu.get_grads().items()}
    assert _grad_errors(cpu.get_grads(), want) < REL
    # and against single-batch engine gradients: the average of the two micro-batches
    single = _engine(w, loss_cfg)
    single.set_adapter(adapter)
    parts = []
    for batch in micro:
        _write(single, batch, loss_cfg)
        parts.append((single.loss_and_grads(), single.grads.copy()))
    np.testing.assert_allclose(cpu.grads, (parts[0][1] + parts[1][1]) / 2, rtol=0, atol=1e-7 * np.abs(cpu.grads).max())
    assert stats[0].loss == pytest.approx((parts[0][0] + parts[1][0]) / 2, rel=1e-6)


# ---------------------------------------------------------------- optimizer bookkeeping


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_non_finite_step_is_skipped_and_counted(grad_accum: int) -> None:
    rng = np.random.default_rng(9)
    w, loss_cfg = _weights(9), CASES[0]
    st = _engine(w, loss_cfg, grad_accum=grad_accum)
    st.set_adapter(_adapter(rng))
    before = st.params.copy()
    good, bad = _batch(rng, 1.0), list(_batch(rng, 1.0))
    bad[4] = np.full_like(bad[4], np.nan)  # teacher log-probs: loss and gradients NaN
    for micro in range(grad_accum):
        _write(st, bad if micro == grad_accum - 1 else good, loss_cfg)
        st.accumulate(micro)
    stats = st.apply(lr=1e-2)
    assert stats.skipped and not np.isfinite(stats.loss)
    assert (st.skipped_steps, st.applied_steps) == (1, 0)
    assert st.params.tobytes() == before.tobytes() and not st.optimizer_state()["m"].any()
    for micro in range(grad_accum):
        _write(st, good, loss_cfg)
        st.accumulate(micro)
    assert not st.apply(lr=1e-2).skipped and (st.skipped_steps, st.applied_steps) == (1, 1)
    assert st.params.tobytes() != before.tobytes()


def test_resume_through_optimizer_state_is_bitwise() -> None:
    """Six steps in one run == three steps, a checkpoint (adapter, optimizer state, applied steps), a fresh
    engine, three more steps: identical parameter and moment bytes."""
    rng = np.random.default_rng(10)
    w, loss_cfg = _weights(10), CASES[1]
    adapter = _adapter(rng)
    batches = [_batch(rng, loss_cfg.tau) for _ in range(6)]

    def run(st: NumpyEngine, steps: range) -> list[float]:
        losses = []
        for s in steps:
            _write(st, batches[s], loss_cfg)
            losses.append(st.train_step(lr=1e-2 * (1 - s / 6)).loss)
        return losses

    whole = _engine(w, loss_cfg)
    whole.set_adapter(adapter)
    losses = run(whole, range(6))
    first = _engine(w, loss_cfg)
    first.set_adapter(adapter)
    resumed_losses = run(first, range(3))
    saved = (first.get_adapter(), first.optimizer_state(), first.applied_steps)
    del first
    second = _engine(w, loss_cfg)
    second.set_adapter(saved[0])
    second.load_optimizer_state(saved[1], saved[2])
    resumed_losses += run(second, range(3, 6))
    assert resumed_losses == losses and losses[-1] < losses[0]
    assert second.params.tobytes() == whole.params.tobytes()
    for name in ("m", "v"):
        assert second.optimizer_state()[name].tobytes() == whole.optimizer_state()[name].tobytes()
    assert second.applied_steps == whole.applied_steps == 6


# ---------------------------------------------------------------- inputs


def test_from_gguf_matches_weights_dict(tmp_path) -> None:
    from model.gguf import llama_metadata, write_gguf

    rng = np.random.default_rng(11)
    w = _weights(11, Q.Q4_0)
    tensors = [(n, quantize(a, Q.Q4_0), Q.Q4_0) if a.ndim == 2 and n.startswith("blk.") else (n, a, Q.F32)
               for n, a in w.items()]  # fmt: skip
    write_gguf(tmp_path / "s.gguf", "llama", llama_metadata(CFG), tensors)
    loss_cfg, adapter, batch = CASES[0], _adapter(rng), _batch(rng, 1.0)
    kw = {"targets": LORA_TARGETS, "r": RANK, "alpha": SCALE * RANK, "batch": B, "seq_len": T, "layers": LAYERS}
    losses = []
    for st in (NumpyEngine.from_gguf(tmp_path / "s.gguf", NumpyKd(loss_cfg, K), **kw),
               NumpyEngine(w, EngineSpec(CFG, **kw), NumpyKd(loss_cfg, K))):  # fmt: skip
        st.set_adapter(adapter)
        _write(st, batch, loss_cfg)
        losses.append(st.loss_and_grads())
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="seq_len=65 exceeds"):
        NumpyEngine(w, EngineSpec(CFG, **{**kw, "seq_len": 65}), NumpyKd(loss_cfg, K))
    with pytest.raises(ValueError, match="missing blk.0.attn_q.weight"):
        partial = {n: a for n, a in w.items() if n != "blk.0.attn_q.weight"}
        NumpyEngine(partial, EngineSpec(CFG, **kw), NumpyKd(loss_cfg, K))


def test_bad_inputs_fail_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="train.precision: f32 or auto"):
        _engine(_weights(12), CASES[0], precision="tensorcore")
    st = _engine(_weights(12), CASES[0], precision="auto")
    batch = list(_batch(np.random.default_rng(12), 1.0))
    batch[3] = batch[3].copy()
    batch[3][0, 0, 0] = CFG.vocab
    with pytest.raises(ValueError, match=r"teacher ids outside the student's vocabulary \[0, 300\)"):
        _write(st, tuple(batch), CASES[0])
    with pytest.raises(RuntimeError, match="write_batch"):
        _engine(_weights(12), CASES[0]).train_step(lr=1e-3)


def test_satisfies_the_engine_protocol() -> None:
    from training.engine import Engine

    st = _engine(_weights(13), CASES[0])
    assert isinstance(st, Engine)
    slot = st.layout.slots[(LAYERS[0], "q")]
    assert (st.layout.r, slot.d_in, slot.d_out) == (RANK, CFG.hidden, CFG.q_dim)


FAMILY_CFGS = {
    "qwen2": {"arch": "qwen2", "rope_type": "neox", "qkv_bias": True},
    "qwen3": {"arch": "qwen3", "rope_type": "neox", "qk_norm": True},
    "llama3-rope": {"rope_freq_factors": tuple(1.0 + np.arange(CFG.head_dim // 2) / 4)},
}


@pytest.mark.parametrize("family", sorted(FAMILY_CFGS))
def test_other_families_match_float64_reference(family: str) -> None:
    """q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3), NEOX RoPE and Llama 3 frequency factors reach the
    engine through the reference's block ops (and their tensors through cpu/weights.py)."""
    from dataclasses import replace

    cfg = replace(CFG, **FAMILY_CFGS[family])
    rng = np.random.default_rng(14)
    w = R.random_weights(cfg, 14, np.float32)
    adapter, batch, loss_cfg = _adapter(rng), _batch(rng, 1.0), CASES[0]
    st = NumpyEngine(
        w,
        EngineSpec(
            cfg, targets=LORA_TARGETS, r=RANK, alpha=SCALE * RANK, batch=B, seq_len=T, layers=LAYERS, vocab_chunk=CHUNK
        ),
        NumpyKd(loss_cfg, K),
    )
    st.set_adapter(adapter)
    _write(st, batch, loss_cfg)
    loss = st.loss_and_grads()
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    lora64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    want_loss, want = R.loss_and_grads(w64, cfg, batch[0], lora64, SCALE, *batch[3:], batch[1], batch[2], loss_cfg)
    assert abs(loss - want_loss) / abs(want_loss) < REL
    assert _grad_errors(st.get_grads(), want) < REL


@pytest.mark.parametrize("family", ["llama", *sorted(FAMILY_CFGS)])
def test_cache_floats_counts_every_cached_array(family: str) -> None:
    """The activation budget's floats per row are what block_forward really keeps (qwen3: q0 and k0 too)."""
    from dataclasses import replace

    from cpu.engine import _cache_floats

    cfg = replace(CFG, **FAMILY_CFGS.get(family, {}))
    x = np.random.default_rng(15).standard_normal((B, T, cfg.hidden)).astype(np.float32)
    _, cache = R.block_forward(x, R.random_weights(cfg, 15, np.float32), cfg, 0, {}, SCALE)
    assert _cache_floats(cfg) == sum(a.size for a in cache.values()) // (B * T)


def test_cpu_engine_imports_nothing_of_the_gpu() -> None:
    """cpu/ reaches AdamWConfig and StepStats through schemas/optim.py, not gpu/ops/adamw.py (wgpu, the device)."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, cpu, cpu.engine; print(sorted(m for m in sys.modules if m.startswith(('gpu', 'wgpu'))))"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # the flat LoRA layout lives in model/ since it moved out of gpu/
