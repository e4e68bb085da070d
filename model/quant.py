"""GGML quant codecs in vectorised numpy: one class per type, registered by its GGMLQuantizationType id.

Decoders match `gguf.quants.dequantize` bit for bit (same float operations in the same order); the Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0 encoders match `gguf.quants.quantize` byte for byte. gguf-py has no K-quant encoders: Q4_K and
Q6_K here follow llama.cpp's `quantize_row_q4_K_ref` (make_qkx2_quants) and `quantize_row_q6_K_ref`
(make_qx_quants) step by step, f32 sums accumulated in the same sequential order, vectorised over blocks;
ggml's nearest_int (round half to even) is np.rint. They reproduce llama.cpp's bytes exactly (checked against
the compiled C on the whole SmolLM2 model; tests/test_quant.py holds a scalar transliteration as the oracle).
As in llama.cpp, one huge outlier in a K-quant super-block zeroes the 6-bit scales of its other sub-blocks.

Block layouts (little-endian; offsets in bytes within one block; f16 = IEEE half; x = decoded value):

| type | elems | bytes | layout (x = decoded value)                                                         |
|------|-------|-------|------------------------------------------------------------------------------------|
| F32  | 1     | 4     | f32                                                                                |
| F16  | 1     | 2     | f16                                                                                |
| Q4_0 | 32    | 18    | d f16 @0; qs u8[16] @2. elem j<16 = qs[j]&15, elem j+16 = qs[j]>>4. x = d*(q-8)    |
| Q4_1 | 32    | 20    | d f16 @0; m f16 @2; qs u8[16] @4 (nibbles as Q4_0). x = d*q + m                    |
| Q5_0 | 32    | 22    | d f16 @0; qh u32 @2 (bit j = bit 4 of elem j); qs u8[16] @6 (low 4 bits as Q4_0).  |
|      |       |       | x = d*(q-16)                                                                       |
| Q5_1 | 32    | 24    | d f16 @0; m f16 @2; qh u32 @4; qs u8[16] @8 (as Q5_0). x = d*q + m                 |
| Q8_0 | 32    | 34    | d f16 @0; qs i8[32] @2. x = d*q                                                    |
| Q4_K | 256   | 144   | d f16 @0; dmin f16 @2; scales u8[12] @4; qs u8[128] @16. 8 sub-blocks of 32.       |
|      |       |       | 6-bit scales s: for j<4: sc_j = s[j]&63, m_j = s[j+4]&63,                          |
|      |       |       | sc_{j+4} = (s[j+8]&15) + 16*(s[j]>>6), m_{j+4} = (s[j+8]>>4) + 16*(s[j+4]>>6).     |
|      |       |       | qs: chunk c<4, l<32: elem 64c+l = qs[32c+l]&15, elem 64c+32+l = qs[32c+l]>>4.      |
|      |       |       | x = (d*sc_j)*q - dmin*m_j, j = elem//32                                            |
| Q6_K | 256   | 210   | ql u8[128] @0; qh u8[64] @128; scales i8[16] @192; d f16 @208.                     |
|      |       |       | half h<2, l<32, e = 128h+l: low nibbles of elems e, e+32, e+64, e+96 are           |
|      |       |       | ql[64h+l]&15, ql[64h+32+l]&15, ql[64h+l]>>4, ql[64h+32+l]>>4; their high 2 bits    |
|      |       |       | are (qh[32h+l] >> 0, 2, 4, 6) & 3. q = low + 16*high - 32; x = (d*scales[e//16])*q |
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from gguf import GGMLQuantizationType

QK = 32  # elements per block of Q4_0 .. Q8_0, and per sub-block (one scale and min) of Q4_K / Q5_K
QK_K = 256
_GROUP_MAX_EPS = np.float32(1e-15)


class QuantError(ValueError):
    """Unknown quant type, or data/shape sizes that do not fit a type's blocks."""


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum f32 `terms` [n, S] over axis 0 left to right: C's `acc += t[i]` order, not numpy's pairwise sum."""
    acc = np.zeros(terms.shape[1:], dtype=np.float32)
    for row in terms:
        acc += row
    return acc


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """f32 [n, 1] -> uint8 [n, 2] (round to nearest even, like GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)


def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 at byte `offset` of each block, as f32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).astype(np.float32)


def _np_roundf(n: np.ndarray) -> np.ndarray:
    """Round half away from zero, exactly as gguf-py's np_roundf (floor + floor(2*frac))."""
    a = abs(n)
    floored = np.floor(a)
    b = floored + np.floor(2 * (a - floored))
    return np.sign(n) * b


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32k] in 0..15 -> [n, 16k]: low nibble = first half of each 32, high = second half."""
    n = q.shape[0]
    q = q.reshape((n, -1, 2, 16))
    return (q[:, :, 0, :] | (q[:, :, 1, :] << np.uint8(4))).reshape((n, -1))


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """Inverse of _pack_nibbles for 16-byte groups: uint8 [n, 16k] -> [n, 32k] in 0..15."""
    n = qs.shape[0]
    q = qs.reshape((n, -1, 1, 16)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    return (q & np.uint8(0x0F)).reshape((n, -1))


_CODECS: dict[GGMLQuantizationType, type[Codec]] = {}


class Codec:
    """One GGML type: vectorised block codec, f32 [n_blocks, block_size] <-> uint8 [n_blocks, type_size]."""

    qtype: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    f16_offsets: ClassVar[tuple[int, ...]]  # byte offsets of the f16 fields (scales) in a block

    def __init_subclass__(
        cls, qtype: GGMLQuantizationType, block_size: int, type_size: int, f16_offsets: tuple[int, ...]
    ) -> None:
        cls.qtype, cls.block_size, cls.type_size, cls.f16_offsets = qtype, block_size, type_size, f16_offsets
        _CODECS[qtype] = cls

    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """f32 [n_blocks, block_size] -> uint8 [n_blocks, type_size]."""
        raise NotImplementedError

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """uint8 [n_blocks, type_size] -> f32 [n_blocks, block_size]."""
        raise NotImplementedError


def _symmetric_codes(blocks: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0 rounding (ggml's reference): d = the block's largest-magnitude value / -half, codes
    q = round(x / d) + half in [0, 2 half - 1]; returns (d [n, 1], q uint8)."""
    imax = abs(blocks).argmax(axis=-1, keepdims=True)
    d = np.take_along_axis(blocks, imax, axis=-1) / -half
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, 0, 1 / d)
    q = np.trunc(blocks * inv + np.float32(half + 0.5), dtype=np.float32).astype(np.uint8).clip(0, 2 * half - 1)
    return d, q


def _min_max_codes(blocks: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1/Q5_1 rounding (ggml's reference): d = (max - min) / top, codes q = round((x - min) / d) in
    [0, top]; returns (d [n, 1], min [n, 1], q uint8)."""
    hi = blocks.max(axis=-1, keepdims=True)
    lo = blocks.min(axis=-1, keepdims=True)
    d = (hi - lo) / top
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, 0, 1 / d)
    q = np.trunc((blocks - lo) * inv + np.float32(0.5), dtype=np.float32).astype(np.uint8).clip(0, top)
    return d, lo, q


class F32(Codec, qtype=GGMLQuantizationType.F32, block_size=1, type_size=4, f16_offsets=()):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(blocks, dtype=np.float32).view(np.uint8)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(blocks).view(np.float32).copy()


class F16(Codec, qtype=GGMLQuantizationType.F16, block_size=1, type_size=2, f16_offsets=(0,)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        return _f16_bytes(blocks)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(blocks).view(np.float16).astype(np.float32)


class Q4_0(Codec, qtype=GGMLQuantizationType.Q4_0, block_size=32, type_size=18, f16_offsets=(0,)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, q = _symmetric_codes(blocks, 8)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d = _f16_field(blocks, 0)
        q = _unpack_nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        return d * q.astype(np.float32)


class Q4_1(Codec, qtype=GGMLQuantizationType.Q4_1, block_size=32, type_size=20, f16_offsets=(0, 2)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, lo, q = _min_max_codes(blocks, 15)
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
        q = _unpack_nibbles(blocks[:, 4:]).astype(np.float32)
        return (d * q) + m


class Q5_0(Codec, qtype=GGMLQuantizationType.Q5_0, block_size=32, type_size=22, f16_offsets=(0,)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, q = _symmetric_codes(blocks, 16)
        qh = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little").reshape((blocks.shape[0], 4))
        return np.concatenate([_f16_bytes(d), qh, _pack_nibbles(q & np.uint8(0x0F))], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d = _f16_field(blocks, 0)
        qh = np.unpackbits(blocks[:, 2:6], axis=-1, bitorder="little")
        q = (_unpack_nibbles(blocks[:, 6:]) | (qh << np.uint8(4))).astype(np.int8) - np.int8(16)
        return d * q.astype(np.float32)


class Q5_1(Codec, qtype=GGMLQuantizationType.Q5_1, block_size=32, type_size=24, f16_offsets=(0, 2)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, lo, q = _min_max_codes(blocks, 31)
        qh = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little").reshape((blocks.shape[0], 4))
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), qh, _pack_nibbles(q & np.uint8(0x0F))], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d, m = _f16_field(blocks, 0), _f16_field(blocks, 2)
        qh = np.unpackbits(blocks[:, 4:8], axis=-1, bitorder="little")
        q = (_unpack_nibbles(blocks[:, 8:]) | (qh << np.uint8(4))).astype(np.float32)
        return (d * q) + m


class Q8_0(Codec, qtype=GGMLQuantizationType.Q8_0, block_size=32, type_size=34, f16_offsets=(0,)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d = abs(blocks).max(axis=-1, keepdims=True) / 127
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, 0, 1 / d)
        q = _np_roundf(blocks * inv).astype(np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(d), q], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        d = _f16_field(blocks, 0)
        return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32) * d


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp make_qkx2_quants (use_mad=false) over sub-blocks laid out as columns: x, w f32 [n, S].

    Fits x ~ scale*L - the_min with L in 0..nmax by weighted least squares, trying nstep+1 inverse scales.
    Returns (L uint8 [n, S], scale f32 [S], the_min f32 [S]).
    """
    f32 = np.float32
    lo = np.minimum(np.minimum.reduce(x, axis=0), f32(0))
    hi = np.maximum.reduce(x, axis=0)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = hi == lo
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = f32(nmax) / (hi - lo)
        scale = 1 / iscale
        levels = np.clip(np.rint(iscale * (x - lo)), 0, nmax)
        diff = scale * levels + lo - x
        best_error = _seq_sum(w * (diff * diff))
        for step in range(nstep + 1):
            # as in C, `lo` (the current min) moves when a step improves the fit, and later steps use it
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (hi - lo)
            aux = np.clip(np.rint(iscale * (x - lo)), 0, nmax)
            wl = w * aux
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(wl * aux)
            sum_xl = _seq_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, f32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            diff = this_scale * aux + this_min - x
            cur_error = _seq_sum(w * (diff * diff))
            better = (det > 0) & (cur_error < best_error)
            levels = np.where(better, aux, levels)
            best_error = np.where(better, cur_error, best_error)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    levels = np.where(flat, f32(0), levels)
    scale = np.where(flat, f32(0), scale)
    return levels.astype(np.uint8), scale, -lo


class Q4_K(Codec, qtype=GGMLQuantizationType.Q4_K, block_size=QK_K, type_size=144, f16_offsets=(0, 2)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """llama.cpp quantize_row_q4_K_ref: per-32 (scale, min) by make_qkx2_quants, then 6-bit each."""
        f32 = np.float32
        n = blocks.shape[0]
        x = np.ascontiguousarray(blocks.reshape((n * 8, 32)).T)  # [32, sub-blocks]
        av_x = np.sqrt(_seq_sum(x * x) / f32(32))
        levels, scales, mins = _make_qkx2_quants(x, av_x + np.abs(x), 15, -1.0, 0.1, 20)
        scales, mins = scales.reshape((n, 8)), mins.reshape((n, 8))

        max_scale = np.maximum(scales.max(axis=-1, keepdims=True), f32(0))
        max_min = np.maximum(mins.max(axis=-1, keepdims=True), f32(0))
        with np.errstate(divide="ignore"):
            inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
            inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
        # C stores nearest_int() in a uint8 before MIN(63, .): keep the wrap-around.
        ls = np.minimum(np.rint(inv_scale * scales).astype(np.int32) & 0xFF, 63).astype(np.uint8)
        lm = np.minimum(np.rint(inv_min * mins).astype(np.int32) & 0xFF, 63).astype(np.uint8)
        d = _f16_bytes(max_scale / f32(63))
        dmin = _f16_bytes(max_min / f32(63))

        d_sub = (_f16_field(d, 0) * ls.astype(np.float32)).reshape(-1)
        dm_sub = (_f16_field(dmin, 0) * lm.astype(np.float32)).reshape(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            requant = np.clip(np.rint((x + dm_sub) / d_sub), 0, 15)
        levels = np.where(d_sub != 0, requant, levels).astype(np.uint8)  # C skips sub-blocks with d == 0
        q = levels.T.reshape((n, QK_K))

        packed = np.empty((n, 12), dtype=np.uint8)
        packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
        packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
        qs = q.reshape((n, 4, 2, 32))
        qs = (qs[:, :, 0, :] | (qs[:, :, 1, :] << np.uint8(4))).reshape((n, 128))
        return np.concatenate([d, dmin, packed, qs], axis=-1)

    @staticmethod
    def scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unpack the 12 scale bytes -> (sc uint8 [n, 8], m uint8 [n, 8]) (ggml get_scale_min_k4)."""
        s = scales.reshape((-1, 3, 4))
        a, b, c = s[:, 0, :], s[:, 1, :], s[:, 2, :]
        sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
        m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
        return sc, m

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)
        sc, m = cls.scale_min(blocks[:, 4:16])
        d = (d * sc.astype(np.float32)).reshape((n, 8, 1))
        dm = (dmin * m.astype(np.float32)).reshape((n, 8, 1))
        q = blocks[:, 16:].reshape((n, 4, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
        q = (q & np.uint8(0x0F)).reshape((n, 8, 32)).astype(np.float32)
        return (d * q - dm).reshape((n, QK_K))


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp make_qx_quants (rmse_type=1, no importance weights) over columns: x f32 [n, S].

    Symmetric fit x ~ scale*(L - nmax), L in 0..2*nmax-1, weights x^2, trying 19 inverse scales.
    Returns (L uint8 [n, S], scale f32 [S]).
    """
    f32 = np.float32
    imax = np.abs(x).argmax(axis=0)
    xmax = np.take_along_axis(x, imax[None, :], axis=0)[0]
    zero = np.abs(xmax) < _GROUP_MAX_EPS
    xmax = np.where(zero, f32(1), xmax)
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        return lv, _seq_sum(wx * lv), _seq_sum(w * lv * lv)

    lv, sumlx, suml2 = fit(f32(-nmax) / xmax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            cand, sumlx, suml2 = fit(-(f32(nmax) + f32(0.1) * f32(step)) / xmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            lv = np.where(better, cand, lv)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    levels = np.where(zero, 0, lv + nmax).astype(np.uint8)
    return levels, np.where(zero, f32(0), scale)


class Q6_K(Codec, qtype=GGMLQuantizationType.Q6_K, block_size=QK_K, type_size=210, f16_offsets=(208,)):
    @classmethod
    def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """llama.cpp quantize_row_q6_K_ref: per-16 scale by make_qx_quants, then 8-bit sub-block scales."""
        f32 = np.float32
        n = blocks.shape[0]
        x = np.ascontiguousarray(blocks.reshape((n * 16, 16)).T)  # [16, sub-blocks]
        levels, scales = _make_qx_quants(x, 32)
        scales = scales.reshape((n, 16))

        imax = np.abs(scales).argmax(axis=-1)[:, None]
        max_scale = np.take_along_axis(scales, imax, axis=-1)
        empty = np.abs(max_scale) < _GROUP_MAX_EPS  # C writes an all-zero block
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(empty, f32(0), f32(-128) / np.where(empty, f32(1), max_scale))
            d = _f16_bytes(np.where(empty, f32(0), 1 / iscale))
        sc = np.minimum(np.rint(iscale * scales), 127).astype(np.int8)
        sc = np.where(empty, np.int8(0), sc)

        d_sub = (_f16_field(d, 0) * sc.astype(np.float32)).reshape(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            requant = np.clip(np.rint(x / d_sub), -32, 31) + 32
        levels = np.where(d_sub != 0, requant, levels).astype(np.uint8)  # C skips sub-blocks with d == 0
        q = levels.T.reshape((n, 2, 4, 32))
        q = np.where(empty.reshape((n, 1, 1, 1)), np.uint8(0), q)

        lo = q & np.uint8(0x0F)
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
        hi = q >> np.uint8(4)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        return np.concatenate([ql.reshape((n, 128)), qh.reshape((n, 64)), sc.view(np.uint8), d], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        n = blocks.shape[0]
        scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = (_f16_field(blocks, 208) * scales).reshape((n, 16, 1))
        ql = blocks[:, :128].reshape((n, 2, 1, 64)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
        ql = (ql & np.uint8(0x0F)).reshape((n, 8, 32))
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
        qh = blocks[:, 128:192].reshape((n, 2, 1, 32)) >> shifts
        qh = (qh & np.uint8(0x03)).reshape((n, 8, 32))
        q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (d * q.reshape((n, 16, 16)).astype(np.float32)).reshape((n, QK_K))


SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_CODECS)


def codec(qtype: int) -> type[Codec]:
    """The codec class for a GGMLQuantizationType (or its int id); QuantError if unsupported."""
    try:
        return _CODECS[GGMLQuantizationType(int(qtype))]
    except (ValueError, KeyError):
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        try:
            name = GGMLQuantizationType(int(qtype)).name
        except ValueError:
            name = f"unknown type id {qtype}"
        raise QuantError(f"quant type {name} is not supported (supported: {names})") from None


def block_size(qtype: int) -> int:
    """Elements per block of `qtype`."""
    return codec(qtype).block_size


def type_size(qtype: int) -> int:
    """Bytes per block of `qtype`."""
    return codec(qtype).type_size


def row_bytes(qtype: int, row_len: int) -> int:
    """Bytes of one row of `row_len` elements; QuantError if `row_len` is not a whole number of blocks."""
    c = codec(qtype)
    if row_len <= 0 or row_len % c.block_size:
        raise QuantError(
            f"{c.qtype.name}: row length {row_len} is not a positive multiple of block size {c.block_size}"
        )
    return row_len // c.block_size * c.type_size


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode `data` (uint8 rows as GGUFReader returns them, any dtype, or flat) into f32 of numpy `shape`.

    `shape` is the logical tensor shape in numpy order, (..., row_len).
    """
    c = codec(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise QuantError(f"{c.qtype.name}: empty shape")
    n_rows = math.prod(shape[:-1])
    want = n_rows * row_bytes(c.qtype, shape[-1])
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size != want:
        raise QuantError(
            f"{c.qtype.name}: {raw.size} bytes of data do not hold shape {shape} "
            f"({n_rows} rows x {row_bytes(c.qtype, shape[-1])} bytes = {want} bytes)"
        )
    blocks = raw.reshape((-1, c.type_size))
    return c.dequantize_blocks(blocks).reshape(shape)


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """Encode f32 `values` [..., row_len] as `qtype`: uint8 [..., row_bytes(qtype, row_len)].

    QuantError on NaN/inf input, or when a block's f16 scale would overflow (quantize_blocks itself mirrors
    gguf-py/llama.cpp and would silently store inf).
    """
    c = codec(qtype)
    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 0:
        raise QuantError(f"{c.qtype.name}: cannot quantize a scalar")
    nbytes = row_bytes(c.qtype, values.shape[-1])
    if not np.isfinite(values).all():
        raise QuantError(f"{c.qtype.name}: cannot quantize NaN/inf values (tensor shape {values.shape})")
    blocks = np.ascontiguousarray(values).reshape((-1, c.block_size))
    out = c.quantize_blocks(blocks)
    assert out.dtype == np.uint8 and out.shape == (blocks.shape[0], c.type_size), (c.qtype.name, out.shape)
    for off in c.f16_offsets:
        if not np.isfinite(np.ascontiguousarray(out[:, off : off + 2]).view(np.float16)).all():
            raise QuantError(
                f"{c.qtype.name}: a block scale overflows f16 (max |value| {np.abs(values).max():g} "
                f"in shape {values.shape}); use a wider type"
            )
    return out.reshape((*values.shape[:-1], nbytes))


def choose_student_type(
    row_len: int, preferred: int = GGMLQuantizationType.Q4_K, fallback: int = GGMLQuantizationType.Q4_0
) -> GGMLQuantizationType:
    """`preferred` (default Q4_K) when `row_len` is a multiple of its block size (256 for K-quants), else
    `fallback` (default Q4_0, block 32); QuantError if `row_len` fits neither."""
    for qtype in (preferred, fallback):
        c = codec(qtype)
        if row_len > 0 and row_len % c.block_size == 0:
            return c.qtype
    p, f = codec(preferred), codec(fallback)
    if p.qtype == f.qtype:
        raise QuantError(f"row length {row_len} is not a multiple of {p.qtype.name}'s block {p.block_size}")
    raise QuantError(
        f"row length {row_len} is a multiple of neither {p.qtype.name} (block {p.block_size}) "
        f"nor {f.qtype.name} (block {f.block_size})"
    )


def requantize(
    values_f32: np.ndarray,
    preferred: int = GGMLQuantizationType.Q4_K,
    fallback: int = GGMLQuantizationType.Q4_0,
) -> tuple[GGMLQuantizationType, np.ndarray]:
    """Quantize f32 [..., row_len] as choose_student_type(row_len, ...): returns (qtype, uint8 rows)."""
    values_f32 = np.asarray(values_f32, dtype=np.float32)
    if values_f32.ndim == 0:
        raise QuantError("requantize: cannot quantize a scalar")
    qtype = choose_student_type(values_f32.shape[-1], preferred, fallback)
    return qtype, quantize(values_f32, qtype)
