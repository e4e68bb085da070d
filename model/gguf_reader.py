"""Streaming, memory-mapped, bounds-checked GGUF reader.

Every count and length in the header is checked against the bytes left in the file *before* anything is
allocated, so a hostile or truncated file fails fast with a GGUFError instead of hanging or eating memory.
Tensor data is never read at open: `raw` returns a read-only uint8 view into the mmap.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from model.config import FAMILIES, LORA_TARGETS, UNSUPPORTED_FAMILIES, ModelConfig

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's LLM_TENSOR_ROPE_FREQS: Llama 3 RoPE frequency factors [D/2]
MAX_ARRAY_DEPTH = 4  # nested arrays deeper than this are rejected (no legitimate file nests at all)

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor_count, kv_count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_INT64_MAX = 2**63 - 1
# Smallest possible encodings, used to bound counts by the bytes left: a key-value is a key length (8), a
# value type (4) and a value (>= 1); a tensor info is a name length (8), n_dims (4), one ne (8), a type (4)
# and an offset (8).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_MIN_ARRAY_BYTES = 4 + 8  # element type + count of an (empty) nested array

# Scalar value types: struct format and the numpy dtype used for arrays of them.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_INTEGER_TYPES = frozenset(
    t for t in _SCALARS if t not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL)
)


class GGUFError(ValueError):
    """A GGUF file (or metadata) is malformed or unsupported; the message names file, item and field."""


def gguf_error(path: object, item: str, field: str, problem: str) -> GGUFError:
    """GGUFError with the standard 'file: item: field: problem' message."""
    prefix = f"{path}: " if str(path) else ""
    return GGUFError(f"{prefix}{item}: {field}: {problem}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `offset` is absolute in the file."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    ne: tuple[int, ...]  # ggml order, ne[0] = row length
    shape: tuple[int, ...]  # numpy order = reversed(ne)
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.ne[0] // block * size


class _Parser:
    """Sequential little-endian reads over a buffer; every read is checked against the end first."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def need(self, n: int, item: str, field: str) -> None:
        if n > self.size - self.pos:
            raise gguf_error(
                self.path,
                item,
                field,
                f"needs {n} bytes at offset {self.pos} but only {self.size - self.pos} remain",
            )

    def u32(self, item: str, field: str) -> int:
        self.need(4, item, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, item: str, field: str) -> int:
        self.need(8, item, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, item: str, field: str) -> str:
        n = self.u64(item, f"{field} length")
        self.need(n, item, field)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise gguf_error(self.path, item, field, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def value(self, vtype: int, item: str, depth: int = 0) -> Any:
        """One value of type `vtype` (scalars as Python values, numeric arrays as numpy arrays)."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            self.need(fmt.size, item, "value")
            (v,) = fmt.unpack_from(self.buf, self.pos)
            self.pos += fmt.size
            return bool(v) if vtype == GGUFValueType.BOOL else v
        if vtype == GGUFValueType.STRING:
            return self.string(item, "value")
        if vtype == GGUFValueType.ARRAY:
            return self.array(item, depth)
        raise gguf_error(self.path, item, "value type", f"unknown GGUF value type {vtype}")

    def array(self, item: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_DEPTH:
            raise gguf_error(self.path, item, "array", f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
        etype = self.u32(item, "array element type")
        n = self.u64(item, "array length")
        if etype in _SCALARS:
            dtype = _SCALARS[etype][1]
            self.need(n * dtype.itemsize, item, f"array of {n} {GGUFValueType(etype).name}")
            view = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos += n * dtype.itemsize
            return view != 0 if etype == GGUFValueType.BOOL else view.astype(dtype.newbyteorder("="))
        if etype == GGUFValueType.STRING:
            self.need(n * 8, item, f"array of {n} strings")
            return self.strings(n, item)
        if etype == GGUFValueType.ARRAY:
            self.need(n * _MIN_ARRAY_BYTES, item, f"array of {n} arrays")
            return [self.array(f"{item}[{i}]", depth + 1) for i in range(n)]
        raise gguf_error(self.path, item, "array element type", f"unknown GGUF value type {etype}")

    def strings(self, n: int, item: str) -> list[str]:
        """`n` length-prefixed strings: the hot loop for vocabularies (~100k strings), kept lean."""
        buf, end, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(n):
                if end - pos < 8:
                    self.pos = pos
                    self.need(8, f"{item}[{i}]", "string length")
                (length,) = unpack(buf, pos)
                pos += 8
                if length > end - pos:
                    self.pos = pos
                    self.need(length, f"{item}[{i}]", "string")
                append(buf[pos : pos + length].decode("utf-8"))
                pos += length
        except UnicodeDecodeError as exc:
            raise gguf_error(self.path, f"{item}[{len(out)}]", "string", f"not valid UTF-8 ({exc.reason})") from None
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF file opened read-only via mmap; header parsed and validated at open, tensor data read lazily.

    Use as a context manager. Views returned by `raw`/`iter_tensors` stay valid after `close` (the mapping is
    released when the last view is garbage collected).
    """

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    metadata_types: dict[str, GGUFValueType]  # value type of each key (ARRAY for arrays; numpy dtype = subtype)
    tensors: dict[str, TensorInfo]
    data_offset: int  # absolute offset of the tensor data section
    file_size: int

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._u8: np.ndarray | None = None
        with open(self.path, "rb") as fh:
            self.file_size = size = self._file_size(fh)
            if size < _HEADER.size:
                raise gguf_error(self.path, "header", "size", f"{size} bytes is shorter than a GGUF header (24)")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(_Parser(self._mm, size, self.path))
        except GGUFError:
            self.close()
            raise
        except (struct.error, OverflowError, IndexError, ValueError, MemoryError) as exc:  # safety net
            self.close()
            raise gguf_error(self.path, "header", "parse", f"{type(exc).__name__}: {exc}") from exc
        self._u8 = np.frombuffer(self._mm, dtype=np.uint8)

    @staticmethod
    def _file_size(fh: Any) -> int:
        fh.seek(0, 2)
        return fh.tell()

    def _parse(self, p: _Parser) -> None:
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(p.buf, 0)
        p.pos = _HEADER.size
        if magic != MAGIC:
            raise gguf_error(self.path, "header", "magic", f"{magic!r} is not {MAGIC!r}: not a GGUF file")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian GGUF, which is not supported)" if swapped in SUPPORTED_VERSIONS else ""
            raise gguf_error(self.path, "header", "version", f"{version} not in {SUPPORTED_VERSIONS}{hint}")
        self.version = version
        left = p.size - p.pos
        if n_kv > left // _MIN_KV_BYTES:
            raise gguf_error(self.path, "header", "kv_count", f"{n_kv} key-values cannot fit in {left} bytes")
        if n_tensors > (left - n_kv * _MIN_KV_BYTES) // _MIN_TENSOR_INFO_BYTES:
            raise gguf_error(
                self.path,
                "header",
                "tensor_count",
                f"{n_tensors} tensor infos cannot fit in the {left} bytes left after {n_kv} keys",
            )
        self._parse_metadata(p, n_kv)
        self.alignment = self._alignment()
        infos = self._parse_tensor_infos(p, n_tensors)
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(infos, p.size)

    def _parse_metadata(self, p: _Parser, n_kv: int) -> None:
        self.metadata, self.metadata_types = {}, {}
        for i in range(n_kv):
            key = p.string(f"key #{i}", "key")
            item = f"key {key!r}"
            if key in self.metadata:
                raise gguf_error(self.path, item, "key", "duplicate key")
            vtype = p.u32(item, "value type")
            self.metadata[key] = p.value(vtype, item)
            self.metadata_types[key] = GGUFValueType(vtype)

    def _alignment(self) -> int:
        key = "general.alignment"
        if key not in self.metadata:
            return DEFAULT_ALIGNMENT
        value = self.metadata[key]
        if self.metadata_types[key] not in _INTEGER_TYPES:
            raise gguf_error(
                self.path,
                f"key {key!r}",
                "value type",
                f"{self.metadata_types[key].name} is not an integer type",
            )
        if value <= 0 or value & (value - 1):
            raise gguf_error(self.path, f"key {key!r}", "value", f"{value} is not a power of two")
        return value

    def _parse_tensor_infos(self, p: _Parser, n_tensors: int) -> list[tuple[str, int, tuple[int, ...], int, int]]:
        infos, seen = [], set()
        for i in range(n_tensors):
            name = p.string(f"tensor #{i}", "name")
            item = f"tensor {name!r}"
            if name in seen:
                raise gguf_error(self.path, item, "name", "duplicate tensor name")
            seen.add(name)
            n_dims = p.u32(item, "n_dims")
            if not 1 <= n_dims <= 4:
                raise gguf_error(self.path, item, "n_dims", f"{n_dims} not in 1..4")
            ne = tuple(p.u64(item, f"ne[{j}]") for j in range(n_dims))
            for j, n in enumerate(ne):
                if not 0 < n <= _INT64_MAX:
                    raise gguf_error(self.path, item, f"ne[{j}]", f"{n} is not in 1..2**63-1")
            type_id = p.u32(item, "type")
            try:
                qtype = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise gguf_error(self.path, item, "type", f"unknown ggml type id {type_id}") from None
            if ne[0] % block:
                raise gguf_error(
                    self.path,
                    item,
                    "ne[0]",
                    f"row length {ne[0]} is not a multiple of the {qtype.name} block size {block}",
                )
            offset = p.u64(item, "offset")
            infos.append((name, type_id, ne, offset, math.prod(ne) // block * type_size))
        return infos

    def _place_tensors(self, infos: list, size: int) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, type_id, ne, rel, nbytes in infos:
            item = f"tensor {name!r}"
            if rel % self.alignment:
                raise gguf_error(
                    self.path,
                    item,
                    "offset",
                    f"{rel} is not a multiple of general.alignment={self.alignment}",
                )
            start = self.data_offset + rel
            if start + nbytes > size:
                raise gguf_error(
                    self.path,
                    item,
                    "offset",
                    f"data [{start}, {start + nbytes}) lies beyond the end of the file ({size} bytes)",
                )
            tensors[name] = TensorInfo(name, type_id, ne, tuple(reversed(ne)), start, nbytes)
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise gguf_error(self.path, f"tensor {b.name!r}", "offset", f"data overlaps tensor {a.name!r}")
        return tensors

    # --- tensor access -------------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        """TensorInfo of `name` (GGUFError if there is no such tensor)."""
        try:
            return self.tensors[name]
        except KeyError:
            raise gguf_error(self.path, f"tensor {name!r}", "name", "no such tensor in the file") from None

    def raw(self, name: str) -> np.ndarray:
        """Read-only uint8 view of the tensor's bytes in the mmap, shape (rows, row_bytes) — no copy."""
        info = self.info(name)
        if self._u8 is None:
            raise gguf_error(self.path, f"tensor {name!r}", "data", "file is closed")
        rows = info.n_elements // info.ne[0]
        return self._u8[info.offset : info.offset + info.nbytes].reshape(rows, info.row_bytes)

    def iter_tensors(self) -> Iterator[tuple[TensorInfo, np.ndarray]]:
        """(info, raw bytes) for each tensor in file order, one at a time."""
        for info in self.tensors.values():
            yield info, self.raw(info.name)

    def tensor_f32(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape."""
        from model.quant import dequantize

        info = self.info(name)
        try:
            out = dequantize(self.raw(name), info.ggml_type, info.shape)
        except ValueError as exc:  # model.quant.QuantError: a type it has no decoder for
            raise gguf_error(self.path, f"tensor {name!r}", "type", str(exc)) from None
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def config(self) -> ModelConfig:
        """ModelConfig from the metadata and tensor names: embeddings are tied when the file has no output.weight,
        q/k/v biases come with attn_q.bias, Llama 3 RoPE scaling with rope_freqs.weight."""
        rope_freqs = None
        if ROPE_FREQS in self.tensors:
            info = self.tensors[ROPE_FREQS]
            if len(info.shape) != 1:
                raise gguf_error(self.path, f"tensor {ROPE_FREQS!r}", "shape", f"{info.shape} is not 1-D")
            rope_freqs = self.tensor_f32(ROPE_FREQS)
        return model_config(
            self.metadata,
            str(self.path),
            has_output="output.weight" in self.tensors,
            tensor_names=self.tensors.keys(),
            rope_freqs=rope_freqs,
        )

    def check_model(self) -> ModelConfig:
        """config(), after checking that the file holds exactly the tensors of that model, with the expected shapes
        and in types our codecs and kernels decode: a tensor we would not use (an output bias, a sliding-window
        layer's extra norm) is refused, never silently ignored."""
        from model.quant import SUPPORTED_TYPES

        cfg = self.config()
        expected = cfg.tensor_shapes()
        supported = {int(t) for t in SUPPORTED_TYPES}
        for name, info in self.tensors.items():
            item = f"tensor {name!r}"
            if name not in expected:
                raise gguf_error(
                    self.path, item, "name", f"not part of a {cfg.arch} model as distillery runs it (unsupported)"
                )
            if info.shape != expected[name]:
                raise gguf_error(self.path, item, "shape", f"{info.shape}, expected {expected[name]} from the metadata")
            if info.ggml_type not in supported:
                names = ", ".join(t.name for t in SUPPORTED_TYPES)
                raise gguf_error(self.path, item, "type", f"{info.type_name} is not supported (supported: {names})")
        missing = [name for name in expected if name not in self.tensors]
        if missing:
            raise gguf_error(self.path, f"tensor {missing[0]!r}", "name", f"missing ({len(missing)} expected tensors)")
        return cfg

    def close(self) -> None:
        """Release the mapping (deferred until outstanding views are gone)."""
        self._u8 = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views handed out are still alive; the mapping goes with the last of them
                pass
            self._mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


# --- metadata -> ModelConfig --------------------------------------------------------------------------------


def _get(metadata: Mapping[str, Any], key: str, source: str, kind: type, default: Any = None) -> Any:
    if key not in metadata:
        if default is not None:
            return default
        raise gguf_error(source, f"key {key!r}", "value", "missing")
    value = metadata[key]
    if isinstance(value, np.generic):
        value = value.item()
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise gguf_error(source, f"key {key!r}", "value", f"{value!r} is not a scalar {kind.__name__}")
    if kind is int and value <= 0:
        raise gguf_error(source, f"key {key!r}", "value", f"{value} must be positive")
    return value


def _decimal(x: float) -> float:
    """A float32-stored value as the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else x


def _architecture(metadata: Mapping[str, Any], source: str) -> str:
    """general.architecture, refused with the reason when distillery cannot run it."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise gguf_error(source, "key 'general.architecture'", "value", "missing")
    if arch not in FAMILIES:
        reason = f": {UNSUPPORTED_FAMILIES[arch]}" if arch in UNSUPPORTED_FAMILIES else ""
        raise gguf_error(
            source,
            "key 'general.architecture'",
            "value",
            f"architecture {arch!r} is not supported{reason} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    return arch


def _rope_factors(rope_freqs: Any, arch: str, head_dim: int, source: str) -> tuple[float, ...] | None:
    """rope_freqs.weight as the config's frequency factors (llama only, as llama.cpp reads it)."""
    if rope_freqs is None:
        return None
    item = f"tensor {ROPE_FREQS!r}"
    if arch != "llama":
        raise gguf_error(source, item, "name", f"RoPE frequency factors are not read for {arch} (llama only)")
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if factors.size != head_dim // 2:
        raise gguf_error(source, item, "shape", f"{factors.size} factors, expected head_dim/2 = {head_dim // 2}")
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise gguf_error(source, item, "value", "factors must be finite and positive")
    return tuple(float(f) for f in factors)


# Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3): with <arch>.attention.sliding_window > 0, every
# block but each sixth (il % 6 == 5; Family.window_period) attends over that window, with RoPE base 10000 (the
# global blocks take rope.freq_base); the attention scale is head_dim^-0.5, except the 27B (62 blocks):
# (hidden / n_heads)^-0.5.
LOCAL_ROPE_BASE = 10000.0


def _window_settings(
    metadata: Mapping[str, Any],
    arch: str,
    period: int,
    n_layers: int,
    hidden: int,
    n_heads: int,
    head_dim: int,
    source: str,
) -> dict[str, Any]:
    """ModelConfig's attention_windows, rope_local_base and query_pre_attn_scalar of a family with sliding
    windows (gemma3); soft-capping (Gemma 2's, absent from Gemma 3) is refused."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if metadata.get(f"{arch}.{cap}", 0):
            raise gguf_error(source, f"key '{arch}.{cap}'", "value", "logit soft-capping is not implemented")
    window = metadata.get(f"{arch}.attention.sliding_window", 0)
    if isinstance(window, np.generic):
        window = window.item()
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise gguf_error(source, f"key '{arch}.attention.sliding_window'", "value", f"{window!r} is not a count")
    windows = tuple(0 if layer % period == period - 1 else window for layer in range(n_layers))
    return {
        "attention_windows": windows if window else (),
        "rope_local_base": LOCAL_ROPE_BASE if window else 0.0,
        "query_pre_attn_scalar": float(hidden // n_heads if n_layers == 62 else head_dim),
    }


def model_config(
    metadata: Mapping[str, Any],
    source: str = "",
    has_output: bool = False,
    tensor_names: Collection[str] | None = None,
    rope_freqs: Any = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama, qwen2, qwen3, gemma3); `has_output` = the file has output.weight.

    `tensor_names` (the file's tensors) tell optional pieces apart: q/k/v biases in a llama file. `rope_freqs`
    (the rope_freqs.weight tensor) gives Llama 3 RoPE scaling's frequency factors."""
    arch = _architecture(metadata, source)
    family = FAMILIES[arch]

    def get(name: str, kind: type, default: Any = None) -> Any:
        return _get(metadata, f"{arch}.{name}", source, kind, default)

    n_heads = get("attention.head_count", int)
    if f"{arch}.vocab_size" in metadata:
        vocab = get("vocab_size", int)
    elif "tokenizer.ggml.tokens" in metadata:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    else:
        raise gguf_error(source, f"key '{arch}.vocab_size'", "value", "missing (and no tokenizer.ggml.tokens)")
    hidden = get("embedding_length", int)
    head_dim = get("attention.key_length", int, hidden // n_heads)
    value_dim = get("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise gguf_error(
            source, f"key '{arch}.attention.value_length'", "value", f"{value_dim} != key_length {head_dim}"
        )
    rope_dim = get("rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise gguf_error(
            source,
            f"key '{arch}.rope.dimension_count'",
            "value",
            f"partial rotary ({rope_dim} of head dim {head_dim}) is not supported",
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    linear = family.linear_rope_scaling and scaling == "linear"  # gemma3 4B+: the global blocks' scaling
    if scaling != "none" and not linear:
        raise gguf_error(
            source,
            f"key '{arch}.rope.scaling.type'",
            "value",
            f"rope scaling {scaling!r} not supported (none, Llama 3 scaling through {ROPE_FREQS}, or gemma3's linear)",
        )
    linear_factor = _decimal(get("rope.scaling.factor", float)) if linear else 1.0
    if metadata.get(f"{arch}.expert_count", 0):
        raise gguf_error(source, f"key '{arch}.expert_count'", "value", "mixture-of-experts is not supported")
    qkv_bias = family.qkv_bias
    if tensor_names is not None and not qkv_bias:
        qkv_bias = all(f"blk.0.attn_{t}.bias" in tensor_names for t in "qkv")
    n_layers = get("block_count", int)
    windows = {}
    if family.window_period:
        windows = _window_settings(metadata, arch, family.window_period, n_layers, hidden, n_heads, head_dim, source)
    try:
        return ModelConfig(
            n_layers=n_layers,
            hidden=hidden,
            ffn=get("feed_forward_length", int),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", int, n_heads),
            vocab=vocab,
            head_dim=head_dim,
            rope_base=_decimal(get("rope.freq_base", float, 10000.0)),
            eps=_decimal(get("attention.layer_norm_rms_epsilon", float)),
            context_length=get("context_length", int),
            tied_embeddings=not has_output,
            arch=arch,
            rope_type=family.rope_type,
            rope_freq_factors=_rope_factors(rope_freqs, arch, head_dim, source),
            qkv_bias=qkv_bias,
            qk_norm=family.qk_norm,
            activation=family.activation,
            embedding_scale=math.sqrt(hidden) if family.scaled_embedding else 1.0,
            post_norms=family.post_norms,
            rope_linear_factor=linear_factor,
            **windows,
        )
    except GGUFError:
        raise
    except ValueError as exc:
        raise gguf_error(source, f"key '{arch}.attention.head_count_kv'", "value", str(exc)) from None


# --- summary for `distillery inspect` -----------------------------------------------------------------------


def family_name(cfg: ModelConfig, metadata: Mapping[str, Any]) -> str:
    """The model family as people name it: mistral (llama arch, named so, as transformers tells them apart),
    llama3 (llama with Llama 3 RoPE scaling), llama, qwen2, qwen3."""
    if cfg.arch == "llama":
        if "mistral" in str(metadata.get("general.name", "")).lower():
            return "mistral"
        return "llama3" if cfg.rope_scaling == "llama3" else "llama"
    return cfg.arch


def describe(path: str | Path) -> dict[str, Any]:
    """JSON-friendly summary of a GGUF file: architecture, config, tensors by type, sizes, tokenizer."""
    with GGUFFile(path) as f:
        md = f.metadata
        by_type: dict[str, int] = {}
        for t in f.tensors.values():
            by_type[t.type_name] = by_type.get(t.type_name, 0) + 1
        out: dict[str, Any] = {
            "architecture": md.get("general.architecture"),
            "family": None,  # set below for a model distillery can run
            "type": md.get("general.type", "model"),
            "name": md.get("general.name"),
            "version": f.version,
            "tensors": len(f.tensors),
            "tensors_by_type": by_type,
            "tensor_bytes": sum(t.nbytes for t in f.tensors.values()),
            "file_bytes": f.file_size,
            "parameters": sum(t.n_elements for t in f.tensors.values()),
            "tokenizer": md.get("tokenizer.ggml.model"),
            "tokenizer_pre": md.get("tokenizer.ggml.pre"),
            "vocab_size": len(md["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in md else None,
            "chat_template": "tokenizer.chat_template" in md,
        }
        if md.get("general.type") == "adapter":
            out["adapter"] = md.get("adapter.type")
            out["lora_alpha"] = md.get("adapter.lora.alpha")
            out["lora_targets"] = sorted({_lora_stem(n) for n in f.tensors if n.endswith((".lora_a", ".lora_b"))})
        else:
            try:
                cfg = f.check_model()
                out["family"] = family_name(cfg, md)
                out["settings"] = cfg.settings()
                out["config"] = dataclasses.asdict(cfg)
            except GGUFError as exc:
                out["config"] = None
                out["config_error"] = str(exc)
    return out


def _lora_stem(name: str) -> str:
    """'blk.3.attn_q.weight.lora_a' -> 'attn_q' (the target's stem; the name itself when not in a block)."""
    parts = name.split(".")
    stem = parts[2] if len(parts) > 3 and parts[0] == "blk" else name.rsplit(".", 2)[0]
    return next((k for k, v in LORA_TARGETS.items() if v == stem), stem)
