"""The PEFT export checked by its logits: HF transformers loads our tiny llama GGUF (un-permuting Q/K rows),
peft applies our adapter, and the result must equal model.reference.forward with the same adapter.

Needs the interop extra (torch, transformers, peft), which `make setup` installs: without it these tests fail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from transformers import modeling_gguf_pytorch_utils

from data import adapters as export
from data.adapters import export_peft, gguf_to_hf_rows
from model import reference as R
from model.gguf import GGUFFile, write_gguf
from tests.test_export import ALL, CFG, IDS, random_adapter, write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

R_RANK, ALPHA = 4, 8.0
# f32 through torch vs the float64 reference, logits of magnitude ~10 (measured max |diff| ~5e-6)
ATOL = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("hf")
    weights = write_tiny_gguf(folder / "tiny.gguf", CFG, seed=11)
    return folder, weights


def _hf_model(folder: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    return model.eval()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)[None]).logits[0].double().numpy()


def _with_adapter(folder: Path, peft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    model = peft.PeftModel.from_pretrained(_hf_model(folder, monkeypatch), peft_dir)
    return _logits(model.eval())


def _adapter64(adapter):
    return {k: R.LoraPair(A=p.A.astype(np.float64), B=p.B.astype(np.float64)) for k, p in adapter.items()}


def test_hf_loads_our_gguf_like_the_reference(base, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, weights = base
    err = np.abs(_logits(_hf_model(folder, monkeypatch)) - R.forward(weights, CFG, IDS)).max()
    print(f"HF base logits: max |err| {err:.2e}")
    assert err < ATOL, err


def test_peft_export_logits_match_reference(base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, weights = base
    adapter = random_adapter(CFG, R_RANK, seed=12, targets=ALL)
    export_peft(adapter, CFG, R_RANK, ALPHA, ALL, tmp_path / "peft", "tiny-random-llama")
    expect = R.forward(weights, CFG, IDS, _adapter64(adapter), ALPHA / R_RANK)
    moved = np.abs(expect - R.forward(weights, CFG, IDS)).max()
    err = np.abs(_with_adapter(folder, tmp_path / "peft", monkeypatch) - expect).max()
    print(f"PEFT logits: max |err| {err:.2e}, adapter moves them by {moved:.2f}")
    assert moved > 1.0 and err < ATOL, (err, moved)


def test_peft_export_on_some_layers(base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter on the top block only (lora.layers) exports as PEFT layers_to_transform and loads in HF."""
    folder, weights = base
    top = CFG.n_layers - 1
    adapter = {k: p for k, p in random_adapter(CFG, R_RANK, seed=13, targets=ALL).items() if k[0] == top}
    export_peft(adapter, CFG, R_RANK, ALPHA, ALL, tmp_path / "peft", "tiny-random-llama", layers=[top])
    expect = R.forward(weights, CFG, IDS, _adapter64(adapter), ALPHA / R_RANK)
    moved = np.abs(expect - R.forward(weights, CFG, IDS)).max()
    err = np.abs(_with_adapter(folder, tmp_path / "peft", monkeypatch) - expect).max()
    assert moved > 0.1 and err < ATOL, (err, moved)


def test_export_without_the_row_fix_is_caught(base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving lora_B of q/k in GGUF row order gives visibly wrong logits: the check above can fail."""
    folder, weights = base
    adapter = random_adapter(CFG, R_RANK, seed=12, targets=ALL)
    monkeypatch.setattr(export, "gguf_to_hf_rows", lambda rows, n_head: rows)
    export_peft(adapter, CFG, R_RANK, ALPHA, ALL, tmp_path / "peft", "tiny-random-llama")
    expect = R.forward(weights, CFG, IDS, _adapter64(adapter), ALPHA / R_RANK)
    err = np.abs(_with_adapter(folder, tmp_path / "peft", monkeypatch) - expect).max()
    print(f"without the q/k row fix: max |err| {err:.2f}")
    assert err > 1000 * ATOL, err


def test_row_order_matches_transformers_gguf_loader() -> None:
    # the pinned transformers (pyproject's interop extra) un-permutes llama Q/K rows with this method
    processor = modeling_gguf_pytorch_utils.LlamaTensorProcessor
    rng = np.random.default_rng(0)
    for target, heads in (("q", CFG.n_heads), ("k", CFG.n_kv_heads)):
        rows = rng.standard_normal((CFG.target_shape(target)[0], 3))
        theirs = processor()._reverse_permute_weights(rows, CFG.n_heads, heads)
        assert np.array_equal(gguf_to_hf_rows(rows, heads), theirs), target


@pytest.mark.slow
def test_peft_export_on_smollm2(smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real model (9 query / 3 kv heads of 64, Q4_1 dequantized by both sides): HF + PEFT logits equal
    the f32 reference with the adapter (tolerance 5e-4; measured 7e-5; the adapter moves them by 1.3)."""
    with GGUFFile(smollm2_path) as f:
        cfg, weights = f.config(), {n: f.tensor_f32(n) for n in f.tensors}
        # the same model without its tokenizer arrays: transformers' GGUF reader parses 49152 strings slowly
        metadata = {k: v for k, v in f.metadata.items() if not k.startswith("tokenizer.")}
        raw = ((i.name, r.reshape(*i.shape[:-1], -1), i.ggml_type) for i, r in f.iter_tensors())
        write_gguf(tmp_path / "smollm2.gguf", "llama", metadata, raw, metadata_types=f.metadata_types)
    adapter = R.init_lora(cfg, ALL, r=R_RANK, seed=0)
    rng = np.random.default_rng(0)
    for pair in adapter.values():
        pair.B[...] = rng.standard_normal(pair.B.shape).astype(np.float32) * np.float32(0.02)
    export_peft(adapter, cfg, R_RANK, ALPHA, ALL, tmp_path / "peft", "HuggingFaceTB/SmolLM2-135M-Instruct")
    ids = np.array([504, 3575, 282, 4649, 314, 1, 17, 300])
    expect = R.forward(weights, cfg, ids, adapter, ALPHA / R_RANK)
    moved = np.abs(expect - R.forward(weights, cfg, ids)).max()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path, gguf_file="smollm2.gguf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, tmp_path / "peft").eval()
    with torch.no_grad():
        got = model(torch.tensor(ids)[None]).logits[0].double().numpy()
    err = np.abs(got - expect).max()
    print(f"SmolLM2 PEFT logits: max |err| {err:.2e}, adapter moves them by {moved:.2f}")
    assert moved > 1.0 and err < 5e-4, (err, moved)
