"""f32 -> f16 copies of tensor-core GEMM operands (the pack_f16 kernel, shared with the attention's packs), plain or
scaled by a power of two for tensors whose values lie far below f16's normal range (dL/dlogits), and the
unscaling of a product computed from a scaled copy; a quantized weight's rows decoded to f16 as the tensor-core
GEMM's staging decodes them (weight_to_f16); bf16 copies (two per u32 word) of tensors that need f32's
range more than its precision (the residual stream's checkpoints) and their f32 values back."""

from __future__ import annotations

from typing import Any

from gguf import GGMLQuantizationType

from gpu.device import Device, DeviceError, grid_1d
from gpu.ops.common import grid, nbytes, need, pack
from gpu.registry import pipeline
from gpu.weights import QuantTensor, padded_nbytes


def to_f16(dev: Device, src: Any, dst: Any, n_elems: int) -> bool:
    """dst (f16) = src (f32), n_elems a multiple of 4: the A operand of tensor-core GEMMs packed once (rounded
    exactly as the kernels round f32 A while staging, so the products are bitwise the same) and read at half
    the bytes, with the f16 A kernels' 16-byte loads. False (nothing recorded) when n_elems is not a multiple
    of 4: the caller passes the f32 tensor instead."""
    if n_elems % 4:
        return False
    if nbytes(src) < 4 * n_elems or nbytes(dst) < 2 * n_elems:
        raise DeviceError(f"to_f16: {n_elems} elements do not fit src ({nbytes(src)} B) / dst ({nbytes(dst)} B)")
    units = n_elems // 4
    dev.dispatch(pipeline(dev, "pack_f16", scaled=False), [pack(units, units), src, dst], grid(units, 256))
    return True


def weight_to_f16(dev: Device, w: QuantTensor, out: Any) -> QuantTensor:
    """w's rows (n, k) decoded into `out` as an F16 weight of the same shape (k a multiple of 8), rounded as the
    tensor-core GEMM rounds w while staging it (gpu/kernels/weight_f16.wgsl): a GEMM over the result multiplies
    the same f16 values, with the plain F16 staging. For a weight used by several products in a row (the LM head's
    vocab chunk: its logits, then dh), decoded once."""
    n, k = w.shape
    if k % 8:
        raise DeviceError(f"weight_to_f16 {w.name!r}: rows of {k} are not a multiple of 8")
    f16 = GGMLQuantizationType.F16
    if nbytes(out) < padded_nbytes(f16, (n, k)):
        raise DeviceError(f"weight_to_f16 {w.name!r}: out holds {nbytes(out)} B, needs {padded_nbytes(f16, (n, k))}")
    items = n * k // 8
    dev.dispatch(pipeline(dev, "weight_f16", wtype=w.qtype.name), [pack(n, k, 0, 0), w.binding, out], grid(items, 256))
    return QuantTensor(out, f16, (n, k), f"{w.name} f16")


# absmax's scale: grad_scale.wgsl then puts max |x| * sigma in [2^14, 2^15) -- the top of f16's range, so values
# down to 2^-28 of the max stay in its normal range (from 2^-14)
WIDE_SCALE = 2.0**-18
ABSMAX_WORKGROUPS = 1024  # strided partial maxima, one atomic each


def to_f16_scaled(dev: Device, src: Any, dst: Any, stats: Any, n_elems: int) -> None:
    """dst (f16) = src * sigma (f32 [n_elems], n_elems a multiple of 4), sigma the power of two putting max |src|
    * sigma in [2^14, 2^15); stats[0] keeps the bits from which add_unscaled recovers sigma (stats: >= 8 bytes)."""
    if n_elems % 4:
        raise ValueError(f"to_f16_scaled: {n_elems} elements is not a multiple of 4")
    need(src, n_elems, "to_f16_scaled src")
    need(dst, n_elems, "to_f16_scaled dst", elem_bytes=2)
    need(stats, 2, "to_f16_scaled stats")
    units = n_elems // 4
    dev.clear(stats, 0, 4)
    groups = grid_1d(min(ABSMAX_WORKGROUPS, -(-units // 256)))
    dev.dispatch(pipeline(dev, "absmax"), [pack(units, WIDE_SCALE, 0, 0), src, stats], groups)
    dev.dispatch(pipeline(dev, "pack_f16", scaled=True), [pack(units, units), src, dst, stats], grid(units, 256))


def add_unscaled(dev: Device, b: Any, stats: Any, y: Any, n_elems: int, *, accumulate: bool) -> None:
    """y (+)= b / sigma, sigma from the stats of to_f16_scaled: a product of its scaled copy brought back."""
    for buf, what in ((b, "b"), (y, "y")):
        need(buf, n_elems, f"add_unscaled {what}")
    pipe = pipeline(dev, "add_unscaled", acc=accumulate)
    dev.dispatch(pipe, [pack(n_elems, 0, 0, 0), b, stats, y], grid(n_elems, 256))


def _pairs(n_elems: int, what: str) -> int:
    if n_elems % 2:
        raise ValueError(f"{what}: {n_elems} elements is not a multiple of 2")
    return n_elems // 2


def to_bf16(dev: Device, src: Any, dst: Any, n_elems: int) -> None:
    """dst (u32 words of two bf16) = src (f32 [n_elems], n_elems even), rounded to nearest even, NaN kept (the
    numpy twin: model.bf16.bf16_bits)."""
    pairs = _pairs(n_elems, "to_bf16")
    need(src, n_elems, "to_bf16 src")
    need(dst, pairs, "to_bf16 dst")
    dev.dispatch(pipeline(dev, "to_bf16"), [pack(pairs, 0, 0, 0), src, dst], grid(pairs, 256))


def from_bf16(dev: Device, src: Any, dst: Any, n_elems: int) -> None:
    """dst (f32 [n_elems]) = the values of to_bf16's words src (exact)."""
    pairs = _pairs(n_elems, "from_bf16")
    need(src, pairs, "from_bf16 src")
    need(dst, n_elems, "from_bf16 dst")
    dev.dispatch(pipeline(dev, "from_bf16"), [pack(pairs, 0, 0, 0), src, dst], grid(pairs, 256))
