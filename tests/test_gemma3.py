"""gemma3 beyond the reference's own checks (tests/test_reference.py: finite differences of every new piece;
tests/test_families.py: HF transformers and peft as oracles): its config as read from GGUF metadata the way
llama.cpp reads it, the numpy engine (float32, batched, caches kept or recomputed, started from a frozen prefix)
against the float64 reference and the numpy teacher's top-k. The GPU side: tests/test_gpu_gemma3.py."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cpu import NumpyEngine
from cpu.objectives import NumpyKd
from model import reference as R
from model.config import LORA_TARGETS
from model.engine_spec import EngineSpec, KdBatch
from model.gguf import GGUFError, model_config, model_metadata, write_gguf
from model.kd import LossConfig, log_softmax
from model.teacher_cpu import reference_topk, reference_topk_batch
from tests.pipeline_fixtures import tokenizer_metadata
from training.prefix import numpy_prefix

B, T, K, RANK, SCALE = 2, 12, 8, 4, 2.0
REL = 2e-5  # float32 engine vs float64 reference (tests/test_numpy_engine.py's bound)


def _metadata(n_layers: int = 7, window: int | None = 5, **extra: object) -> dict[str, object]:
    """gemma3.* keys as convert_hf_to_gguf.py writes them, for a tiny model (hidden 32, 4 heads of 16) with the
    4B+ models' linear RoPE scaling (factor 8 on the global blocks)."""
    md: dict[str, object] = {
        "general.architecture": "gemma3",
        "gemma3.block_count": n_layers,
        "gemma3.embedding_length": 32,
        "gemma3.feed_forward_length": 64,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 2,
        "gemma3.attention.key_length": 16,
        "gemma3.attention.value_length": 16,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.context_length": 64,
        "gemma3.vocab_size": len(tokenizer_metadata()["tokenizer.ggml.tokens"]),
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
    }
    if window is not None:
        md["gemma3.attention.sliding_window"] = window
    md.update(extra)
    return md


CFG = model_config(_metadata())


def test_config_from_metadata_as_llama_cpp_reads_it() -> None:
    cfg = CFG
    assert (cfg.arch, cfg.rope_type, cfg.qk_norm, cfg.post_norms, cfg.activation) == (
        "gemma3", "neox", True, True, "gelu_tanh"
    )  # fmt: skip
    assert cfg.head_dim == 16 and cfg.q_dim == 64 != cfg.hidden and cfg.tied_embeddings
    assert cfg.embedding_scale == math.sqrt(32) and cfg.attention_scale == 1 / math.sqrt(16)
    # every sixth block (il % 6 == 5) global on rope.freq_base, the others sliding over 5 positions on base 10000
    assert cfg.attention_windows == (5, 5, 5, 5, 5, 0, 5)
    assert [cfg.rope_of(i)[0] for i in (0, 5, 6)] == [1e4, 1e6, 1e4]
    # linear scaling divides the global blocks' angles only (llama.cpp: rope_freq_scale_train_swa = 1)
    assert cfg.rope_scaling == "linear" and cfg.rope_of(5) == (1e6, (8.0,) * 8) and cfg.rope_of(0) == (1e4, None)
    assert model_metadata(cfg)["gemma3.attention.sliding_window"] == 5
    assert model_config(model_metadata(cfg)) == cfg
    unscaled = model_config(_metadata(**{"gemma3.rope.scaling.type": "none"}))
    assert unscaled.rope_linear_factor == 1.0 and unscaled.rope_of(5) == (1e6, None)
    with pytest.raises(GGUFError, match=r"key 'gemma3\.rope\.scaling\.type': value: rope scaling 'yarn'"):
        model_config(_metadata(**{"gemma3.rope.scaling.type": "yarn"}))
    # no window key (or 0): every block global, as llama.cpp then runs it
    plain = model_config(_metadata(window=None))
    assert plain.attention_windows == () and plain.rope_of(0)[0] == 1e6
    # the 27B (62 blocks) scales scores by (hidden / heads)^-0.5, as llama.cpp does
    assert model_config(_metadata(n_layers=62)).query_pre_attn_scalar == 32 // 4
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        with pytest.raises(GGUFError, match=f"key '{key}': value: logit soft-capping is not implemented"):
            model_config(_metadata(**{key: 30.0}), "g.gguf")
    with pytest.raises(ValueError, match="cannot say this config's attention_windows"):
        model_metadata(replace(cfg, attention_windows=(5,) * 7))


def _weights(seed: int) -> dict[str, np.ndarray]:
    return R.random_weights(CFG, seed, np.float32)


def _batch(rng: np.random.Generator) -> KdBatch:
    v = CFG.vocab
    ids = rng.integers(0, v, (B, T))
    targets = np.concatenate([ids[:, 1:], rng.integers(0, v, (B, 1))], axis=1)
    mask = (rng.random((B, T)) > 0.2).astype(np.uint8)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, v)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    top = np.take_along_axis(lp, tids, -1)
    tail = np.clip(1 - np.exp(top).sum(-1), 0, None)
    return KdBatch(ids, targets, mask, tids, top.astype(np.float32), tail.astype(np.float32))


def _adapter(rng: np.random.Generator, layers: tuple[int, ...]) -> dict[tuple[int, str], R.LoraPair]:
    init = R.init_lora(CFG, list(LORA_TARGETS), RANK, seed=5)
    return {
        key: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(np.float32))
        for key, p in init.items()
        if key[0] in layers
    }


def _engine(w: dict[str, np.ndarray], layers: tuple[int, ...], loss: LossConfig, **kw: object) -> NumpyEngine:
    budget = {"activation_budget": kw.pop("activation_budget")} if "activation_budget" in kw else {}
    spec = EngineSpec(CFG, tuple(LORA_TARGETS), RANK, SCALE * RANK, B, T, layers=layers, vocab_chunk=64, **kw)
    return NumpyEngine(w, spec, NumpyKd(loss, K), **budget)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


LAYERS = (3, 4, 5, 6)  # sliding blocks on both sides of the global block 5; the backward stops at block 3


def test_numpy_engine_matches_float64_reference() -> None:
    """Loss and every LoRA gradient of a batch, caches kept and recomputed (bitwise equal), then the evaluation;
    and the engine started at block 3 from numpy_prefix (the frozen-prefix cache) gives the same step."""
    rng = np.random.default_rng(0)
    w = _weights(1)
    adapter, batch = _adapter(rng, LAYERS), _batch(rng)
    loss_cfg = LossConfig("jsd", tau=2.0, beta=0.3, ce_weight=0.25, use_tail=True)
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    a64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    args = (batch.teacher_ids, batch.teacher_logprobs, batch.teacher_tail, batch.targets, batch.mask, loss_cfg)
    want_loss, want = R.loss_and_grads(w64, CFG, batch.ids, a64, SCALE, *args)
    runs = []
    for budget in (1 << 40, 0):
        engine = _engine(w, LAYERS, loss_cfg, activation_budget=budget)
        assert engine.keep_caches == (budget > 0)
        engine.set_adapter(adapter)
        engine.write_batch(batch)
        loss = engine.loss_and_grads()
        assert abs(loss - want_loss) <= REL * abs(want_loss)
        got = engine.get_grads()
        worst = max(max(_rel(got[key].A, da), _rel(got[key].B, db)) for key, (da, db) in want.items())
        assert worst <= REL, worst
        runs.append((loss, engine.grads.copy(), engine))
    assert runs[0][0] == runs[1][0] and runs[0][1].tobytes() == runs[1][1].tobytes()
    top1 = runs[0][2].evaluate_batch()["top1"]
    logits = R.forward(w64, CFG, batch.ids, a64, SCALE).reshape(B * T, -1)
    np.testing.assert_array_equal(top1, logits.argmax(axis=1))
    # from the frozen prefix: blocks 0..2 once, without LoRA, then the engine from block 3
    prefix = numpy_prefix(w, CFG, batch.ids, 3)
    started = _engine(w, LAYERS, loss_cfg, start_layer=3)
    started.set_adapter(adapter)
    started.write_batch(replace(batch, prefix=prefix))
    assert abs(started.loss_and_grads() - runs[0][0]) <= 1e-6 * abs(runs[0][0])
    assert _rel(started.grads, runs[0][1].astype(np.float64)) <= 1e-5


def test_gguf_numpy_engine_and_teacher(tmp_path: Path) -> None:
    """A gemma3 GGUF (Q8_0 projections) loads into NumpyEngine with the reader's config; the numpy teacher's
    batched top-k (float32) agrees with the per-sequence float64 reference."""
    w = _weights(2)
    path = tmp_path / "gemma3.gguf"
    meta = {**tokenizer_metadata(), **model_metadata(CFG, "tiny gemma3")}
    write_gguf(path, "gemma3", meta, ((n, a, Q.Q8_0 if a.ndim == 2 else Q.F32) for n, a in w.items()))
    engine = NumpyEngine.from_gguf(
        path, NumpyKd(LossConfig("forward_kl"), K), targets=("q", "down"), r=RANK, alpha=8.0, batch=1, seq_len=T
    )
    assert engine.cfg == CFG
    stored = {n: a.astype(np.float64) for n, a in engine.w.items()}
    ids = np.random.default_rng(3).integers(0, CFG.vocab, (3, T))
    got_ids, got_lp, got_tail = reference_topk_batch(stored, CFG, ids, K, 1.5, vocab_chunk=64)
    for s in range(3):
        want_ids, want_lp, want_tail = reference_topk(stored, CFG, ids[s], K, 1.5)
        np.testing.assert_array_equal(got_ids[s], want_ids)
        np.testing.assert_allclose(got_lp[s], want_lp, atol=1e-5)
        np.testing.assert_allclose(got_tail[s], want_tail, rtol=1e-4, atol=1e-7)
