"""Model families against an independent oracle: tiny random llama (with Llama 3 RoPE scaling), mistral, qwen2 and
qwen3 models written as GGUF by our writer and loaded by HF transformers (its own GGUF reader and modeling code).

Checked per family: the config read back from the file; the logits of HF and of model.reference (float32, 1e-4
relative); the PEFT export (HF + peft logits, and the LoRA gradients of torch autograd through peft against our
hand-written backward, which proves the q/k row order per family); the GGUF LoRA names and the merged GGUF; the
refusals (unsupported architecture, tokenizer, quant type, stray tensor) in model.gguf.check_model_file and the
preflight. Needs the interop extra (torch, transformers, peft): without it these tests fail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from data.adapters import export_gguf_lora, export_peft, gguf_to_hf_rows, merge_adapter, peft_key
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.gguf import (
    GGUFError,
    GGUFFile,
    check_model_file,
    describe,
    family_name,
    llama3_rope_factors,
    model_metadata,
    write_gguf,
)
from model.kd import LossConfig
from schemas.config import RunConfig
from stages.inputs import InputError, check_inputs
from tests.pipeline_fixtures import tiny_config, tokenizer_metadata

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
IDS = np.array([1, 17, 5, 90, 33, 2, 64, 8, 41, 0, 200, 150])
REL_TOL = 1e-4  # float32 HF vs float64 reference, relative to the largest |logit| / |gradient|
RANK, ALPHA = 4, 8.0
ALL = tuple(LORA_TARGETS)
# Llama 3 RoPE scaling shrunk to the tiny model: with base 100 and an original context of 64, two frequencies
# stay, three are blended and three are divided by 8, so positions 0..11 see the scaling.
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class Family:
    """A tiny model of one family: its config, the general.name written (transformers tells mistral from llama by
    it) and the rope_parameters transformers needs but does not read from a GGUF (Llama 3 scaling)."""

    cfg: ModelConfig
    general_name: str
    hf_rope: dict | None = None
    hf_config: dict | None = None  # config attributes the GGUF loader does not read (gemma3's attention scalar)


def _llama3_factors() -> tuple[float, ...]:
    s = LLAMA3_SCALING
    factors = llama3_rope_factors(
        16, 100.0, s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    )
    return tuple(float(f) for f in factors)


_BASE = {"n_layers": 2, "hidden": 64, "ffn": 128, "vocab": VOCAB, "context_length": 128}
FAMILIES = {
    "llama3": Family(
        ModelConfig(**_BASE, n_heads=4, n_kv_heads=2, rope_base=100.0, rope_freq_factors=_llama3_factors()),
        "tiny llama 3",
        {"rope_type": "llama3", "rope_theta": 100.0, **LLAMA3_SCALING},
    ),
    # Mistral 7B's shape (GQA 4:1, untied head, base 1e6) in its GGUF form: llama arch, told apart by general.name.
    # transformers would build MistralForCausalLM for general.name == "mistral" exactly, but that path fails with
    # gguf-py 0.19 (no "mistral" in MODEL_ARCH_NAMES), so it loads as llama, which is what llama.cpp runs too.
    "mistral": Family(
        ModelConfig(**_BASE, n_heads=4, n_kv_heads=1, rope_base=1e6, tied_embeddings=False), "tiny mistral"
    ),
    "qwen2": Family(
        ModelConfig(**_BASE, n_heads=4, n_kv_heads=2, eps=1e-6, arch="qwen2", rope_type="neox", qkv_bias=True),
        "tiny qwen2",
    ),
    # transformers' GGUF loader ignores qwen3.attention.key_length and takes Qwen3Config's head_dim = 128 (as the
    # real Qwen3 models have), so the tiny model has heads of 128 (q_dim 256 != hidden 64)
    "qwen3": Family(
        ModelConfig(
            **{**_BASE, "n_heads": 2, "n_kv_heads": 1, "head_dim": 128},
            eps=1e-6,
            arch="qwen3",
            rope_type="neox",
            qk_norm=True,
            tied_embeddings=False,
        ),
        "tiny qwen3",
    ),
    # six blocks: 0-4 slide over 4 positions (RoPE base 10000), block 5 is global (base 1e6); head_dim 32 != 64 / 4.
    # transformers' GGUF loader keeps Gemma3TextConfig's query_pre_attn_scalar = 256 (the real 1B/270M head_dim):
    # it is set to what llama.cpp uses, head_dim, as our reader does.
    "gemma3": Family(
        ModelConfig(
            **{**_BASE, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32},
            rope_base=1e6,
            eps=1e-6,
            arch="gemma3",
            rope_type="neox",
            qk_norm=True,
            activation="gelu_tanh",
            embedding_scale=8.0,
            attention_windows=(4, 4, 4, 4, 4, 0),
            post_norms=True,
            rope_local_base=10000.0,
            query_pre_attn_scalar=32.0,
            rope_linear_factor=8.0,
        ),
        "tiny gemma3",
        # nor rope.scaling: the 4B+ models' linear scaling of the global blocks, set as their config.json has it
        hf_config={
            "query_pre_attn_scalar": 32,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}
NAMES = list(FAMILIES)


def write_family_gguf(path: Path, family: Family, seed: int, qtype: int = Q.F32) -> dict[str, np.ndarray]:
    """A random model of `family` with the tiny tokenizer; 2-D weights as `qtype`, the rest F32. Returns the
    weights as stored (read back, float64)."""
    cfg = family.cfg
    weights = R.random_weights(cfg, seed=seed, dtype=np.float32)
    meta = {**tokenizer_metadata(), **model_metadata(cfg, family.general_name)}
    write_gguf(path, cfg.arch, meta, ((n, w, qtype if w.ndim == 2 else Q.F32) for n, w in weights.items()))
    with GGUFFile(path) as f:
        return {n: f.tensor_f32(n).astype(np.float64) for n in f.tensors}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    """name -> (folder holding model.gguf, its weights)."""
    out = {}
    for i, (name, family) in enumerate(FAMILIES.items()):
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, write_family_gguf(folder / "model.gguf", family, seed=20 + i)
    return out


def _hf_model(folder: Path, family: Family, monkeypatch: pytest.MonkeyPatch, gguf: str = "model.gguf"):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {}
    if family.hf_rope is not None or family.hf_config is not None:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=gguf)
        if family.hf_rope is not None:
            config.rope_parameters = dict(family.hf_rope)
        for key, value in (family.hf_config or {}).items():
            setattr(config, key, value)
        kwargs["config"] = config
    auto = transformers.AutoModelForCausalLM
    return auto.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32, **kwargs).eval()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)[None]).logits[0].double().numpy()


def _rel(got: np.ndarray, expect: np.ndarray) -> float:
    return float(np.abs(got - expect).max() / np.abs(expect).max())


def random_adapter(cfg: ModelConfig, seed: int, dtype: type = np.float64) -> dict[tuple[int, str], R.LoraPair]:
    """PEFT-initialised A and a random B big enough to move the logits by O(1), on all 7 projections."""
    adapter = R.init_lora(cfg, ALL, r=RANK, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for pair in adapter.values():
        pair.B = (0.2 * rng.standard_normal(pair.B.shape)).astype(np.float32).astype(dtype)
    return adapter


# ---------------------------------------------------------------- the model description


@pytest.mark.parametrize("name", NAMES)
def test_config_read_back(models, name: str) -> None:
    folder, _ = models[name]
    cfg = check_model_file(folder / "model.gguf")
    assert cfg == FAMILIES[name].cfg
    with GGUFFile(folder / "model.gguf") as f:
        assert family_name(cfg, f.metadata) == name
    settings = cfg.settings()
    assert settings["rope"] == ("neox" if name.startswith(("qwen", "gemma")) else "norm")
    assert settings["rope_scaling"] == {"llama3": "llama3", "gemma3": "linear"}.get(name, "none")
    assert (settings["qkv_bias"], settings["qk_norm"]) == (name == "qwen2", name in ("qwen3", "gemma3"))
    gemma = name == "gemma3"
    assert (settings["post_norms"], settings["activation"]) == (gemma, "gelu_tanh" if gemma else "silu")
    info = describe(folder / "model.gguf")  # what `distillery inspect` prints
    assert info["family"] == name and info["settings"] == settings and "config_error" not in info


# ---------------------------------------------------------------- logits: HF transformers vs the reference


@pytest.mark.parametrize("name", NAMES)
def test_hf_logits_match_reference(models, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, weights = models[name]
    family = FAMILIES[name]
    model = _hf_model(folder, family, monkeypatch)
    expect = R.forward(weights, family.cfg, IDS)
    err = _rel(_logits(model), expect)
    print(f"{name}: {type(model).__name__} logits vs reference: max rel err {err:.2e}")
    assert err < REL_TOL, err
    assert type(model).__name__ == {"mistral": "LlamaForCausalLM", "llama3": "LlamaForCausalLM"}.get(
        name, f"{name.capitalize()}ForCausalLM"
    )


def test_family_settings_matter(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: dropping Llama 3 scaling, the NEOX pairs, the q/k/v biases or the q/k norm
    each moves the reference logits far outside the tolerance."""
    changes = [
        ("llama3", {"rope_freq_factors": None}),
        ("qwen2", {"rope_type": "norm"}),
        ("qwen3", {"qk_norm": False}),
        ("gemma3", {"qk_norm": False}),
        ("gemma3", {"post_norms": False}),
        ("gemma3", {"activation": "silu"}),
        ("gemma3", {"embedding_scale": 1.0}),
        ("gemma3", {"query_pre_attn_scalar": 256.0}),
        ("gemma3", {"attention_windows": ()}),  # every block global
        ("gemma3", {"attention_windows": (4,) * 6}),  # block 5 sliding too
        ("gemma3", {"rope_local_base": 0.0}),  # the sliding blocks on the global base
        ("gemma3", {"rope_linear_factor": 1.0}),  # the global block unscaled
    ]
    for name, change in changes:
        _, weights = models[name]
        cfg = FAMILIES[name].cfg
        err = _rel(R.forward(weights, replace(cfg, **change), IDS), R.forward(weights, cfg, IDS))
        assert err > 100 * REL_TOL, (name, change, err)
    _, weights = models["qwen2"]
    no_bias = {n: w for n, w in weights.items() if not n.endswith(".bias")}
    cfg = replace(FAMILIES["qwen2"].cfg, qkv_bias=False)
    assert _rel(R.forward(no_bias, cfg, IDS), R.forward(weights, FAMILIES["qwen2"].cfg, IDS)) > 100 * REL_TOL
    # and transformers without the rope_parameters the GGUF cannot carry is not the same model
    folder, weights = models["llama3"]
    plain = _hf_model(folder, replace(FAMILIES["llama3"], hf_rope=None), monkeypatch)
    assert _rel(_logits(plain), R.forward(weights, FAMILIES["llama3"].cfg, IDS)) > 100 * REL_TOL
    folder, weights = models["gemma3"]
    plain = _hf_model(folder, replace(FAMILIES["gemma3"], hf_config=None), monkeypatch)  # scalar 256
    assert _rel(_logits(plain), R.forward(weights, FAMILIES["gemma3"].cfg, IDS)) > 100 * REL_TOL


# ---------------------------------------------------------------- PEFT export: logits and gradients


def _teacher(cfg: ModelConfig, seed: int, k: int = 6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random teacher top-k ids [T, k], log-probs [T, k] and a loss mask [T]."""
    rng = np.random.default_rng(seed)
    z = 2 * rng.standard_normal((len(IDS), cfg.vocab))
    ids = np.argsort(-z, axis=1)[:, :k]
    lp = np.take_along_axis(R.log_softmax(z), ids, axis=1)
    mask = (rng.random(len(IDS)) < 0.8).astype(np.float64)
    mask[-1] = 1
    return ids, lp, mask


def _torch_forward_kl(logits: torch.Tensor, ids: np.ndarray, lp: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """Forward KL over the teacher's top-k (teacher renormalised, student not; tau = 1), mean over the mask:
    the same loss as LossConfig('forward_kl'), written independently in torch."""
    lq = torch.log_softmax(logits.double(), dim=-1).gather(-1, torch.tensor(ids))
    p = torch.softmax(torch.tensor(lp), dim=-1)
    per_row = (p * (torch.log(p) - lq)).sum(-1)
    m = torch.tensor(mask)
    return (per_row * m).sum() / m.sum()


@pytest.mark.parametrize("name", NAMES)
def test_peft_logits_and_grads_match_reference(
    models, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, weights = models[name]
    family = FAMILIES[name]
    cfg, scale = family.cfg, ALPHA / RANK
    adapter = random_adapter(cfg, seed=30)
    export_peft(adapter, cfg, RANK, ALPHA, ALL, tmp_path / "peft", f"tiny-{name}")
    model = peft.PeftModel.from_pretrained(_hf_model(folder, family, monkeypatch), tmp_path / "peft", is_trainable=True)
    model.eval()
    # every exported key is one of transformers' own modules of this family (none unexpected, none missing)
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    loaded = peft.set_peft_model_state_dict(model, {k: torch.from_numpy(v) for k, v in saved.items()})
    assert loaded.unexpected_keys == [] and [k for k in loaded.missing_keys if "lora_" in k] == []
    assert len(saved) == 2 * len(ALL) * cfg.n_layers

    # logits
    expect = R.forward(weights, cfg, IDS, adapter, scale)
    moved = np.abs(expect - R.forward(weights, cfg, IDS)).max()
    logits = model(torch.tensor(IDS)[None]).logits[0]
    err = _rel(logits.detach().double().numpy(), expect)
    assert moved > 1.0 and err < REL_TOL, (err, moved)

    # gradients: torch autograd through peft vs the hand-written backward
    t_ids, t_lp, mask = _teacher(cfg, seed=31)
    _torch_forward_kl(logits, t_ids, t_lp, mask).backward()
    params = dict(model.named_parameters())
    loss_cfg = LossConfig("forward_kl", tau=1.0)
    _, grads = R.loss_and_grads(weights, cfg, IDS, adapter, scale, t_ids, t_lp, None, IDS, mask, loss_cfg)
    worst = 0.0
    for (layer, target), (da, db) in grads.items():
        if target in ("q", "k") and cfg.qk_rows_permuted:
            db = gguf_to_hf_rows(db, cfg.n_heads if target == "q" else cfg.n_kv_heads)
        for which, ours in (("A", da), ("B", db)):
            key = peft_key(layer, target, which).replace(f"lora_{which}.weight", f"lora_{which}.default.weight")
            theirs = params[key].grad.double().numpy()
            rel = _rel(theirs, ours)
            assert rel < REL_TOL, (layer, target, which, rel)
            worst = max(worst, rel)
    print(f"{name}: PEFT logits max rel err {err:.2e} (adapter moves them by {moved:.2f}); LoRA grads {worst:.2e}")


# ---------------------------------------------------------------- GGUF LoRA and merge


@pytest.mark.parametrize("name", NAMES)
def test_gguf_lora_names_and_merge(models, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, weights = models[name]
    family = FAMILIES[name]
    cfg = family.cfg
    adapter = random_adapter(cfg, seed=40, dtype=np.float32)
    out = export_gguf_lora(adapter, folder / "model.gguf", ALPHA, tmp_path / "lora.gguf")
    with GGUFFile(out) as f:
        assert f.metadata["general.architecture"] == cfg.arch and f.metadata["adapter.type"] == "lora"
        expected = {f"blk.{i}.{LORA_TARGETS[t]}.weight.lora_{ab}" for i, t in adapter for ab in "ab"}
        assert set(f.tensors) == expected
        b = f.tensor_f32("blk.1.attn_q.weight.lora_b")
        assert np.array_equal(b, adapter[(1, "q")].B)  # GGUF row order, as llama.cpp applies it
    merged = tmp_path / "merged.gguf"
    merge_adapter(folder / "model.gguf", adapter, ALPHA / RANK, merged)
    assert check_model_file(merged) == cfg  # biases, q/k norms, rope_freqs copied as they were
    adapter64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    expect = R.forward(weights, cfg, IDS, adapter64, ALPHA / RANK)
    got = _logits(_hf_model(tmp_path, family, monkeypatch, gguf="merged.gguf"))
    err = _rel(got, expect)
    print(f"{name}: merged GGUF in transformers vs reference with the adapter: max rel err {err:.2e}")
    assert err < REL_TOL, err


# ---------------------------------------------------------------- refusals, before any work


def _write(path: Path, arch: str, meta: dict, tensors: list) -> Path:
    write_gguf(path, arch, meta, tensors)
    return path


def _qwen2_file(path: Path, change_meta: dict | None = None, extra: list | None = None, drop: str = "") -> Path:
    cfg = FAMILIES["qwen2"].cfg
    weights = R.random_weights(cfg, seed=1, dtype=np.float32)
    meta = {**tokenizer_metadata(), **model_metadata(cfg), **(change_meta or {})}
    tensors = [(n, w, Q.F32) for n, w in weights.items() if n != drop] + (extra or [])
    return _write(path, "qwen2", meta, tensors)


def test_refusals_name_the_file_and_key(tmp_path: Path) -> None:
    gemma2 = _write(
        tmp_path / "gemma2.gguf",
        "gemma2",
        {"gemma2.block_count": 2, **tokenizer_metadata()},
        [("token_embd.weight", np.ones((4, 32), np.float32), Q.F32)],
    )
    gemma3 = FAMILIES["gemma3"].cfg
    gemma3_meta = {**tokenizer_metadata(), **model_metadata(gemma3)}
    gemma3_weights = [(n, w, Q.F32) for n, w in R.random_weights(gemma3, seed=1, dtype=np.float32).items()]
    cases = [
        (
            gemma2,
            r"gemma2\.gguf: key 'general\.architecture': value: architecture 'gemma2' is not supported: .*soft-cap",
        ),
        (
            _write(tmp_path / "phi.gguf", "phi3", {}, []),
            r"phi\.gguf: key 'general\.architecture'.*'phi3' is not supported "
            r"\(supported: llama, qwen2, qwen3, gemma3\)",
        ),
        (
            _write(
                tmp_path / "cap.gguf", "gemma3", {**gemma3_meta, "gemma3.final_logit_softcapping": 30.0}, gemma3_weights
            ),
            r"cap\.gguf: key 'gemma3\.final_logit_softcapping': value: logit soft-capping is not implemented",
        ),
        (
            _write(
                tmp_path / "yarn.gguf",
                "gemma3",
                {**gemma3_meta, "gemma3.rope.scaling.type": "yarn"},
                gemma3_weights,
            ),
            r"yarn\.gguf: key 'gemma3\.rope\.scaling\.type': value: rope scaling 'yarn' not supported",
        ),
        (
            _write(
                tmp_path / "nopost.gguf", "gemma3", gemma3_meta, [t for t in gemma3_weights if "post_ffw" not in t[0]]
            ),
            r"nopost\.gguf: tensor 'blk\.0\.post_ffw_norm\.weight': name: missing",
        ),
        (
            _qwen2_file(tmp_path / "pre.gguf", {"tokenizer.ggml.pre": "tekken"}),
            r"pre\.gguf: key 'tokenizer\.ggml\.pre': value: .*'tekken' is not supported",
        ),
        (
            _qwen2_file(tmp_path / "spm.gguf", {"tokenizer.ggml.model": "llama"}),
            r"spm\.gguf: key 'tokenizer\.ggml\.model': value",
        ),
        (
            _qwen2_file(tmp_path / "bias.gguf", extra=[("blk.0.attn_output.bias", np.ones(64, np.float32), Q.F32)]),
            r"bias\.gguf: tensor 'blk\.0\.attn_output\.bias': name: not part of a qwen2 model",
        ),
        (
            _qwen2_file(tmp_path / "nobias.gguf", drop="blk.1.attn_k.bias"),
            r"nobias\.gguf: tensor 'blk\.1\.attn_k\.bias': name: missing",
        ),
        (
            _qwen2_file(tmp_path / "window.gguf", {"qwen2.rope.scaling.type": "yarn"}),
            r"window\.gguf: key 'qwen2\.rope\.scaling\.type'",
        ),
    ]
    # a quant type we cannot decode (IQ4_NL: 18 bytes per 32), given as raw rows
    cfg = FAMILIES["qwen2"].cfg
    weights = R.random_weights(cfg, seed=1, dtype=np.float32)
    q51 = [
        (n, np.zeros((w.shape[0], w.shape[1] // 32 * 18), np.uint8), Q.IQ4_NL)
        if n.endswith("ffn_up.weight")
        else (n, w, Q.F32)
        for n, w in weights.items()
    ]
    meta = {**tokenizer_metadata(), **model_metadata(cfg)}
    cases.append(
        (_write(tmp_path / "q51.gguf", "qwen2", meta, q51), r"q51\.gguf: tensor 'blk\.0\.ffn_up\.weight': type: IQ4_NL")
    )
    for path, match in cases:
        with pytest.raises(GGUFError, match=match):
            check_model_file(path)
    # the preflight refuses them before any stage, naming the config field
    for path, _ in cases:
        run_cfg = RunConfig.model_validate(tiny_config(tmp_path / "run", model={"student": str(path)}))
        with pytest.raises(InputError, match=rf"^model\.student: .*{path.name}"):
            check_inputs(run_cfg)
    good = _qwen2_file(tmp_path / "good.gguf")
    assert check_model_file(good) == cfg
