"""Integer tensor-core GEMM: Y = X.W^T over int8 codes with per-(row, chunk) f32 scales (model/int8.py), i32
accumulation on Dawn's i8 subgroup matrices (16 x 16 x 32); gpu/ops/quantize_i8.py quantizes the activations.

Numerics: each operand is rounded to 8 bits relative to the largest |value| of its row's chunk (error <=
max / 254 per value); the integer products are exact, each chunk's sum is scaled once in f32. The result
matches model/int8.py's float64 reference on the same codes to f32 rounding (~1e-6 relative)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gpu.codegen_i8 import MMA_K, I8Config, I8Variant, matmul_i8_source
from gpu.device import Device, DeviceError
from gpu.ops.common import nbytes
from gpu.ops.matmul_tc import matrix_problem
from model.int8 import check_chunk, pack_i8, quantize_i8

# Presets, measured on an H200 (docs/benchmarks.md, 2026-12-05; bench/gemm_i8.py --sweep): one scale per row
# (one chunk): 4 x 2 subgroups of 4 x 4 matrices, a 256 x 128 tile, 64 codes staged per step with register
# prefetch: 438 / 450 TOPS at 4096 x 4096 x 4096 / 4096 x 14336 x 4096 (2 x 4 subgroups: 455 / 461, but slower
# on the "nn" GEMM; 128 x 128 tiles: 280-413). Several chunks keep f32 partials in registers beside the i32
# matrices, so 4 x 2 matrices: 139 / 148 TOPS at chunk 256 (2026-12-04, before the epilogue rework). The scaling
# scratch in the staging buffers (cs_in_stage): 8 KB less workgroup memory, +0.6 % on the Llama-3-8B step (H100,
# 2026-12-06; bench --ab cs-own puts it back in its own array).
I8_TILE = I8Config(sg_m=4, sg_n=2, tm=4, tn=4, bk=64, fm=1, cs_in_stage=True)
I8_TILE_CHUNKED = I8Config(sg_m=4, sg_n=2, tm=4, tn=2, bk=64, fm=2)
# Narrow products (the k / v projections of the TinyLlama and SmolLM2 shapes, N 192 .. 576 at 4,096 rows) get a
# grid of fewer workgroups than the GPU has multiprocessors from the preset's 256 x 128 tiles (N 256: 32 of the
# H100's 132): where the preset's grid has fewer than NARROW_WORKGROUPS, the smaller NARROW_TILE fills more of them
# at fewer products per staged byte (one scale per row only; NARROW_WORKGROUPS 0: the preset everywhere). So does
# a grid whose last wave leaves much of the GPU idle: fewer workgroups than NARROW_FILL of the waves of WAVE (one
# preset workgroup a multiprocessor: an H100's or H200's 132) it takes (SmolLM2's 1,536-wide products: 192, 1.45
# waves). H100, 2026-12-06 (docs/benchmarks.md): SmolLM2 shape +8.1 % (100) and +4.6 % more (the fill), TinyLlama
# +0.85 %; the Llama-3-8B's k / v (128 workgroups, 0.97 of a wave) are 0.5 % slower on the narrow tile and keep
# the preset (bench --ab i8-narrow-off, i8-narrow-fill-off).
NARROW_TILE = I8Config(sg_m=4, sg_n=2, tm=2, tn=2, bk=64, fm=1, cs_in_stage=True)
# Plain products ("nt", one chunk, nothing in the epilogue: the teacher's projections, the KD head's logits) on 2 x 4
# subgroups, a 128 x 256 tile: H100, 2026-12-07, 463.8 / 471.5 / 530.5 TOPS at 4096 x 4096 x 4096 / 4096 x 14336 x
# 4096 / 4096 x 4096 x 14336 against the preset's 455.1 / 451.0 / 521.2; beside the LoRA epilogue's operands it
# loses (the whole 8B step 0.9 % slower with it everywhere), so those keep the preset (None: the preset everywhere).
PLAIN_TILE: I8Config | None = replace(I8_TILE, sg_m=2, sg_n=4)
NARROW_WORKGROUPS = 100
WAVE, NARROW_FILL = 132, 0.8
# Lavapipe-sized tile for the emulated kernel.
EMU_TILE = I8Config(sg_m=2, sg_n=1, tm=1, tn=2, bk=32, fm=1)


@dataclass(frozen=True)
class LoraTerm:
    """A LoRA's contribution to an "nt" GEMM's output, t . L, added in the integer GEMM's epilogue (each result
    matrix's block of it multiplied on the f16 tensor cores beside the integer block, added as C is written): t16
    [rows, lr] f16 (the LoRA scale folded in) and l16, L [lr, cols] in f16 stored as L^T [cols, lr] (layout "rows":
    the forward's B) or as L itself ("cols": the input gradient's A), lr the rank rounded up to 16 (zero padded).
    gpu/ops/lora.py lora_term packs them."""

    t16: Any
    l16: Any
    lr: int
    layout: str = "rows"


@dataclass(frozen=True)
class Int8Matrix:
    """An int8 operand on the GPU: codes [rows, k] packed four per u32 word, f32 scales [rows, k / chunk]."""

    codes: Any
    scales: Any
    rows: int
    k: int
    chunk: int
    name: str = ""

    @property
    def chunks(self) -> int:
        return self.k // self.chunk


def upload_i8(dev: Device, x: np.ndarray, chunk: int, name: str = "") -> Int8Matrix:
    """Quantize float32 x [rows, k] on the host (model/int8.py) and upload codes and scales (the weights)."""
    codes, scales = quantize_i8(x, chunk)
    return Int8Matrix(dev.upload(pack_i8(codes)), dev.upload(scales), x.shape[0], x.shape[1], chunk, name)


def i8_buffers(dev: Device, rows: int, k: int, chunk: int, name: str = "") -> Int8Matrix:
    """Uninitialised codes and scales for rows x k activations (gpu/ops/quantize_i8.py fills them)."""
    chunks = check_chunk(k, chunk, what=f"{name or 'int8 operand'} rows")
    codes = dev.buffer(rows * k, label=f"{name} int8 codes")
    return Int8Matrix(codes, dev.buffer(4 * rows * chunks, label=f"{name} int8 scales"), rows, k, chunk, name)


I8_MATRIX = ("i8", "i32", 16, 16, MMA_K)  # the config gemm_i8 is generated for
_problems: weakref.WeakKeyDictionary[Device, str | None] = weakref.WeakKeyDictionary()
_emulated: weakref.WeakSet[Device] = weakref.WeakSet()


@contextmanager
def int8_emulation(dev: Device) -> Iterator[None]:
    """Within the block, every integer GEMM on dev runs with the matrix builtins emulated in plain WGSL
    (matmul_i8_emulation.wgsl) and precision int8 is accepted, its other GEMMs on the f32 path: the int8 path's
    logic (quantizers, weight decoding, scale folding) on any adapter, slowly; for tests on machines without
    integer subgroup matrices."""
    _emulated.add(dev)
    try:
        yield
    finally:
        _emulated.discard(dev)


def int8_emulated(dev: Device) -> bool:
    return dev in _emulated


def int8_problem(dev: Device) -> str | None:
    """Why the integer GEMM cannot run on dev's tensor cores (None when it can, or runs emulated); cached per
    device."""
    if dev in _emulated:
        return None
    if dev not in _problems:
        _problems[dev] = matrix_problem(dev, I8_MATRIX, "integer tensor cores")
    return _problems[dev]


def pick_i8_config(chunks: int, chunk: int, m: int = 0, p: int = 0, *, plain: bool = False) -> I8Config:
    """The tile preset for operands with `chunks` scales per row of `chunk` codes each, for an m x p product (0:
    any): BK 64, or 32 where the chunk is no multiple of 64 (4 x 2 of 4 x 4 with BK 32: 259 / 281 TOPS at the sizes
    above); PLAIN_TILE for a plain product (plain: "nt", nothing in the epilogue); NARROW_TILE where the preset's grid
    is narrow (_narrow)."""
    cfg = I8_TILE if chunks == 1 else I8_TILE_CHUNKED
    if plain and chunks == 1 and PLAIN_TILE is not None:
        cfg = PLAIN_TILE
    if chunks == 1 and m and p and _narrow(_workgroups(cfg, m, p)):
        cfg = NARROW_TILE
    return cfg if chunk % cfg.bk == 0 else _short_steps(cfg)


def _narrow(workgroups: int) -> bool:
    """Whether a preset grid of `workgroups` takes NARROW_TILE: fewer than NARROW_WORKGROUPS, or filling less than
    NARROW_FILL of its waves of WAVE (NARROW_WORKGROUPS 0: never)."""
    if NARROW_WORKGROUPS <= 0:
        return False
    waves = -(-workgroups // WAVE)
    return workgroups < NARROW_WORKGROUPS or workgroups < NARROW_FILL * waves * WAVE


def _short_steps(cfg: I8Config) -> I8Config:
    """cfg staging MMA_K codes a step, the scaling scratch in its own array where the staging buffers are then too
    small for it."""
    short = replace(cfg, bk=MMA_K)
    if short.cs_in_stage:
        try:
            short.cs_home()
        except ValueError:
            return replace(short, cs_in_stage=False)
    return short


def _workgroups(cfg: I8Config, m: int, p: int) -> int:
    return -(-m // cfg.bm) * -(-p // cfg.bn)


def all_i8_variants() -> list[I8Variant]:
    """Every variant gemm_i8 dispatches with its presets (the kernel registry compiles them)."""
    wide = _preset_variants()
    narrow_tiles = {t.bk: t for t in (NARROW_TILE, _short_steps(NARROW_TILE))}
    narrow = [replace(v, cfg=narrow_tiles[v.cfg.bk]) for v in wide if not v.chunked]
    plain = [
        I8Variant(pick_i8_config(1, chunk, plain=True), chunked=False) for chunk in (64, 32) if PLAIN_TILE is not None
    ]
    return wide + narrow + plain


def _preset_variants() -> list[I8Variant]:
    return [
        I8Variant(pick_i8_config(chunks, chunk), chunked=chunks > 1, accumulate=acc, orient=orient)
        for orient, all_chunks in (("nt", (1, 2)), ("nn", (1,)))
        for chunks in all_chunks
        for chunk in (64, 32)
        for acc in (False, True)
    ] + [
        I8Variant(pick_i8_config(1, chunk), chunked=False, accumulate=acc, orient="nt", lora=layout)
        for chunk in (64, 32)
        for acc in (False, True)
        for layout in ("rows", "cols")
    ]


def _check_lora(lora: LoraTerm, name: str, orient: str, chunks: int, m: int, p: int) -> None:
    """A LoRA term fits the GEMM: "nt", one chunk, whole 16 x 16 blocks of C, operands large enough."""
    if orient != "nt" or chunks != 1 or m % 16 or p % 16:
        raise DeviceError(
            f"gemm_i8 with {name!r}: a LoRA term needs 'nt', one chunk and C's rows and columns multiples of 16 "
            f"(got {orient!r}, {chunks} chunks, {m} x {p})"
        )
    if lora.layout not in ("rows", "cols"):
        raise DeviceError(f"gemm_i8 with {name!r}: LoRA layout {lora.layout!r}, expected 'rows' or 'cols'")
    if lora.lr <= 0 or lora.lr % 16:
        raise DeviceError(f"gemm_i8 with {name!r}: the LoRA term's row length {lora.lr} is not a multiple of 16")
    if nbytes(lora.t16) < 2 * m * lora.lr or nbytes(lora.l16) < 2 * p * lora.lr:
        raise DeviceError(f"gemm_i8 with {name!r}: the LoRA t16 or L16 hold fewer than {m} or {p} rows of {lora.lr}")


def gemm_i8(
    dev: Device,
    a: Int8Matrix,
    w: Int8Matrix,
    c: Any,
    *,
    orient: str = "nt",
    col_scales: Any = None,
    accumulate: bool = False,
    alpha: float = 1.0,
    ldc: int | None = None,
    c_offset: int = 0,
    cfg: I8Config | None = None,
    emulate: bool = False,
    lora: LoraTerm | None = None,
    residual: Any = None,
) -> None:
    """C[m, P] (+)= alpha * A . B over the int8 operands, m = a.rows: "nt" (the forward) B = W^T, P = w.rows, A
    and W with the same k and chunks; "nn" (the input gradient) B = W, P = w.k (a multiple of 16), A's k =
    w.rows, one chunk each, and col_scales (f32, P values) scale C's columns in place of W's row scales (which
    the caller folds into A). C is f32, row stride ldc (default P). emulate=True runs the same kernel with the
    matrix builtins emulated (slow; lavapipe). lora ("nt", one chunk, m and P multiples of 16): C also gets t . L
    (lora_term; its products on the f16 tensor cores), added as C is written (with accumulate: C + (alpha * A . B
    + t . L)). residual (f32, laid out as C; not with accumulate): C = residual + (...), the values C held unread."""
    name = w.name or "int8 weight"
    emulate = emulate or dev in _emulated
    if not emulate and (problem := int8_problem(dev)) is not None:
        raise DeviceError(f"gemm_i8 with {name!r}: {problem}")
    if orient == "nt" and (a.k, a.chunk) != (w.k, w.chunk):
        raise DeviceError(f"gemm_i8 with {name!r}: A has k={a.k} chunk={a.chunk}, W k={w.k} chunk={w.chunk}")
    if orient == "nn" and (a.k != w.rows or a.chunks != 1 or w.k % 16 or col_scales is None):
        raise DeviceError(
            f"gemm_i8 'nn' with {name!r}: needs A's k ({a.k}) = W's rows ({w.rows}), one chunk, W's row length "
            f"({w.k}) a multiple of 16 and col_scales"
        )
    if orient not in ("nt", "nn"):
        raise DeviceError(f"gemm_i8 with {name!r}: orient={orient!r}, expected 'nt' or 'nn'")
    m, r = a.rows, a.k
    p = w.rows if orient == "nt" else w.k
    ldc = p if ldc is None else ldc
    if m > 0 and nbytes(c) < 4 * (c_offset + (m - 1) * ldc + p):
        raise DeviceError(f"gemm_i8 with {name!r}: output C has {nbytes(c)} bytes for {m} x {p} (ldc {ldc})")
    if m > 0 and (nbytes(a.codes) < m * r or nbytes(a.scales) < 4 * m * a.chunks):
        raise DeviceError(f"gemm_i8 with {name!r}: A's codes or scales hold fewer than {m} rows of {r}")
    if orient == "nn" and nbytes(col_scales) < 4 * p:
        raise DeviceError(f"gemm_i8 with {name!r}: col_scales hold fewer than {p} values")
    if lora is not None:
        _check_lora(lora, name, orient, a.chunks, m, p)
    if residual is not None and (accumulate or (m > 0 and nbytes(residual) < 4 * (c_offset + (m - 1) * ldc + p))):
        raise DeviceError(
            f"gemm_i8 with {name!r}: a residual is read like C ({m} x {p}, ldc {ldc}) and excludes accumulate"
        )
    if m <= 0 or p <= 0:
        return
    plain = orient == "nt" and lora is None and residual is None and not accumulate
    cfg = cfg or (EMU_TILE if emulate else pick_i8_config(a.chunks, a.chunk, m, p, plain=plain))
    if a.chunk % cfg.bk or r % cfg.bk:
        raise DeviceError(f"gemm_i8 with {name!r}: chunk {a.chunk} and k {r} must be multiples of bk={cfg.bk}")
    cfg.validate(
        max_threads=int(dev.limits["max-compute-invocations-per-workgroup"]),
        max_workgroup_bytes=int(dev.limits["max-compute-workgroup-storage-size"]),
        lora=lora is not None,
    )
    variant = I8Variant(
        cfg,
        chunked=a.chunks > 1,
        accumulate=accumulate,
        orient=orient,
        lora=lora.layout if lora is not None else "",
        residual=residual is not None,
    )
    pipe = dev.pipeline((*variant.key, emulate), lambda: matmul_i8_source(variant, emulate=emulate))
    grid = (-(-p // cfg.bn), -(-m // cfg.bm))
    alpha_bits = int(np.float32(alpha).view(np.uint32))
    ldw = r // 16 if orient == "nt" else p // 16
    lr = lora.lr if lora is not None else 0
    head = [m, p, r, r // 16, ldw, 0, ldc, c_offset, alpha_bits, a.chunks, a.chunk // cfg.bk, lr]
    prm = np.array([*head, 0, 0, 0, 0], np.uint32)
    sw = w.scales if orient == "nt" else col_scales
    extra = ([lora.t16, lora.l16] if lora is not None else []) + ([residual] if residual is not None else [])
    dev.dispatch(pipe, [prm, a.codes, w.codes, a.scales, sw, c, *extra], grid)
