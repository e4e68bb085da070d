"""GGUF writing over gguf.GGUFWriter: whole models (streamed through a spooled temp file) and LoRA adapters.

Files are written to a temporary name in the destination folder and renamed into place, so a reader never
sees a half-written file.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from model.config import LORA_TARGETS, ModelConfig
from model.gguf_reader import GGUFError, GGUFFile, gguf_error, model_config

Q = GGMLQuantizationType
# ggml types stored as plain numpy dtypes (data given as numbers is cast to these).
_PLAIN_DTYPES: dict[int, np.dtype] = {
    Q.F32: np.dtype("<f4"),
    Q.F16: np.dtype("<f2"),
    Q.F64: np.dtype("<f8"),
    Q.I8: np.dtype("i1"),
    Q.I16: np.dtype("<i2"),
    Q.I32: np.dtype("<i4"),
    Q.I64: np.dtype("<i8"),
}
_DTYPE_VALUE_TYPES: dict[str, GGUFValueType] = {
    "u1": GGUFValueType.UINT8,
    "i1": GGUFValueType.INT8,
    "u2": GGUFValueType.UINT16,
    "i2": GGUFValueType.INT16,
    "u4": GGUFValueType.UINT32,
    "i4": GGUFValueType.INT32,
    "f4": GGUFValueType.FLOAT32,
    "b1": GGUFValueType.BOOL,
    "u8": GGUFValueType.UINT64,
    "i8": GGUFValueType.INT64,
    "f8": GGUFValueType.FLOAT64,
}
_SCALAR_FORMATS = {t: f for t, f in GGUFWriter._simple_value_packing.items()}
_LORA_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.weight\.lora_([ab])$")


def _dtype_value_type(dtype: np.dtype, path: Path, key: str) -> GGUFValueType:
    vtype = _DTYPE_VALUE_TYPES.get(f"{dtype.kind}{dtype.itemsize}")
    if vtype is None:
        raise gguf_error(path, f"key {key!r}", "value", f"numpy dtype {dtype} has no GGUF value type")
    return vtype


def _infer_scalar_type(value: Any) -> GGUFValueType:
    """GGUF type for a Python scalar, following llama.cpp's conventions (counts and ids are uint32)."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return GGUFValueType.UINT32
        if -(2**31) <= value < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT64 if value > 0 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str | bytes):
        return GGUFValueType.STRING
    raise TypeError(f"{type(value).__name__} has no GGUF value type")


def _metadata_value(
    path: Path, key: str, value: Any, hint: int | None
) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value, type, array subtype) for GGUFWriter.add_key_value; `hint` overrides a scalar's type."""
    item = f"key {key!r}"
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return list(value), GGUFValueType.ARRAY, GGUFValueType.STRING
    if isinstance(value, list | tuple | np.ndarray):
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.size == 0:
            raise gguf_error(path, item, "value", f"only non-empty 1-D arrays can be written (shape {arr.shape})")
        if arr.dtype.kind == "i" and not isinstance(value, np.ndarray):  # Python ints: int32 when they fit
            arr = arr.astype(np.int32) if np.abs(arr).max() < 2**31 else arr
        elif arr.dtype.kind == "f" and not isinstance(value, np.ndarray):
            arr = arr.astype(np.float32)
        return arr.tolist(), GGUFValueType.ARRAY, _dtype_value_type(arr.dtype, path, key)
    try:
        if isinstance(value, np.generic):
            vtype = _dtype_value_type(value.dtype, path, key) if hint is None else GGUFValueType(hint)
            value = value.item()
        else:
            vtype = _infer_scalar_type(value) if hint is None else GGUFValueType(hint)
        if vtype in _SCALAR_FORMATS:
            struct.pack("<" + _SCALAR_FORMATS[vtype], value)
        elif vtype != GGUFValueType.STRING or not isinstance(value, str | bytes):
            raise TypeError(f"{value!r} cannot be written as {vtype.name}")
    except (TypeError, ValueError, struct.error) as exc:
        raise gguf_error(path, item, "value", str(exc)) from None
    return value, vtype, None


def _tensor_payload(path: Path, name: str, data: np.ndarray, qtype: int) -> tuple[np.ndarray, Q]:
    """(array for GGUFWriter.add_tensor, type): uint8 = raw rows already encoded, numbers are cast/encoded."""
    item = f"tensor {name!r}"
    try:
        qt = Q(int(qtype))
        block, type_size = GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
        raise gguf_error(path, item, "type", f"unknown ggml type id {qtype}") from None
    data = np.asarray(data)
    if not 1 <= data.ndim <= 4 or data.size == 0:
        raise gguf_error(path, item, "shape", f"{data.shape} must have 1..4 non-empty dimensions")
    if data.dtype == np.uint8:
        if data.shape[-1] % type_size:
            raise gguf_error(
                path,
                item,
                "row bytes",
                f"{data.shape[-1]} is not a multiple of the {qt.name} block size ({type_size} bytes)",
            )
        return np.ascontiguousarray(data), qt
    if data.dtype.kind not in "fiub":
        raise gguf_error(path, item, "dtype", f"{data.dtype} cannot be written as {qt.name}")
    if data.shape[-1] % block:
        raise gguf_error(
            path,
            item,
            "shape",
            f"row length {data.shape[-1]} is not a multiple of the {qt.name} block size {block}",
        )
    if qt in _PLAIN_DTYPES:
        return np.ascontiguousarray(data, dtype=_PLAIN_DTYPES[qt]), qt
    if qt == Q.BF16:
        from gguf.quants import quantize as gguf_quantize

        return gguf_quantize(np.ascontiguousarray(data, dtype=np.float32), qt), qt
    from model.quant import quantize

    try:
        encoded = quantize(np.asarray(data, dtype=np.float32), qt)
    except ValueError as exc:  # model.quant.QuantError: a type it has no encoder for
        raise gguf_error(path, item, "type", str(exc)) from None
    return np.ascontiguousarray(encoded, dtype=np.uint8), qt


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Iterable[tuple[str, np.ndarray, int]],
    *,
    metadata_types: Mapping[str, int] | None = None,
) -> None:
    """Write a GGUF v3 file atomically (tmp name in the same folder, then os.replace).

    metadata: str, bool, int, float, numpy scalars/arrays, lists of str. Python ints become UINT32 (INT32 when
    negative, 64-bit when too large), floats FLOAT32; `metadata_types` (e.g. GGUFFile.metadata_types) pins
    the scalar types of a file being rewritten. general.architecture comes from `arch`.
    tensors: (name, data, ggml_type); data is float (numpy order) for F32/F16/BF16 — or any quant type, then
    encoded with model.quant — or uint8 rows already encoded (rows, row_bytes), e.g. GGUFFile.raw().
    """
    path = Path(path)
    types = dict(metadata_types or {})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, arch, use_temp_file=True)
    try:
        _add_metadata(writer, path, arch, metadata, types)
        seen: set[str] = set()
        for name, data, qtype in tensors:
            if name in seen:
                raise gguf_error(path, f"tensor {name!r}", "name", "duplicate tensor name")
            seen.add(name)
            payload, qt = _tensor_payload(path, name, data, qtype)
            writer.add_tensor(name, payload, raw_dtype=qt)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        if writer.temp_file is not None:
            writer.temp_file.close()
        tmp.unlink(missing_ok=True)
        raise


def rewrite_gguf(path: str | Path, source: GGUFFile, tensors: Iterable[tuple[str, np.ndarray, int]]) -> None:
    """Write `tensors` as a converted copy of `source`: its architecture, metadata and metadata types kept."""
    arch = source.metadata.get("general.architecture", "llama")
    write_gguf(path, arch, source.metadata, tensors, metadata_types=source.metadata_types)


def _add_metadata(writer: GGUFWriter, path: Path, arch: str, metadata: Mapping[str, Any], types: dict) -> None:
    for key, value in metadata.items():
        if key == "general.architecture":
            if value != arch:
                raise gguf_error(path, f"key {key!r}", "value", f"{value!r} disagrees with arch={arch!r}")
            continue
        if key == "general.alignment":
            try:
                writer.add_custom_alignment(int(value))
            except ValueError as exc:
                raise gguf_error(path, f"key {key!r}", "value", f"{value}: {exc}") from None
            continue
        hint = types.get(key)
        hint = None if hint is None or int(hint) == GGUFValueType.ARRAY else int(hint)
        val, vtype, sub = _metadata_value(path, key, value, hint)
        writer.add_key_value(key, val, vtype, sub_type=sub)


def write_lora_gguf(
    path: str | Path,
    base_metadata_or_arch: Mapping[str, Any] | str,
    alpha: float,
    tensors: Mapping[str, np.ndarray],
) -> None:
    """Write a llama.cpp LoRA adapter GGUF: general.type=adapter, adapter.type=lora, adapter.lora.alpha.

    tensors: blk.N.<stem>.weight.lora_a (numpy [r, in]) and .lora_b ([out, r]), stored F32 in the given order.
    With base metadata (not just an arch name) shapes are checked against the base model's config.
    """
    path = Path(path)
    if isinstance(base_metadata_or_arch, str):
        arch, cfg = base_metadata_or_arch, None
    else:
        arch = base_metadata_or_arch.get("general.architecture")
        if not isinstance(arch, str):
            raise gguf_error(path, "key 'general.architecture'", "value", "missing from the base metadata")
        cfg = model_config(base_metadata_or_arch, str(path))
    arrays = {name: np.asarray(t, dtype=np.float32) for name, t in tensors.items()}
    _check_lora(path, arrays, cfg)
    metadata = {
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": np.float32(alpha),
    }
    write_gguf(path, arch, metadata, ((name, a, Q.F32) for name, a in arrays.items()))


def _check_lora(path: Path, arrays: Mapping[str, np.ndarray], cfg: Any) -> None:
    stems = {v: k for k, v in LORA_TARGETS.items()}
    if not arrays:
        raise gguf_error(path, "tensors", "names", "a LoRA adapter needs at least one lora_a/lora_b pair")
    for name, a in arrays.items():
        item = f"tensor {name!r}"
        m = _LORA_NAME.match(name)
        if m is None:
            raise gguf_error(path, item, "name", "expected blk.N.<stem>.weight.lora_a or .lora_b")
        if a.ndim != 2:
            raise gguf_error(path, item, "shape", f"{a.shape} is not 2-D")
        other = name[:-1] + ("b" if m[3] == "a" else "a")
        if other not in arrays:
            raise gguf_error(path, item, "name", f"has no partner {other!r}")
        if m[3] == "b":
            continue
        b = arrays[other]
        if a.shape[0] != b.shape[1]:
            raise gguf_error(path, item, "shape", f"rank {a.shape[0]} != rank {b.shape[1]} of {other!r} {b.shape}")
        if cfg is not None:
            layer, stem = int(m[1]), m[2]
            if layer >= cfg.n_layers:
                raise gguf_error(path, item, "name", f"layer {layer} >= block_count {cfg.n_layers}")
            if stem in stems:
                out_f, in_f = cfg.target_shape(stems[stem])
                if a.shape[1] != in_f or b.shape[0] != out_f:
                    raise gguf_error(
                        path,
                        item,
                        "shape",
                        f"A {a.shape} / B {b.shape} do not fit the base {stem} weight [out={out_f}, in={in_f}]",
                    )


__all__ = ["GGUFError", "llama3_rope_factors", "model_metadata", "write_gguf", "write_lora_gguf"]


def model_metadata(cfg: ModelConfig, name: str = "") -> dict[str, Any]:
    """The general.* / <arch>.* keys that describe `cfg` (what model_config and transformers' GGUF loader read).

    Biases, q/k norms and Llama 3 RoPE scaling are told by tensors (blk.N.attn_q.bias, attn_q_norm.weight,
    rope_freqs.weight), not keys, as llama.cpp's converter writes them."""
    a = cfg.arch
    meta: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.block_count": cfg.n_layers,
        f"{a}.embedding_length": cfg.hidden,
        f"{a}.feed_forward_length": cfg.ffn,
        f"{a}.attention.head_count": cfg.n_heads,
        f"{a}.attention.head_count_kv": cfg.n_kv_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.rope.dimension_count": cfg.head_dim,
        f"{a}.rope.freq_base": float(cfg.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.eps),
        f"{a}.context_length": cfg.context_length,
        f"{a}.vocab_size": cfg.vocab,
    }
    if cfg.post_norms:  # gemma3: the window is a key, the pattern of windowed blocks and their RoPE base are fixed
        meta[f"{a}.attention.sliding_window"] = max(cfg.attention_windows, default=0)
    if cfg.rope_linear_factor != 1.0:
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = float(cfg.rope_linear_factor)
    if name:
        meta["general.name"] = name
    if cfg.arch == "gemma3":
        read = model_config(meta, "model_metadata", has_output=not cfg.tied_embeddings)
        fields = (
            "attention_windows",
            "rope_local_base",
            "query_pre_attn_scalar",
            "embedding_scale",
            "rope_linear_factor",
        )
        differ = [f for f in fields if getattr(read, f) != getattr(cfg, f)]
        if differ:
            raise ValueError(f"model_metadata: a gemma3 GGUF cannot say this config's {', '.join(differ)}")
    return meta


def llama_metadata(cfg: ModelConfig, name: str = "") -> dict[str, Any]:
    """model_metadata of a llama config (kept for callers that name the family)."""
    return model_metadata(cfg, name)


def llama3_rope_factors(
    head_dim: int,
    base: float,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> np.ndarray:
    """rope_freqs.weight [D/2] for Llama 3 RoPE scaling (HF rope_scaling type llama3), as convert_hf_to_gguf.py
    computes it: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    freqs = 1.0 / float(base) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, blended))
    return out.astype(np.float32)
