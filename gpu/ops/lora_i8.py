"""LoRA's thin product t = x A^T on the integer tensor cores, from the codes the projection's integer GEMM reads
(gpu/kernels/lora_thin_i8.wgsl, then lora_thin_i8_finish.wgsl).

With precision int8 each projection's input x is quantized once for its frozen GEMM (rotated in Walsh-Hadamard
blocks, a scale per row). t = x A^T of its adapter (or of the adapters sharing x: q, k, v; gate, up, as column
groups) then reads those codes, one byte a value instead of the f32 x that lora_matmul reads, against the codes of
A rotated the same way ((x R)(A R)^T = x A^T; LoraCodes, refreshed with the f16 mirrors before each forward), on the
i8 MMAs: i32 sums per chunk of K (exact), added in order and scaled by both row scales in the second pass, which
also writes t's f16 copy for the GEMM's LoRA epilogue. Numerics: A rounded to 8 bits of its row's max on top of
x's rounding, which the frozen GEMM already takes; on the demo (numpy study, 2026-12-07, docs/benchmarks.md) the
adapter trained so reached a held-out KL 0.5 % lower than with t from f32 x and A (within noise), and on an H200 the
int8 gate +0.52 % over the f16 path. On by default: +1.75 % on the Llama-3-8B step, +2.7 % on the real SmolLM2 (H200
A/Bs, 2026-12-07); bench/train_step.py --ab lora-t-f32 for t from f32 x."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gpu.codegen_lora_i8 import NBS, STEP_CODES
from gpu.device import Device, DeviceError
from gpu.ops.common import grid, pack
from gpu.ops.lora_matmul import MAX_GROUPS, HalfCopy, scratch_for
from gpu.ops.matmul_i8 import Int8Matrix, int8_emulated
from gpu.ops.quantize_i8 import row_workgroup, tint
from gpu.profile import scope
from gpu.registry import pipeline
from model.lora_layout import LoraSlot

THIN_I8 = True  # GPUModel's int8 forward takes t = x A^T from x's codes (off: lora_matmul over f32 x)
# GPUStudent's int8 backward takes dt = s dY B from the input gradient's dY codes and B / sW (off: lora_matmul over
# f32 dY): +1.5 % on the Llama-3-8B step (H100, 2026-12-07); the int8 gate +0.28 % held-out KL over the f16 path.
THIN_DT = True
BM = 64  # rows of x per workgroup (lora_thin_i8.wgsl)
TARGET_WORKGROUPS = 512  # split K until about this many workgroups run
MIN_STEPS = 4  # steps of STEP_CODES per chunk at least


class AdapterCodes:
    """The right operand of lora_thin_i8: int8 codes of r rows per adapter in `codes` (packed four per word) and a
    scale per row in `scales`; `_at` maps each covered adapter to (its first vec4 of codes, its first scale)."""

    r: int
    codes: Any
    scales: Any
    _at: dict[tuple[int, str], tuple[int, int]]

    def covers(self, keys: Sequence[tuple[int, str]]) -> bool:
        return all(key in self._at for key in keys)

    def offsets(self, key: tuple[int, str]) -> tuple[int, int]:
        """(first vec4 of the codes, first scale) of adapter `key`."""
        return self._at[key]


class LoraCodes(AdapterCodes):
    """Every adapter's A as int8 codes [r, d_in] rotated like its projection's weight codes (`rotation`: the block
    for an input width, 0 for none), a scale per row, in one codes and one scales buffer; `refresh` rewrites them
    from the f32 parameters. Adapters whose d_in is no multiple of STEP_CODES, or whose rows the table quantizer does
    not take (unrotated, or longer than its registers hold), are left out (`covers`)."""

    def __init__(
        self, dev: Device, slots: Mapping[tuple[int, str], LoraSlot], r: int, rotation: Callable[[int], int]
    ) -> None:
        self.r = r
        self._at: dict[tuple[int, str], tuple[int, int]] = {}
        tables: dict[tuple[int, int, int], list[tuple[int, int, int, int]]] = {}  # (d_in, rot, wg) -> (x, q, s, 0)
        codes = scales = 0
        for key, s in slots.items():
            rot, wg = rotation(s.d_in), row_workgroup(s.d_in)
            if s.d_in % STEP_CODES or not rot or s.d_in > 64 * wg or s.a_off % 4:
                continue
            self._at[key] = (codes // 16, scales)
            rows = tables.setdefault((s.d_in, rot, wg), [])
            rows += [(s.a_off + i * s.d_in, (codes + i * s.d_in) // 16, scales + i, 0) for i in range(r)]
            codes += r * s.d_in
            scales += r
        self.codes = dev.buffer(max(codes, 16), label="lora A int8 codes")
        self.scales = dev.buffer(4 * max(scales, 4), label="lora A int8 scales")
        self._tables = [
            (k, rot, wg, dev.upload(np.asarray(rows, np.uint32).reshape(-1), label=f"lora A rows {k}"), len(rows))
            for (k, rot, wg), rows in sorted(tables.items())
        ]

    def refresh(self, dev: Device, params: Any) -> None:
        """Quantize every covered adapter's A from the f32 parameters (one dispatch per input width)."""
        for k, rot, wg, table, rows in self._tables:
            pipe = pipeline(dev, "quantize_i8_table", rot=rot, tint=tint(dev), wg=wg)
            prm = pack(k, k, 0, k, 1, rows, 1, 0)  # quantize_i8.wgsl's Params: one chunk a row, a row a workgroup
            dev.dispatch(pipe, [prm, params, self.codes, self.scales, table], (1, rows))


class LoraGradCodes(AdapterCodes):
    """Every adapter's B / sW as int8 codes [r, d_out] (row n: B's column n over sW, the row scales of its
    projection's weight codes, which the input gradient's int8 dY carries), a scale per row times the LoRA scale:
    the right operand of dt = s dY B on lora_thin_i8 over dY's codes. `row_scales` maps a key to its sW buffer
    (fixed once the weights' row scales are kept: GPUModel.keep_codes); adapters without one, or whose d_out is no
    multiple of STEP_CODES, are left out (`covers`). `refresh` rewrites the codes from the f32 parameters, in one
    dispatch (gpu/kernels/lora_b_codes.wgsl)."""

    def __init__(
        self,
        dev: Device,
        slots: Mapping[tuple[int, str], LoraSlot],
        r: int,
        scale: float,
        row_scales: Mapping[tuple[int, str], Any],
    ) -> None:
        self.r, self._scale = r, float(scale)
        self._at: dict[tuple[int, str], tuple[int, int]] = {}
        self._sw_at: dict[tuple[int, str], int] = {}
        rows: list[tuple[int, int, int, int]] = []
        copies: list[tuple[Any, int, int]] = []
        codes = sw = 0
        for key, s in slots.items():
            if s.d_out % STEP_CODES or key not in row_scales:
                continue
            self._at[key] = (codes // 16, len(rows))
            self._sw_at[key] = sw
            rows += [(s.b_off + n, sw, s.d_out, (codes + n * s.d_out) // 4) for n in range(r)]
            copies.append((row_scales[key], sw, s.d_out))
            codes += r * s.d_out
            sw += s.d_out
        self.codes = dev.buffer(max(codes, 16), label="lora B / sW int8 codes")
        self.scales = dev.buffer(4 * max(len(rows), 4), label="lora B / sW int8 scales")
        self.sw = dev.buffer(4 * max(sw, 4), label="lora sW")  # every covered adapter's sW (sw_offset)
        for buf, off, n in copies:
            dev.copy(buf, self.sw, 4 * n, dst_offset=4 * off)
        self._table = dev.upload(np.asarray(rows or [(0, 0, 0, 0)], np.uint32).reshape(-1), label="lora B rows")
        self._rows = len(rows)

    def sw_offset(self, key: tuple[int, str]) -> int:
        """The first float of adapter `key`'s sW in self.sw."""
        return self._sw_at[key]

    def refresh(self, dev: Device, params: Any) -> None:
        """Quantize every covered adapter's B / sW from the f32 parameters (one dispatch)."""
        if self._rows:
            prm = pack(self._rows, self.r, self._scale, 0)
            bind = [prm, params, self.sw, self.codes, self.scales, self._table]
            dev.dispatch(pipeline(dev, "lora_b_codes"), bind, grid(self._rows, 1))


def thin_covers(x: Int8Matrix, n_cols: int) -> bool:
    """Whether lora_thin_i8 takes an n_cols-column product over the int8 operand x."""
    return x.chunks == 1 and x.k % STEP_CODES == 0 and n_cols % 16 == 0 and n_cols // 16 in NBS


def pick_chunk(m: int, k: int) -> tuple[int, int]:
    """(splits, codes per split) of K for an m-row product: about TARGET_WORKGROUPS workgroups, chunks of whole
    steps, at least MIN_STEPS of them."""
    steps = k // STEP_CODES
    tiles = -(-m // BM)
    splits = max(1, min(math.ceil(TARGET_WORKGROUPS / tiles), steps // MIN_STEPS))
    per = -(-steps // splits)
    return -(-steps // per), per * STEP_CODES


def _four(values: Sequence[int]) -> list[int]:
    return [*values, *[0] * (MAX_GROUPS - len(values))]


def lora_thin_i8(
    dev: Device,
    x: Int8Matrix,
    codes: AdapterCodes,
    keys: Sequence[tuple[int, str]],
    t: Any,
    t_offsets: Sequence[int],
    half: HalfCopy | None = None,
) -> None:
    """t_g [M, r] = x A_g^T for the adapters `keys` (column groups) reading x's int8 codes: t_g at float
    t_offsets[g] of t (a buffer or view); half: each also as f16(factor t_g) at its offset of half.buf (row length
    r). With LoraGradCodes, x is the input gradient's dY codes and the product dt = s dY B."""
    r, m = codes.r, x.rows
    n = r * len(keys)
    if not (1 <= len(keys) <= MAX_GROUPS and len(t_offsets) == len(keys) and codes.covers(keys)):
        raise DeviceError(f"lora_thin_i8: adapters {list(keys)} (1..{MAX_GROUPS} covered, one t offset each)")
    if not thin_covers(x, n):
        raise DeviceError(f"lora_thin_i8 over {x.name!r}: {x.chunks} scales a row, K {x.k}, {n} columns not covered")
    if half is not None and (len(half.offsets) != len(keys) or half.ld != r):
        raise DeviceError("lora_thin_i8: the f16 copy needs an offset per adapter and rows of r")
    splits, chunk = pick_chunk(m, x.k)
    mp = -(-m // BM) * BM
    part = scratch_for(dev, 4 * splits * mp * n)
    a_go = _four([codes.offsets(key)[0] for key in keys])
    s_go = _four([codes.offsets(key)[1] for key in keys])
    with scope(dev, "lora"):
        prm = pack(m, n, x.k, chunk, x.k // 16, 0, r, mp, *a_go)
        pipe = pipeline(dev, "lora_thin_i8", nb=n // 16, tint=not int8_emulated(dev))
        dev.dispatch(pipe, [prm, x.codes, codes.codes, part], (mp // BM, splits, 1))
        factor = half.factor if half is not None else 1.0
        h_go = _four(half.offsets if half is not None else [])
        prm = pack(m * n, n, splits, r, mp, 0, float(factor), 0, *s_go, *_four(t_offsets), *h_go)
        bind = [prm, part, x.scales, codes.scales, t] + ([half.buf] if half is not None else [])
        dev.dispatch(pipeline(dev, "lora_thin_i8_finish", half=half is not None), bind, grid(m * n, 256))
