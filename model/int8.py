"""8-bit operands of the integer tensor-core GEMM (gpu/ops/matmul_i8.py): symmetric int8 codes with one f32 scale
per row and chunk of `chunk` consecutive elements along the reduction axis. The numpy twin of
gpu/kernels/quantize_i8.wgsl and the reference of the GEMM:

    x[r, c*chunk + i] ~ scale[r, c] * code[r, c*chunk + i],  scale = max|x[r, chunk c]| / 127,  |code| <= 127

so a GEMM over int8 operands is exact in i32 within a chunk and the chunk's partial sum is scaled once:
    Y[m, n] = sum_c  sa[m, c] * sw[n, c] * sum_{k in chunk c} A[m, k] W[n, k].
Rounding: to nearest, ties to even (WGSL round()); an all-zero chunk gets scale 0 and codes 0. Relative to
max|x| of its chunk, a value is represented to within 1/254.
"""

from __future__ import annotations

import numpy as np

QMAX = 127
# Walsh-Hadamard block sizes of the rotated integer GEMM (0: none): a projection of input width k rotates in blocks
# of rotation_block(k) (the kernels hold a row of at most ROTATED_MAX values in registers).
ROTATIONS = (0, 32, 64, 128)
ROTATED_MAX = 16384
# Invocations a row of the GPU's per-row int8 kernels (activation quantizer, Q4_K decode): 256, or 64 for rows of
# at most SHORT_ROW values (a quarter of the registers' reach: more rows in flight per multiprocessor).
ROW_WORKGROUPS = (64, 256)
SHORT_ROW = 4096
# The gated unit's backward with both gradients' codes (glu_back_i8) holds GLU_BACK_SLOTS vec4 pairs an invocation:
# rows of at most 4 x GLU_BACK_SLOTS x the largest of its workgroup sizes (the smallest that holds the row runs).
GLU_BACK_WORKGROUPS = (64, 128, 256, 512, 1024)
GLU_BACK_SLOTS = 8
# The RMSNorm backward turns a rotated dY back in workgroup memory: rows of at most this many values (16 KiB).
NORM_TURNED_MAX = 4096


def check_chunk(k: int, chunk: int, *, what: str = "rows") -> int:
    """The number of chunks of a row of length k; chunk must divide k and be a multiple of 32 (one MMA step)."""
    if chunk <= 0 or chunk % 32 or k % chunk:
        raise ValueError(f"int8 chunk {chunk} for {what} of length {k}: must be a multiple of 32 dividing {k}")
    return k // chunk


def quantize_i8(x: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [rows, k], scales float32 [rows, k / chunk]) of float32 x [rows, k]."""
    x = np.ascontiguousarray(x, np.float32)
    rows, k = x.shape
    n = check_chunk(k, chunk)
    blocks = x.reshape(rows, n, chunk)
    scale = (np.abs(blocks).max(axis=2) / np.float32(QMAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -QMAX, QMAX).astype(np.int8)
    return codes.reshape(rows, k), scale


def dequantize_i8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of (codes [rows, k], scales [rows, k / chunk])."""
    rows, k = codes.shape
    n = scales.shape[1]
    return (codes.reshape(rows, n, k // n).astype(np.float32) * scales[:, :, None]).reshape(rows, k)


def gemm_i8_reference(
    a_codes: np.ndarray, a_scales: np.ndarray, w_codes: np.ndarray, w_scales: np.ndarray
) -> np.ndarray:
    """float64 Y[m, n] = sum_c sa[m, c] sw[n, c] sum_{k in c} A[m, k] W[n, k] (the integer GEMM's definition)."""
    k = a_codes.shape[1]
    size = k // a_scales.shape[1]
    out = np.zeros((a_codes.shape[0], w_codes.shape[0]))
    for c in range(a_scales.shape[1]):  # float64 sums of integer products are exact (|sum| << 2^53)
        part = a_codes[:, c * size : (c + 1) * size].astype(np.float64) @ w_codes[:, c * size : (c + 1) * size].T
        out += part * a_scales[:, c, None].astype(np.float64) * w_scales[None, :, c].astype(np.float64)
    return out


def pack_i8(codes: np.ndarray) -> np.ndarray:
    """int8 [rows, k] (k % 4 == 0) as little-endian uint32 words, four codes each (the kernels' layout)."""
    codes = np.ascontiguousarray(codes, np.int8)
    return codes.view(np.uint32).reshape(codes.shape[0], -1) if codes.ndim == 2 else codes.view(np.uint32)


def rotation_block(k: int) -> int:
    """The rotation block of rows of length k: the largest of ROTATIONS dividing k (0 when none does, or when k is
    longer than ROTATED_MAX)."""
    return max((b for b in ROTATIONS if b and k % b == 0), default=0) if k <= ROTATED_MAX else 0


def rotation_signs(k: int, col0: int = 0) -> np.ndarray:
    """The rotation's pseudo-random signs of columns col0 .. col0 + k - 1: bit 13 of col * 0x9E3779B1 (mod 2^32)
    set gives -1 (the kernels' hadamard.wgsl with_signs)."""
    col = np.arange(col0, col0 + k, dtype=np.uint64)
    return (1.0 - 2.0 * (((col * np.uint64(0x9E3779B1)) >> np.uint64(13)) & np.uint64(1))).astype(np.float32)


def hadamard_rows(x: np.ndarray, block: int, *, back: bool = False) -> np.ndarray:
    """x [rows, k] R (back: x R^T, which undoes it), R = S H_b: S the diagonal of rotation_signs(k), H_b
    block-diagonal, each block the orthonormal Walsh-Hadamard matrix H / sqrt(block) (Sylvester order, H[i, j] =
    (-1)^popcount(i & j), symmetric), so R R^T = I. The signs keep a block's mean out of one coefficient (the
    plain Hadamard's first row is all ones; activations have means). float64 from float32 x; block 0: x itself."""
    x = np.asarray(x, np.float32)
    if block == 0:
        return x.copy()
    rows, k = x.shape
    if block & (block - 1) or k % block:
        raise ValueError(f"hadamard block {block} for rows of {k}: must be a power of two dividing {k}")
    signs = rotation_signs(k).astype(np.float64)
    y = (x.astype(np.float64) * (1.0 if back else signs)).reshape(rows * (k // block), block)
    h = 1
    while h < block:
        y = y.reshape(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = a + b, a - b
        h *= 2
    y = y.reshape(rows, k) / np.sqrt(block)
    return (y * signs if back else y).astype(np.float32)


def mix32(v: np.ndarray) -> np.ndarray:
    """The low-bias 32-bit integer hash (lowbias32) of u32 values, as gpu/kernels/kd_probs_i8.wgsl's mix32."""
    x = np.asarray(v, np.uint32).copy()
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def dither(seed: int, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """u in [0, 1) (24 bits) of (row, vocab id) pairs under `seed`: kd_probs_i8.wgsl's dither_at."""
    rows, ids = np.asarray(rows, np.uint32), np.asarray(ids, np.uint32)
    with np.errstate(over="ignore"):
        h = mix32(np.uint32(seed) ^ mix32((rows * np.uint32(0x9E3779B1)) ^ mix32(ids)))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def stochastic_probs_i8(p: np.ndarray, seed: int, c0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [rows, nv], scales float32 [rows]) of non-negative p [rows, nv] (a vocab chunk's probabilities
    times W's row scales, columns = vocab ids c0 ..): scale max / 127 per row, code min(floor(p / scale + u), 127)
    with u = dither(seed, row, id): unbiased, E[code scale] = p (kd_probs_i8.wgsl)."""
    p = np.asarray(p, np.float32)
    rows, nv = p.shape
    scale = (p.max(axis=1) / np.float32(QMAX)).astype(np.float32)
    u = dither(seed, np.arange(rows)[:, None], np.arange(c0, c0 + nv)[None, :])
    safe = np.where(scale > 0, scale, np.float32(1))[:, None]
    codes = np.where(scale[:, None] > 0, np.minimum(np.floor(p / safe + u), np.float32(QMAX)), 0)
    return codes.astype(np.uint8), scale
