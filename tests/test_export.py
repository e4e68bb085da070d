"""Exports: Q/K row permutation, PEFT keys/config, GGUF LoRA read back, merged GGUF logits vs reference."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from data.adapters import (
    ExportError,
    export_gguf_lora,
    export_peft,
    gguf_to_hf_rows,
    hf_to_gguf_rows,
    merge_adapter,
    peft_key,
)
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.gguf import GGUFFile, write_gguf
from model.gguf import llama_metadata as gguf_llama_metadata

# ffn 256: ffn_down rows are one K-quant super-block long; every other row length is 64 (Q4_0, not Q4_K)
CFG = ModelConfig(n_layers=2, hidden=64, ffn=256, n_heads=4, n_kv_heads=2, vocab=96, context_length=64)
ALL = tuple(LORA_TARGETS)
IDS = np.array([1, 17, 5, 90, 33, 2, 64, 8, 41, 0])


def llama_metadata(cfg: ModelConfig) -> dict:
    """The llama.* keys model_config (and transformers' GGUF loader) read."""
    return gguf_llama_metadata(cfg, name="tiny random llama")


def write_tiny_gguf(
    path: Path, cfg: ModelConfig, seed: int, qtype: Callable[[str, np.ndarray], int] = lambda n, w: Q.F32
) -> dict[str, np.ndarray]:
    """A random-weight llama GGUF; 2-D tensors get qtype(name, w), 1-D ones F32. Returns the weights as
    stored (dequantized back to float64), i.e. what a reader of the file computes with."""
    weights = R.random_weights(cfg, seed=seed, dtype=np.float32)
    write_gguf(
        path,
        "llama",
        llama_metadata(cfg),
        ((n, w, qtype(n, w) if w.ndim == 2 else Q.F32) for n, w in weights.items()),
    )
    with GGUFFile(path) as f:
        return {n: f.tensor_f32(n).astype(np.float64) for n in f.tensors}


def random_adapter(cfg: ModelConfig, r: int, seed: int, targets=ALL) -> dict[tuple[int, str], R.LoraPair]:
    """PEFT-initialised A and a random non-zero B, big enough to move the logits by O(1)."""
    adapter = R.init_lora(cfg, targets, r=r, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for pair in adapter.values():
        pair.B[...] = rng.standard_normal(pair.B.shape).astype(np.float32) * np.float32(0.2)
    return adapter


def _as64(adapter: Mapping[tuple[int, str], R.LoraPair]) -> dict[tuple[int, str], R.LoraPair]:
    return {k: R.LoraPair(A=p.A.astype(np.float64), B=p.B.astype(np.float64)) for k, p in adapter.items()}


# ---------------------------------------------------------------- Q/K row order


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, transliterated (numpy for torch)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_row_permutation_by_hand() -> None:
    # GGUF (adjacent-pair RoPE) pair i of a head is HF (rotate-half) rows (i, i + D/2)
    assert hf_to_gguf_rows(np.arange(4), 1).tolist() == [0, 2, 1, 3]
    assert hf_to_gguf_rows(np.arange(6), 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert hf_to_gguf_rows(np.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert gguf_to_hf_rows(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist() == list(range(8))
    assert gguf_to_hf_rows(np.array([0, 3, 1, 4, 2, 5]), 1).tolist() == list(range(6))
    with pytest.raises(ExportError, match="heads of an even size"):
        gguf_to_hf_rows(np.zeros((12, 2)), 4)


@pytest.mark.parametrize("target", ["q", "k"])
def test_row_permutation_matches_llama_cpp_and_inverts(target: str) -> None:
    n_out, _ = CFG.target_shape(target)
    n_head = CFG.n_heads if target == "q" else CFG.n_kv_heads
    b = np.random.default_rng(0).standard_normal((n_out, 3))
    gguf_b = hf_to_gguf_rows(b, n_head)
    # llama.cpp is called with (n_head, n_head) for q and (n_head, n_kv_head) for k
    assert np.array_equal(gguf_b, _llama_cpp_permute(b, CFG.n_heads, n_head))
    assert not np.array_equal(gguf_b, b)
    assert np.array_equal(gguf_to_hf_rows(gguf_b, n_head), b)
    assert np.array_equal(hf_to_gguf_rows(gguf_to_hf_rows(b, n_head), n_head), b)


def _rope_rotate_half(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """HF llama RoPE: x [T, H, D], rotates (x[i], x[i + D/2]) by pos * base^(-2i/D)."""
    d = x.shape[-1]
    cos, sin = R.rope_cos_sin(positions, d, base, x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_row_permutation_maps_llama_cpp_rope_onto_hf_rope() -> None:
    """rows(W_gguf) un-permuted give HF weights whose rotate-half RoPE equals our adjacent-pair RoPE."""
    t, h, d = 5, CFG.n_heads, CFG.head_dim
    rng = np.random.default_rng(1)
    w_gguf, x = rng.standard_normal((h * d, CFG.hidden)), rng.standard_normal((t, CFG.hidden))
    pos = np.arange(t)
    q_gguf = R.rope_forward((x @ w_gguf.T).reshape(t, h, d), pos, CFG.rope_base)
    q_hf = _rope_rotate_half((x @ gguf_to_hf_rows(w_gguf, h).T).reshape(t, h, d), pos, CFG.rope_base)
    # the same rotated features, in each convention's order
    np.testing.assert_allclose(gguf_to_hf_rows(q_gguf.reshape(t, h * d).T, h).T, q_hf.reshape(t, h * d), atol=1e-12)


# ---------------------------------------------------------------- PEFT


def test_peft_keys_shapes_config(tmp_path: Path) -> None:
    r, alpha = 4, 8.0
    adapter = random_adapter(CFG, r, seed=0)
    weights_path, config_path = export_peft(adapter, CFG, r, alpha, ALL, tmp_path / "peft", "tiny/llama")
    tensors = load_file(weights_path)
    assert len(tensors) == 2 * CFG.n_layers * len(ALL)
    for (layer, t), pair in adapter.items():
        a, b = tensors[peft_key(layer, t, "A")], tensors[peft_key(layer, t, "B")]
        n_out, n_in = CFG.target_shape(t)
        assert a.shape == (r, n_in) and b.shape == (n_out, r) and a.dtype == b.dtype == np.float32
        assert np.array_equal(a, pair.A)
        if t in ("q", "k"):
            heads = CFG.n_heads if t == "q" else CFG.n_kv_heads
            assert not np.array_equal(b, pair.B) and np.array_equal(hf_to_gguf_rows(b, heads), pair.B)
        else:
            assert np.array_equal(b, pair.B)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in tensors
    cfg = json.loads(config_path.read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["bias"]) == (r, alpha, 0.0, "none")
    assert cfg["fan_in_fan_out"] is False and cfg["base_model_name_or_path"] == "tiny/llama"
    assert cfg["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]


def test_peft_rejects_adapters_that_do_not_fit(tmp_path: Path) -> None:
    adapter = random_adapter(CFG, 4, seed=0, targets=("q", "v"))
    with pytest.raises(ExportError, match="r: 8, but the adapter has rank 4"):
        export_peft(adapter, CFG, 8, 16.0, ("q", "v"), tmp_path, "x")
    with pytest.raises(ExportError, match=r"targets \['v'\] not in"):
        export_peft(adapter, CFG, 4, 8.0, ("q",), tmp_path, "x")
    del adapter[(1, "v")]
    with pytest.raises(ExportError, match=r"target 'v': no adapter for layers \[1\]"):
        export_peft(adapter, CFG, 4, 8.0, ("q", "v"), tmp_path, "x")
    adapter[(1, "v")] = R.LoraPair(A=np.zeros((4, 64), np.float32), B=np.zeros((64, 4), np.float32))
    with pytest.raises(ExportError, match=r"pair \(1, 'v'\): shape"):
        export_peft(adapter, CFG, 4, 8.0, ("q", "v"), tmp_path, "x")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- GGUF LoRA


def test_gguf_lora_reads_back(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    write_tiny_gguf(base, CFG, seed=0)
    adapter = random_adapter(CFG, 4, seed=2, targets=("q", "k", "down"))
    out = export_gguf_lora(adapter, base, alpha=8.0, out_path=tmp_path / "lora.gguf")
    with GGUFFile(out) as f:
        assert f.metadata["general.type"] == "adapter" and f.metadata["adapter.type"] == "lora"
        assert f.metadata["adapter.lora.alpha"] == 8.0 and f.metadata["general.architecture"] == "llama"
        assert len(f.tensors) == 2 * len(adapter)
        for (layer, t), pair in adapter.items():
            stem = f"blk.{layer}.{LORA_TARGETS[t]}.weight"
            n_out, n_in = CFG.target_shape(t)
            a, b = f.info(f"{stem}.lora_a"), f.info(f"{stem}.lora_b")
            assert a.ne == (n_in, 4) and b.ne == (4, n_out) and a.type_name == b.type_name == "F32"
            assert np.array_equal(f.tensor_f32(a.name), pair.A)  # GGUF row order kept
            assert np.array_equal(f.tensor_f32(b.name), pair.B)
    bad = {(0, "q"): R.LoraPair(A=np.zeros((4, 32), np.float32), B=np.zeros((64, 4), np.float32))}
    with pytest.raises(ExportError, match=r"lora2.gguf: pair \(0, 'q'\): shape"):
        export_gguf_lora(bad, base, 8.0, tmp_path / "lora2.gguf")


# ---------------------------------------------------------------- merge


def _base_logits(weights: Mapping[str, np.ndarray], adapter=None, scale: float = 1.0) -> np.ndarray:
    return R.forward(weights, CFG, IDS, None if adapter is None else _as64(adapter), scale)


def _merged_weights(path: Path) -> dict[str, np.ndarray]:
    with GGUFFile(path) as f:
        return {n: f.tensor_f32(n).astype(np.float64) for n in f.tensors}


def _assert_copied(base: Path, merged: Path, adapted: set[str]) -> None:
    with GGUFFile(base) as a, GGUFFile(merged) as b:
        assert a.metadata == b.metadata and list(a.tensors) == list(b.tensors)
        for name, info in a.tensors.items():
            if name not in adapted:
                assert b.info(name).ggml_type == info.ggml_type
                assert np.array_equal(b.raw(name), a.raw(name)), name


def test_merge_f32_matches_forward_with_adapter(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    weights = write_tiny_gguf(base, CFG, seed=3)
    adapter, scale = random_adapter(CFG, 4, seed=4), 2.0
    report = merge_adapter(base, adapter, scale, tmp_path / "merged.gguf")
    expect = _base_logits(weights, adapter, scale)
    got = R.forward(_merged_weights(tmp_path / "merged.gguf"), CFG, IDS)
    moved = np.abs(expect - _base_logits(weights)).max()
    err = np.abs(got - expect).max()
    assert moved > 0.5, moved  # the adapter matters ...
    assert err < 2e-5, err  # ... and the merge reproduces it up to f32 rounding of W + s B A
    adapted = {f"blk.{layer}.{LORA_TARGETS[t]}.weight" for layer, t in adapter}
    assert set(report["tensors"]) == adapted and report["merged"] == len(adapted)
    assert report["error_max"] < 1e-6 < report["delta_rms"]
    _assert_copied(base, tmp_path / "merged.gguf", adapted)


def _student_types(name: str, w: np.ndarray) -> int:
    return Q.Q6_K if name.endswith("ffn_down.weight") else Q.Q8_0


def test_merge_quantized_keeps_types_and_tracks_the_adapter(tmp_path: Path) -> None:
    """Requantized merge (each tensor's own type: Q8_0, ffn_down Q6_K). Tolerance: the max logit error is at
    most 1.5x what quantizing the f32 model once costs (the merge requantizes once more; measured 0.24 vs
    0.29), while the adapter moves the logits by ~8."""
    base = tmp_path / "base.gguf"
    weights = write_tiny_gguf(base, CFG, seed=5, qtype=_student_types)
    f32 = {n: w.astype(np.float64) for n, w in R.random_weights(CFG, seed=5, dtype=np.float32).items()}
    one_quantization = np.abs(_base_logits(f32) - _base_logits(weights)).max()
    adapter, scale = random_adapter(CFG, 4, seed=6, targets=("q", "k", "o", "down")), 2.0
    report = merge_adapter(base, adapter, scale, tmp_path / "merged.gguf")
    expect = _base_logits(weights, adapter, scale)
    moved = np.abs(expect - _base_logits(weights)).max()
    err = np.abs(R.forward(_merged_weights(tmp_path / "merged.gguf"), CFG, IDS) - expect).max()
    assert moved > 20 * one_quantization and 0 < err < 1.5 * one_quantization, (err, one_quantization, moved)
    with GGUFFile(tmp_path / "merged.gguf") as f:
        for name, stats in report["tensors"].items():
            assert stats["type"] == f.info(name).type_name == ("Q6_K" if "ffn_down" in name else "Q8_0")
            assert 0 < stats["error_rms"] < stats["delta_rms"]
    _assert_copied(base, tmp_path / "merged.gguf", set(report["tensors"]))


def test_merge_to_given_types(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    write_tiny_gguf(base, CFG, seed=7, qtype=_student_types)
    adapter = random_adapter(CFG, 2, seed=8, targets=("v", "down"))
    report = merge_adapter(base, adapter, 1.0, tmp_path / "m.gguf", quant=["Q4_K", "Q4_0"])
    with GGUFFile(tmp_path / "m.gguf") as f:
        for layer in range(CFG.n_layers):
            assert f.info(f"blk.{layer}.ffn_down.weight").type_name == "Q4_K"  # rows of 256
            assert f.info(f"blk.{layer}.attn_v.weight").type_name == "Q4_0"  # rows of 64
            assert f.info(f"blk.{layer}.attn_q.weight").type_name == "Q8_0"  # not adapted: copied
    assert report["error_rms"] > 0
    _assert_copied(base, tmp_path / "m.gguf", set(report["tensors"]))
    with pytest.raises(ExportError, match=r"m2.gguf: tensor 'blk.0.attn_v.weight': type: row length 64"):
        merge_adapter(base, adapter, 1.0, tmp_path / "m2.gguf", quant=["Q4_K"])
    assert not (tmp_path / "m2.gguf").exists()
