"""Frozen weights on the GPU, uploaded still quantized: the raw GGUF block bytes of a 2-D tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from gpu.codegen import WEIGHT_TYPES
from gpu.device import BufferView, Device


@dataclass(frozen=True)
class QuantTensor:
    """A weight W of numpy shape (n, k) = n rows of k (ggml ne = [k, n]) held on the GPU in its GGML type.

    `buffer` holds the rows' blocks back to back exactly as in the GGUF file, zero-padded by 4-7 bytes
    (bind it whole; `offset` is nonzero only for views into a larger buffer)."""

    buffer: Any  # GPUBuffer
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    name: str = ""
    offset: int = 0

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the raw GGML data (without padding)."""
        return raw_nbytes(self.qtype, self.shape)

    @property
    def binding(self) -> BufferView:
        """The bound range: raw data plus its padding."""
        return BufferView(self.buffer, self.offset, padded_nbytes(self.qtype, self.shape))


def raw_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, int]) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return shape[0] * (shape[1] // block) * type_size


def padded_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, int]) -> int:
    """Raw size rounded up to 4 bytes, plus one spare word (unaligned 4-byte reads touch the next word)."""
    return -(-raw_nbytes(qtype, shape) // 4) * 4 + 4


def check_shape(qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str = "") -> tuple[int, int]:
    """Validate a weight's (n, k) shape for the GPU kernels; returns it as a pair of ints."""
    what = f"tensor {name!r}" if name else "tensor"
    if qtype.name not in WEIGHT_TYPES:
        raise ValueError(f"{what}: type {qtype.name} has no GPU decoder; supported: {sorted(WEIGHT_TYPES)}")
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2:
        raise ValueError(f"{what}: shape {tuple(shape)} is not 2-D (rows, row length)")
    n, k = int(shape[0]), int(shape[1])
    block = WEIGHT_TYPES[qtype.name].block
    if k % block:
        raise ValueError(f"{what}: row length {k} is not a multiple of {block} ({qtype.name})")
    return n, k


def upload_quant(
    dev: Device, data: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...], name: str = ""
) -> QuantTensor:
    """Upload raw GGML data (any dtype; its bytes are used, e.g. GGUFReader's uint8 rows or an F32 array)
    for a weight of numpy shape (n, k)."""
    qtype = GGMLQuantizationType(qtype)
    n, k = check_shape(qtype, tuple(shape), name)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    expect = raw_nbytes(qtype, (n, k))
    if raw.size != expect:
        raise ValueError(f"tensor {name!r}: {raw.size} data bytes, but {qtype.name} shape ({n}, {k}) needs {expect}")
    padded = np.zeros(padded_nbytes(qtype, (n, k)), np.uint8)
    padded[: raw.size] = raw
    buf = dev.upload(padded, label=name or f"{qtype.name}[{n},{k}]")
    return QuantTensor(buf, qtype, (n, k), name)


def quantize_upload(dev: Device, w: np.ndarray, qtype: GGMLQuantizationType | int, name: str = "") -> QuantTensor:
    """Quantize a float [n, k] array with gguf-py (F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, ...) and upload it."""
    qtype = GGMLQuantizationType(qtype)
    w = np.asarray(w, dtype=np.float32)
    return upload_quant(dev, quantize(w, qtype), qtype, w.shape, name)


def wrap_f32(buffer: Any, shape: tuple[int, int], name: str = "", offset: int = 0) -> QuantTensor:
    """View an existing f32 buffer holding [n, k] row-major at byte `offset` (e.g. LoRA A [r, in] or
    B [out, r]) as an F32 weight, without copying. k must be a multiple of 4."""
    n, k = check_shape(GGMLQuantizationType.F32, shape, name)
    if buffer.size - offset < n * k * 4:
        raise ValueError(f"tensor {name!r}: buffer has {buffer.size - offset} bytes, [{n}, {k}] f32 needs {n * k * 4}")
    return _F32View(buffer, GGMLQuantizationType.F32, (n, k), name, offset)


@dataclass(frozen=True)
class _F32View(QuantTensor):
    """An F32 weight bound exactly (no padding word: the F32 decoder reads whole aligned vec4s)."""

    @property
    def binding(self) -> BufferView:
        return BufferView(self.buffer, self.offset, self.n * self.k * 4)


def random_blocks(qtype: GGMLQuantizationType | int, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random raw GGML data for a (n, k) weight with sane scales (f16 d/dmin in [1e-3, 1e-2]): test and
    benchmark weights for types gguf-py cannot encode (K-quants). Returns uint8 rows [n, bytes per row]."""
    qtype = GGMLQuantizationType(qtype)
    n, k = check_shape(qtype, shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    nb = n * k // block
    raw = rng.integers(0, 256, (nb, type_size), dtype=np.uint8)
    # byte offsets of the f16 scales in each block
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
    if qtype.name in ("F32", "F16"):
        w = rng.standard_normal((n, k)).astype(np.float32 if qtype.name == "F32" else np.float16)
        return w.view(np.uint8)
    for off in scales[qtype.name]:
        d = rng.uniform(1e-3, 1e-2, nb).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(nb, 2)
    return raw.reshape(n, -1)


def row_slice(w: QuantTensor, r0: int, n_rows: int) -> QuantTensor:
    """A view of rows r0 .. r0 + n_rows of `w` (no copy). Its byte offset must meet the adapter's storage
    offset alignment (256): e.g. r0 a multiple of 256 rows always does."""
    if not (0 <= r0 and r0 + n_rows <= w.n and n_rows > 0):
        raise ValueError(f"tensor {w.name!r}: rows {r0}..{r0 + n_rows} outside its {w.n} rows")
    offset = w.offset + r0 * raw_nbytes(w.qtype, (1, w.k))
    cls = _F32View if isinstance(w, _F32View) else QuantTensor
    return cls(w.buffer, w.qtype, (n_rows, w.k), w.name, offset)


def check_lm_head(w: Any, vocab: int, hidden: int, chunk: int, alignment: int) -> None:
    """Validate an lm_head given as a QuantTensor [vocab, hidden] (read in row chunks of `chunk`) or f32 buffer."""
    if not isinstance(w, QuantTensor):
        size = w.nbytes if isinstance(w, BufferView) else int(w.size)
        if size < 4 * vocab * hidden:
            raise ValueError(f"lm_head f32 buffer is smaller than [{vocab}, {hidden}]")
        return
    if w.shape != (vocab, hidden):
        raise ValueError(f"lm_head {w.name!r} has shape {w.shape}, expected ({vocab}, {hidden})")
    step = chunk * raw_nbytes(w.qtype, (1, hidden))
    if vocab > chunk and step % alignment:
        raise ValueError(
            f"vocab chunk {chunk} rows of {w.qtype.name} = {step} bytes is not a multiple of the "
            f"{alignment}-byte offset alignment: use a multiple of 256 rows"
        )
