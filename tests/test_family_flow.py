"""The model families through the CLI: a tiny random qwen3-shaped model (per-head q/k RMSNorm, NEOX RoPE, heads
wider than hidden / n_heads, untied head) through `distillery run` (tokenize, student, teacher, train, evaluate,
select, export) with the tiny llama's data and config; its PEFT adapter loads into HF transformers' Qwen3 model
built independently (module names and shapes), distillation lowers the held-out KL against a teacher that differs
from the student (the student is the teacher requantized to Q4_0), and the merged GGUF is still a qwen3. And
`distillery inspect` names the family and every family-specific setting of qwen2, qwen3 and Llama 3 models;
README's supported-models table names every family and tensor type the reader accepts."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file
from typer.testing import CliRunner

from flows.cli import app, console
from model import reference as R
from model.config import FAMILIES as ARCHITECTURES
from model.config import LORA_TARGETS, PEFT_MODULES
from model.gguf import check_model_file, model_metadata, write_gguf
from model.quant import SUPPORTED_TYPES
from tests.pipeline_fixtures import _prefect_harness, tiny_config, tokenizer_metadata  # noqa: F401 (fixture)
from tests.test_families import FAMILIES, write_family_gguf

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
VOCAB = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
# Qwen3's shape at toy size: 4 query heads of 32 over a hidden size of 64 (q_dim 128 != hidden), GQA 2:1.
QWEN3 = replace(FAMILIES["qwen3"].cfg, n_heads=4, n_kv_heads=2, head_dim=32, context_length=64, rope_base=1e6)


def _write_qwen3(path: Path) -> Path:
    weights = R.random_weights(QWEN3, seed=5, dtype=np.float32)
    meta = {**tokenizer_metadata(), **model_metadata(QWEN3, "tiny qwen3")}
    write_gguf(path, "qwen3", meta, ((n, w, Q.F32) for n, w in weights.items()))
    return path


def _hf_qwen3():
    """transformers' Qwen3ForCausalLM of QWEN3's shape (random weights): the oracle for HF module names."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**QWEN3.hf_shape()))


def _printed(output: str, label: str) -> Path:
    match = re.search(rf"^{label}: (\S+)$", output, re.MULTILINE)
    assert match, output
    return Path(match.group(1))


@pytest.mark.gpu
def test_qwen3_runs_through_the_cli_flow(prefect_harness: None, tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    teacher = _write_qwen3(tmp_path / "qwen3-f32.gguf")
    cfg = tiny_config(
        tmp_path / "run",
        model={"student": str(teacher), "teacher": str(teacher)},
        lora={"r": 4, "alpha": 8.0, "targets": list(LORA_TARGETS)},
        teacher={"shard_tokens": 1024},  # few teacher shards and one epoch: fewer tasks, the same flow
        train={"epochs": 1},
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["run", str(config)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output

    # every stage ran, and distillation lowered the held-out KL (before -> best epoch, as printed)
    ran = re.search(r"^ran: (.+)$", out, re.MULTILINE)
    assert ran, out
    stages = ran.group(1).split(", ")
    assert [s for s in stages if not s.startswith("teacher-shard-")] == [
        "tokenize", "student", "teacher-plan", "train-epoch-0", "evaluate-baseline", "evaluate-epoch-0", "export",
        "evaluate-merged",
    ]  # fmt: skip
    assert "teacher-shard-0" in stages
    kl = re.search(r"^KL ([0-9.]+) → ([0-9.]+) ", out, re.MULTILINE)
    assert kl and "(best)" in out, out
    before, after = float(kl.group(1)), float(kl.group(2))
    print(f"qwen3 CLI flow: held-out KL {before:.4f} -> {after:.4f}")
    assert after < before

    # the PEFT adapter: Qwen3's HF module names for all 7 projections of both blocks, loaded by peft into
    # transformers' own Qwen3ForCausalLM (a name or shape that does not fit is an unexpected key or an error)
    peft_dir = _printed(out, "PEFT adapter")
    adapter_cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    hf_names = [PEFT_MODULES[t].rsplit(".", 1)[-1] for t in LORA_TARGETS]
    assert adapter_cfg["target_modules"] == hf_names and adapter_cfg["r"] == 4
    saved = load_file(str(peft_dir / "adapter_model.safetensors"))
    modules = {k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in saved}
    assert modules == {f"model.layers.{i}.{PEFT_MODULES[t]}" for i in range(QWEN3.n_layers) for t in LORA_TARGETS}
    model = get_peft_model(_hf_qwen3(), LoraConfig.from_pretrained(str(peft_dir)))
    loaded = set_peft_model_state_dict(model, {k: torch.from_numpy(v) for k, v in saved.items()})
    assert loaded.unexpected_keys == [] and [k for k in loaded.missing_keys if "lora_" in k] == []
    back = get_peft_model_state_dict(model)
    assert set(back) == set(saved) and all(np.array_equal(back[k].numpy(), v) for k, v in saved.items())
    assert all(np.abs(v).max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained, not the zero init

    # the merged GGUF is the same qwen3 (family, shape, settings), and inspect says so
    merged = _printed(out, "merged GGUF")
    assert check_model_file(merged) == check_model_file(teacher)
    shown = runner.invoke(app, ["inspect", str(merged)])
    assert shown.exit_code == 0 and re.search(r"family\s+│\s+qwen3\s", shown.output), shown.output


@pytest.mark.gpu
def test_gemma3_runs_through_the_cli_flow(prefect_harness: None, tmp_path: Path) -> None:
    """The tiny gemma3 of tests/test_families.py (six blocks, five sliding over 4 of the 24 positions) through
    `distillery run`: numpy teacher, the GPU engine's f32 path for training and evaluation (train.backend gpu on
    lavapipe), Q4_0 student, two epochs; the held-out KL falls (0.0083 -> 0.0045 when written) and the merged GGUF
    is the same gemma3."""
    teacher = tmp_path / "gemma3-f32.gguf"
    write_family_gguf(teacher, FAMILIES["gemma3"], seed=6)
    cfg = tiny_config(
        tmp_path / "run",
        model={"student": str(teacher), "teacher": str(teacher)},
        lora={"r": 4, "alpha": 8.0, "targets": list(LORA_TARGETS)},
        teacher={"shard_tokens": 1024},
        optim={"lr": 2e-3, "warmup_steps": 2},
        train={"epochs": 2, "backend": "gpu"},
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["run", str(config)], terminal_width=200)
    assert result.exit_code == 0, result.output
    kl = re.search(r"^KL ([0-9.]+) → ([0-9.]+) ", result.output, re.MULTILINE)
    assert kl and "(best)" in result.output, result.output
    before, after = float(kl.group(1)), float(kl.group(2))
    print(f"gemma3 CLI flow: held-out KL {before:.4f} -> {after:.4f}")
    assert after < before
    merged = _printed(result.output, "merged GGUF")
    assert check_model_file(merged) == check_model_file(teacher)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3", "gemma3"])
def test_inspect_names_the_family_and_its_settings(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(path, FAMILIES[name], seed=3)
    monkeypatch.setattr(console, "width", 400)  # one line per row: nothing wrapped inside a cell
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^│ (\w+)\s+│ (.*?)\s*│$", result.output, re.MULTILINE)}
    assert rows["family"] == name and rows["architecture"] == FAMILIES[name].cfg.arch, rows
    settings = FAMILIES[name].cfg.settings()
    assert rows["settings"] == ", ".join(f"{k}={v}" for k, v in settings.items())
    expected = {
        "qwen2": {"qkv_bias": True, "qk_norm": False, "rope": "neox", "rope_scaling": "none", "qk_rows": "HF order"},
        "qwen3": {"qkv_bias": False, "qk_norm": True, "rope": "neox", "rope_scaling": "none", "qk_rows": "HF order"},
        "llama3": {"qkv_bias": False, "qk_norm": False, "rope": "norm", "rope_scaling": "llama3"},
        "gemma3": {
            "qk_norm": True,
            "rope": "neox",
            "post_norms": True,
            "activation": "gelu_tanh",
            "embedding_scale": 8.0,
            "attention": [4, 4, 4, 4, 4, 0],
            "rope_local_base": 10000.0,
            "rope_scaling": "linear",
            "qk_rows": "HF order",
        },
    }[name]
    assert {k: settings[k] for k in expected} == expected
    assert rows["tokenizer_pre"] == "gpt2"


def test_readme_table_lists_every_family_and_tensor_type() -> None:
    """README's supported-models table: a row per architecture the reader accepts, and the tensor types."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table, "no table under ## Supported models"
    body = "\n".join(table)
    for arch in ARCHITECTURES:
        assert f"`{arch}`" in body, arch
    for qtype in SUPPORTED_TYPES:
        assert re.search(rf"\b{qtype.name}\b", body), qtype.name
