"""The numpy reference on the real SmolLM2-135M-Instruct GGUF (dequantized to float32): greedy
"The capital of France is" -> " Paris". This checks the layer structure, the GGUF row order of Q/K with the
adjacent-pair RoPE, GQA and the tied lm_head on real weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model import reference as R
from model.config import ModelConfig
from model.gguf import GGUFFile
from model.tokenizer import GGUFTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Every tensor dequantized to float32 by our reader (model.gguf), and the config from its metadata."""
    with GGUFFile(smollm2_path) as f:
        return {name: f.tensor_f32(name) for name in f.tensors}, f.config()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> GGUFTokenizer:
    return load_tokenizer(smollm2_path)


def test_config(smollm2: tuple[dict[str, np.ndarray], ModelConfig]) -> None:
    weights, cfg = smollm2
    assert (cfg.n_layers, cfg.hidden, cfg.ffn, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab) == (
        30, 576, 1536, 9, 3, 64, 49152,
    )  # fmt: skip
    assert cfg.rope_base == 1e5 and abs(cfg.eps - 1e-5) < 1e-10 and cfg.tied_embeddings
    assert "output.weight" not in weights and weights["token_embd.weight"].shape == (49152, 576)
    assert weights["blk.0.attn_k.weight"].shape == (cfg.kv_dim, cfg.hidden)
    assert weights["blk.0.ffn_down.weight"].shape == (cfg.hidden, cfg.ffn)


def test_capital_of_france(smollm2: tuple[dict[str, np.ndarray], ModelConfig], tokenizer: GGUFTokenizer) -> None:
    weights, cfg = smollm2
    ids = tokenizer.encode("The capital of France is")
    logits = R.forward(weights, cfg, np.array(ids))
    assert logits.shape == (len(ids), cfg.vocab) and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    new = R.greedy_generate(weights, cfg, ids, 1)
    assert new[0] == int(np.argmax(logits[-1]))
    assert tokenizer.decode(new) == " Paris"
    # a confident answer, not a coin flip
    p = np.exp(R.log_softmax(logits[-1].astype(np.float64)))
    assert p[new[0]] > 0.3, p[new[0]]
