"""LoRA's dB = s dY^T t on the integer tensor cores, from the input gradient's int8 dY codes (gpu/kernels/
lora_cols_i8.wgsl, lora_sum_i8.wgsl, lora_sum_i8_finish.wgsl).

With precision int8 the input gradient dX = dY W of a projection runs on the integer GEMM over the codes of dY sW
(sW: the weight's row scales; one scale sdY per row). dB[o, n] = s sum_m dY[m, o] t[m, n] = (s / sW[o]) sum_m
qdY[m, o] u[m, n] with u = sdY t: u is rounded to 8 bits per column over chunks of rows (a scale each), the chunks'
sums run on the i8 MMAs over qdY read column-major (one byte a value instead of the f32 dY that lora_matmul reads),
and a second pass adds the chunks times their scales, over sW. Where sW[o] is 0 the codes of dY's column o are 0,
and so is dB's row o. The numpy twin is bench/int8_activation_kl.py's `:g8` (dt8_backward)."""

from __future__ import annotations

from typing import Any

from gpu.codegen_lora_i8 import NBS, STEP_CODES
from gpu.device import Device, DeviceError
from gpu.ops.common import grid, pack
from gpu.ops.lora_matmul import scratch_for
from gpu.ops.matmul_i8 import Int8Matrix, int8_emulated
from gpu.profile import scope
from gpu.registry import pipeline

# GPUStudent's int8 backward takes dB from the input gradient's dY codes where it takes dt from them (THIN_DT; off:
# lora_matmul over f32 dY): +2.3 % on the Llama-3-8B step (H100, 2026-12-07), the int8 gate +0.69 % held-out KL.
THIN_DB = True
ROWS_PER_SCALE = 256  # rows of u per column scale at most (lora_cols_i8.wgsl), and per workgroup row of the sums
BI = 64  # outputs per workgroup (lora_sum_i8.wgsl)
_codes: dict[Device, tuple[Any, Any]] = {}


def row_chunk(m: int) -> int:
    """Rows per column scale of u for m rows: the largest multiple of STEP_CODES up to ROWS_PER_SCALE dividing m (0:
    none does)."""
    return max((c for c in range(STEP_CODES, ROWS_PER_SCALE + 1, STEP_CODES) if m % c == 0), default=0)


def shape_covered(rows: int, k: int, n: int) -> bool:
    """Whether column_sums takes n columns over an int8 operand of rows x k with one scale a row."""
    return k % BI == 0 and n % 16 == 0 and n // 16 in NBS and row_chunk(rows) > 0


def covers(big: Int8Matrix, n: int) -> bool:
    """Whether column_sums takes n columns over the int8 operand `big` (one scale a row, its width in whole tiles)."""
    return big.chunks == 1 and shape_covered(big.rows, big.k, n)


def db_covers(dy: Int8Matrix, r: int) -> bool:
    """Whether lora_db_i8 takes dB of rank r over the int8 operand dy."""
    return covers(dy, r)


def _u_buffers(dev: Device, codes: int, scales: int) -> tuple[Any, Any]:
    """The device's buffers of u's codes and scales, grown to hold `codes` bytes and `scales` floats (built once
    per largest shape, so bind groups stay cached across steps)."""
    have = _codes.get(dev)
    if have is None or have[0].size < codes or have[1].size < 4 * scales:
        old = (0, 0) if have is None else (have[0].size, have[1].size)
        have = (
            dev.buffer(max(codes, 16, old[0]), label="lora u int8 codes"),
            dev.buffer(max(4 * scales, 16, old[1]), label="lora u int8 scales"),
        )
        _codes[dev] = have
    return have


def column_sums(dev: Device, big: Int8Matrix, s: Any, offs: tuple[int, ...], cols: int) -> tuple[Any, Any, int]:
    """The first two passes of a product over big's rows: u = big's row scales times the N = cols len(offs) columns of
    S (row-major [M, cols] blocks at float offsets offs of s) rounded per column over chunks of rows, and the chunks'
    i32 sums P[z, i, n] = sum over chunk z of big's codes (i) times u's (n) on the integer MMAs. Returns (P, u's
    column scales CS [splits, N], splits) for lora_sum_i8_finish."""
    m, d, n = big.rows, big.k, cols * len(offs)
    if len(offs) > 4 or not covers(big, n):
        what = f"{m} rows of {d} codes in {big.chunks} chunks, {n} columns"
        raise DeviceError(f"LoRA integer sums over {big.name!r}: {what}")
    chunk = row_chunk(m)
    splits = m // chunk
    q, cs = _u_buffers(dev, n * m, splits * n)
    part = scratch_for(dev, 4 * splits * d * n)
    prm = pack(m, n, chunk, cols, *offs, *(0,) * (4 - len(offs)))
    dev.dispatch(pipeline(dev, "lora_cols_i8"), [prm, s, big.scales, q, cs], grid(splits * n, 1))
    prm = pack(m, d, n, chunk)
    pipe = pipeline(dev, "lora_sum_i8", nb=n // 16, tint=not int8_emulated(dev))
    dev.dispatch(pipe, [prm, big.codes, q, part], (d // BI, splits, 1))
    return part, cs, splits


def lora_db_i8(
    dev: Device,
    dy: Int8Matrix,
    t: Any,
    r: int,
    sw: Any,
    sw_off: int,
    scale: float,
    db: Any,
    db_off: int = 0,
    *,
    accumulate: bool = False,
) -> None:
    """dB [d_out, r] (+)= scale dY^T t at float db_off of db, from dY's int8 codes `dy` (dY sW, a scale a row), t
    [M, r] f32 (row-major, a buffer or view) and sW, the d_out row scales at float sw_off of sw."""
    d = dy.k
    with scope(dev, "lora"):
        part, cs, splits = column_sums(dev, dy, t, (0,), r)
        prm = pack(d * r, r, splits, db_off, sw_off, accumulate, float(scale), r, 0, 0, 0, 0)
        pipe = pipeline(dev, "lora_sum_i8_finish", cols=False)
        dev.dispatch(pipe, [prm, part, cs, sw, db], grid(d * r, 256))
