"""Adapter exports: PEFT (HF row order), GGUF LoRA (llama.cpp, GGUF row order) and a merged GGUF.

Row order of Q/K: llama-family GGUF files (llama, Mistral, Llama 3) store attn_q / attn_k rows permuted for
llama.cpp's NORM RoPE, which rotates adjacent pairs (x[2i], x[2i+1]); HF llama rotates halves (x[i], x[i + D/2]).
convert_hf_to_gguf.py applies `LlamaModel.permute` (per head: reshape(n_head, 2, D/2, ...).swapaxes(1, 2)) and
transformers' GGUF loader undoes it (`reverse_permute`: reshape(n_head, D/2, 2, ...).swapaxes(1, 2)), with
n_head = the query heads for q and the kv heads for k. Our adapters are trained on GGUF-order weights, so the
output rows of lora_B for q_proj and k_proj go back to HF order in the PEFT export; lora_A (input side) is
unaffected. qwen2 / qwen3 files are not permuted (llama.cpp runs them with NEOX RoPE, which rotates halves like
HF), so their rows are exported as they are (ModelConfig.qk_rows_permuted). The PEFT module names are the same
for every family (model.config.PEFT_MODULES). The GGUF LoRA and the merge keep GGUF order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save as st_save

from data.atomic import atomic_write_bytes
from model import quant as qc
from model.config import LORA_TARGETS, PEFT_MODULES, ModelConfig
from model.fold import FoldError
from model.fold import fold as fold_update
from model.gguf import GGUFFile, rewrite_gguf, write_lora_gguf
from model.reference import LoraPair, check_group_constant

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
# Targets whose output rows are RoPE-permuted in GGUF files, and which head count the permutation uses.
_PERMUTED_ROWS = {"q": "n_heads", "k": "n_kv_heads"}


class ExportError(ValueError):
    """An adapter does not fit the model or the export options; the message names the file and field."""


# ---------------------------------------------------------------- Q/K row order


def _check_rows(rows: np.ndarray, n_head: int) -> int:
    n = rows.shape[0]
    if n_head <= 0 or n % (2 * n_head):
        raise ExportError(f"row permutation: {n} rows do not split into {n_head} heads of an even size")
    return n // n_head // 2


def hf_to_gguf_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """HF row order -> GGUF (llama.cpp) row order, as convert_hf_to_gguf.py's LlamaModel.permute."""
    half = _check_rows(rows, n_head)
    rest = rows.shape[1:]
    return rows.reshape(n_head, 2, half, *rest).swapaxes(1, 2).reshape(rows.shape)


def gguf_to_hf_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF row order -> HF row order (transformers' reverse_permute); inverse of hf_to_gguf_rows."""
    half = _check_rows(rows, n_head)
    rest = rows.shape[1:]
    return rows.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


# ---------------------------------------------------------------- checks


def _check_adapter(
    adapter: Mapping[tuple[int, str], LoraPair],
    cfg: ModelConfig,
    source: str,
    complete_for: Sequence[str] = (),
    layers: Sequence[int] | None = None,
) -> int:
    """Names and shapes of every pair against `cfg`; every layer (of `layers`, default all) of each target in
    `complete_for` present.

    Returns the rank (all pairs must share it).
    """
    if not adapter:
        raise ExportError(f"{source}: adapter: empty")
    ranks = set()
    for (layer, target), pair in adapter.items():
        item = f"{source}: pair ({layer}, {target!r})"
        if target not in LORA_TARGETS:
            raise ExportError(f"{item}: target: not one of {list(LORA_TARGETS)}")
        if not 0 <= layer < cfg.n_layers:
            raise ExportError(f"{item}: layer: not in 0..{cfg.n_layers - 1}")
        n_out, n_in = cfg.target_shape(target)
        a, b = np.asarray(pair.A), np.asarray(pair.B)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise ExportError(f"{item}: shape: A {a.shape} / B {b.shape} do not fit [out={n_out}, in={n_in}]")
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise ExportError(f"{source}: rank: pairs disagree ({sorted(ranks)})")
    for target in complete_for:
        wanted = range(cfg.n_layers) if layers is None else layers
        missing = [layer for layer in wanted if (layer, target) not in adapter]
        if missing:
            raise ExportError(f"{source}: target {target!r}: no adapter for layers {missing}")
    return ranks.pop()


def _ordered(adapter: Mapping[tuple[int, str], LoraPair]) -> list[tuple[int, str]]:
    order = list(LORA_TARGETS)
    return sorted(adapter, key=lambda k: (k[0], order.index(k[1])))


# ---------------------------------------------------------------- PEFT


def peft_key(layer: int, target: str, which: str) -> str:
    """base_model.model.model.layers.N.<module>.lora_A.weight (which = 'A' or 'B')."""
    return f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}.lora_{which}.weight"


def peft_tensors(adapter: Mapping[tuple[int, str], LoraPair], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """PEFT state dict (f32): A [r, in] as is, B [out, r] with q/k rows put back into HF order (llama family)."""
    out = {}
    for layer, target in _ordered(adapter):
        pair = adapter[(layer, target)]
        b = np.asarray(pair.B, dtype=np.float32)
        if target in _PERMUTED_ROWS and cfg.qk_rows_permuted:
            b = gguf_to_hf_rows(b, getattr(cfg, _PERMUTED_ROWS[target]))
        out[peft_key(layer, target, "A")] = np.ascontiguousarray(pair.A, dtype=np.float32)
        out[peft_key(layer, target, "B")] = np.ascontiguousarray(b)
    return out


def peft_config(
    r: int, alpha: float, targets: Sequence[str], base_model_name: str, layers: Sequence[int] | None = None
) -> dict[str, Any]:
    """adapter_config.json for a plain LoRA (scale alpha / r) on a causal LM; `layers` -> layers_to_transform."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": int(r),
        "lora_alpha": float(alpha),
        "target_modules": [PEFT_MODULES[t].rsplit(".", 1)[-1] for t in LORA_TARGETS if t in targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None if layers is None else sorted(int(x) for x in layers),
    }


def export_peft(
    adapter: Mapping[tuple[int, str], LoraPair],
    cfg: ModelConfig,
    r: int,
    alpha: float,
    targets: Sequence[str],
    out_dir: str | Path,
    base_model_name: str,
    layers: Sequence[int] | None = None,
) -> tuple[Path, Path]:
    """Write adapter_model.safetensors + adapter_config.json into `out_dir`; returns both paths.

    The adapter must cover every layer (or every one of `layers`, written as PEFT's layers_to_transform) of each
    of `targets`, and nothing else, at rank `r`.
    """
    out_dir = Path(out_dir)
    weights_path, config_path = out_dir / PEFT_WEIGHTS, out_dir / PEFT_CONFIG
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ExportError(f"{config_path}: target_modules: {list(targets)} (known: {list(LORA_TARGETS)})")
    extra = sorted({t for _, t in adapter} - set(targets))
    if extra:
        raise ExportError(f"{weights_path}: adapter: has targets {extra} not in targets={list(targets)}")
    rank = _check_adapter(adapter, cfg, str(weights_path), complete_for=targets, layers=layers)
    outside = sorted({layer for layer, _ in adapter} - set(range(cfg.n_layers) if layers is None else layers))
    if outside:
        raise ExportError(f"{weights_path}: adapter: has layers {outside} outside layers={list(layers or [])}")
    if rank != r:
        raise ExportError(f"{config_path}: r: {r}, but the adapter has rank {rank}")
    data = st_save(peft_tensors(adapter, cfg), {"format": "pt"})
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(weights_path, data)
    text = json.dumps(peft_config(r, alpha, targets, base_model_name, layers), indent=2) + "\n"
    atomic_write_bytes(config_path, text.encode())
    return weights_path, config_path


# ---------------------------------------------------------------- GGUF LoRA


def gguf_lora_tensors(adapter: Mapping[tuple[int, str], LoraPair]) -> dict[str, np.ndarray]:
    """blk.N.<stem>.weight.lora_a [r, in] / .lora_b [out, r] in GGUF row order (ne [in, r] / [r, out])."""
    out = {}
    for layer, target in _ordered(adapter):
        pair = adapter[(layer, target)]
        stem = f"blk.{layer}.{LORA_TARGETS[target]}.weight"
        out[f"{stem}.lora_a"] = np.asarray(pair.A, dtype=np.float32)
        out[f"{stem}.lora_b"] = np.asarray(pair.B, dtype=np.float32)
    return out


def export_gguf_lora(
    adapter: Mapping[tuple[int, str], LoraPair],
    base_gguf_path: str | Path,
    alpha: float,
    out_path: str | Path,
) -> Path:
    """Write a llama.cpp LoRA adapter GGUF (`--lora`) for the base model at `base_gguf_path`."""
    out_path = Path(out_path)
    with GGUFFile(base_gguf_path) as f:
        _check_adapter(adapter, f.config(), str(out_path))
        write_lora_gguf(out_path, f.metadata, alpha, gguf_lora_tensors(adapter))
    return out_path


# ---------------------------------------------------------------- merge


def _quant_types(quant_types: Sequence[int | str]) -> list[Q]:
    out = []
    for t in quant_types:
        try:
            out.append(Q[t] if isinstance(t, str) else Q(int(t)))
        except (KeyError, ValueError):
            raise ExportError(f"merge: quant: unknown GGUF type {t!r}") from None
    if not out:
        raise ExportError("merge: quant: give at least one type (or None to keep each tensor's type)")
    return out


def _merge_type(name: str, row_len: int, own: int, quant_types: list[Q] | None, out: Path) -> Q:
    """The tensor's own type, or the first of `quant_types` whose block size divides the row length."""
    if quant_types is None:
        return Q(own)
    for qtype in quant_types:
        if row_len % qc.block_size(qtype) == 0:
            return qtype
    names = ", ".join(t.name for t in quant_types)
    raise ExportError(f"{out}: tensor {name!r}: type: row length {row_len} fits none of {names}")


def _encode(values: np.ndarray, qtype: Q, name: str, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """(data for write_gguf, the values a reader will decode) of f32 `values` stored as `qtype`."""
    if qtype == Q.F32:
        return values, values
    if qtype == Q.F16:
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    try:
        data = qc.quantize(values, qtype)
    except qc.QuantError as exc:
        raise ExportError(f"{out}: tensor {name!r}: type: {exc}") from None
    return data, qc.dequantize(data, qtype, values.shape)


def merge_adapter(
    base_gguf_path: str | Path,
    adapter: Mapping[tuple[int, str], LoraPair],
    scale: float,
    out_path: str | Path,
    quant: Sequence[int | str] | None = None,
    *,
    fold: bool = False,
) -> dict[str, Any]:
    """Write the base GGUF with W + scale * B A merged into each adapted tensor; streamed, atomic.

    Adapted tensors are stored in their own type, or with `quant` (names or ids, in order of preference:
    the first whose block size divides the row length, as model.quant.choose_student_type). fold=True (a
    mergeable adapter, quant None): B A is constant over each quantization group and is folded into the stored
    blocks without re-rounding W (model/fold.py: the type may change, e.g. Q4_0 -> Q4_1). Every other tensor
    and all metadata are copied byte for byte. Returns the merge report: per adapted tensor its types, bytes, the
    rms of the weight and of the update, and the rms / max of (stored - (stored base + update)); totals over all
    of them, and the file sizes.
    """
    out_path = Path(out_path)
    types = None if quant is None else _quant_types(quant)
    folding = fold and types is None
    report: dict[str, Any] = {"path": str(out_path), "scale": float(scale), "fold": folding, "tensors": {}}
    with GGUFFile(base_gguf_path) as f:
        _check_adapter(adapter, f.config(), str(out_path))
        if folding:
            for key, pair in adapter.items():
                check_group_constant(np.asarray(pair.A), qc.QK, f"{out_path}: adapter {key}")
        by_name = {f"blk.{layer}.{LORA_TARGETS[t]}.weight": adapter[(layer, t)] for layer, t in _ordered(adapter)}
        missing = [name for name in by_name if name not in f.tensors]
        if missing:
            raise ExportError(f"{base_gguf_path}: tensor {missing[0]!r}: name: adapted but not in the base model")

        def tensors() -> Iterator[tuple[str, np.ndarray, int]]:
            for info, raw in f.iter_tensors():
                pair = by_name.get(info.name)
                if pair is None:
                    yield info.name, raw.reshape(*info.shape[:-1], -1), info.ggml_type
                    continue
                delta = float(scale) * (pair.B.astype(np.float64) @ pair.A.astype(np.float64))
                exact = f.tensor_f32(info.name).astype(np.float64) + delta
                if folding:
                    rows = raw.reshape(*info.shape[:-1], -1)
                    try:
                        qtype, data = fold_update(rows, info.ggml_type, exact.shape, delta)
                    except FoldError as exc:
                        raise ExportError(f"{out_path}: tensor {info.name!r}: fold: {exc}") from None
                    stored = _decoded(data, qtype, exact.shape)
                else:
                    qtype = _merge_type(info.name, info.shape[-1], info.ggml_type, types, out_path)
                    data, stored = _encode(exact.astype(np.float32), qtype, info.name, out_path)
                err = stored.astype(np.float64) - exact
                report["tensors"][info.name] = {
                    "type": qtype.name,
                    "from": Q(info.ggml_type).name,
                    "bytes": int(exact.shape[0] * qc.row_bytes(qtype, exact.shape[-1])),
                    "base_bytes": int(exact.shape[0] * qc.row_bytes(info.ggml_type, exact.shape[-1])),
                    "n": int(exact.size),
                    "weight_rms": float(np.sqrt(np.mean(exact**2))),
                    "delta_rms": float(np.sqrt(np.mean(delta**2))),
                    "error_rms": float(np.sqrt(np.mean(err**2))),
                    "error_max": float(np.abs(err).max()),
                }
                yield info.name, data, qtype

        rewrite_gguf(out_path, f, tensors())
    stats = report["tensors"].values()
    n = sum(s["n"] for s in stats)
    report["merged"] = len(report["tensors"])
    report["error_rms"] = float(np.sqrt(sum(s["error_rms"] ** 2 * s["n"] for s in stats) / n))
    report["error_max"] = max(s["error_max"] for s in stats)
    report["delta_rms"] = float(np.sqrt(sum(s["delta_rms"] ** 2 * s["n"] for s in stats) / n))
    report["base_file_bytes"] = Path(base_gguf_path).stat().st_size
    report["file_bytes"] = out_path.stat().st_size
    return report


def _decoded(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """What a reader decodes from `data` written as `qtype` (floats as they are, else the codec)."""
    if qtype in (Q.F32, Q.F16):
        return np.asarray(data, np.float32)
    return qc.dequantize(data, qtype, shape)
