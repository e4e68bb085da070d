"""Integer tensor-core GEMM (int8 codes, per-(row, chunk) f32 scales, i32 accumulation) and its activation quantizer.

Layers as in test_gpu_tensorcore.py: the numpy twin (model/int8.py) on its own; the quantizer kernel and the
generated GEMM with the subgroup-matrix builtins emulated (marker gpu, lavapipe in CI); every preset through
Tint on Dawn's Null backend (test_kernel_registry.py); the real kernels on the H200 (marker tensorcore:
`source .gl/enter.sh; python3 -m pytest -q -m tensorcore tests/test_gpu_int8.py`).
Tolerance: the integer products are exact, so the kernel's error vs float64 on the same codes is the f32
scaling and summing of the chunk partials: ~1e-7 of the largest output here; 1e-6 holds it (an indexing or
scale error is O(1)).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import gpu.ops.quantize_i8 as quantize_ops
from gpu.codegen_i8 import I8Config
from gpu.device import Device, DeviceError
from gpu.ops.lora import lora_rank16, lora_term
from gpu.ops.matmul_i8 import (
    I8_TILE,
    I8_TILE_CHUNKED,
    NARROW_TILE,
    Int8Matrix,
    LoraTerm,
    all_i8_variants,
    gemm_i8,
    i8_buffers,
    pick_i8_config,
    upload_i8,
)
from gpu.ops.quantize_i8 import (
    glu_i8,
    quantize_i8_gpu,
    rmsnorm_backward_i8,
    rmsnorm_i8,
    rotate_rows,
    tint,
    transpose_i8,
    weight_to_i8,
)
from gpu.weights import random_blocks, upload_quant
from model.int8 import (
    QMAX,
    ROTATED_MAX,
    ROTATIONS,
    check_chunk,
    dequantize_i8,
    gemm_i8_reference,
    pack_i8,
    quantize_i8,
)
from tests.gpu_fixtures import device_or_skip, tensor_core_device_or_skip

TOL = 1e-6


def test_quantize_i8_bounds_and_zero_chunks() -> None:
    """Each value is within half a step of its chunk's scale; the chunk max maps to +-127; zero chunks stay 0."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[2, 64:128] = 0.0
    codes, scales = quantize_i8(x, 64)
    assert codes.dtype == np.int8 and scales.shape == (5, 4)
    assert np.abs(codes).max() <= QMAX and scales[2, 1] == 0 and not codes[2, 64:128].any()
    step = np.repeat(scales, 64, axis=1)
    assert np.all(np.abs(dequantize_i8(codes, scales) - x) <= step / 2 * (1 + 1e-6))
    assert np.all(np.abs(codes.reshape(5, 4, 64)).max(axis=2)[scales > 0] == QMAX)


def test_chunk_must_divide_rows_in_mma_steps() -> None:
    assert check_chunk(576, 192) == 3
    for chunk in (100, 48, 0):
        with pytest.raises(ValueError, match="multiple of 32"):
            check_chunk(576, chunk)


def test_reference_is_the_product_of_the_dequantized_operands() -> None:
    """The float64 definition of the GEMM equals (dequantized A) . (dequantized W)^T."""
    rng = np.random.default_rng(1)
    ac, asc = quantize_i8(rng.standard_normal((6, 128)).astype(np.float32), 32)
    wc, wsc = quantize_i8(rng.standard_normal((9, 128)).astype(np.float32), 32)
    deq = [
        c.reshape(c.shape[0], 4, 32).astype(np.float64) * s[:, :, None].astype(np.float64)
        for c, s in ((ac, asc), (wc, wsc))
    ]
    want = deq[0].reshape(6, 128) @ deq[1].reshape(9, 128).T
    np.testing.assert_allclose(gemm_i8_reference(ac, asc, wc, wsc), want, rtol=1e-12, atol=1e-12)


def test_pack_is_little_endian_bytes() -> None:
    codes = np.array([[1, -1, 2, -128, 0, 0, 0, 127]], np.int8)
    assert pack_i8(codes).tolist() == [[0x80_02_FF_01, 0x7F_00_00_00]]


@pytest.fixture
def dev() -> Device:
    return device_or_skip()


@pytest.mark.gpu
@pytest.mark.parametrize("row_wg", [256, 64])
@pytest.mark.parametrize("off,scaled", [(3, False), (4, False), (3, True), (4, True)])
def test_quantize_kernel_matches_the_twin(
    dev: Device, off: int, scaled: bool, row_wg: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codes of the kernel equal the twin's (a value at a rounding tie may land one code off: the GPU's f32
    division is not correctly rounded); scales equal; rows read with a stride and an offset (4: the vec4 loads),
    optionally times per-column scales; on 256 or 64 invocations a row (quantize_i8.SHORT_ROW_WORKGROUP)."""
    monkeypatch.setattr(quantize_ops, "SHORT_ROW_WORKGROUP", row_wg)
    rng = np.random.default_rng(2)
    rows, k, ldx = 9, 192, 200
    full = (rng.standard_normal((rows, ldx)) * 3).astype(np.float32)
    full[4, off : off + 64] = 0.0
    cs = rng.uniform(0.5, 2.0, k).astype(np.float32) if scaled else None
    x = full[:, off : off + k] * (cs if scaled else 1.0)
    out = i8_buffers(dev, rows, k, 64, "x")
    col_scales = dev.upload(cs) if scaled else None
    quantize_i8_gpu(dev, dev.upload(full.ravel()), out, ldx=ldx, x_offset=off, col_scales=col_scales)
    codes_np, scales_np = quantize_i8(x, 64)
    codes = dev.read(out.codes, np.int8, (rows, k))
    scales = dev.read(out.scales, np.float32, (rows, 3))
    np.testing.assert_allclose(scales, scales_np, rtol=1e-6)
    diff = np.abs(codes.astype(int) - codes_np)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2
    assert not codes[4, :64].any() and scales[4, 0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("off,rot", [(3, 0), (4, 0), (0, 64)])
def test_quantize_rows_per_workgroup_give_the_same_bits(
    dev: Device, off: int, rot: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows times column scales quantized 4 to a workgroup, one after the other (SCALED_ROWS_PER_WORKGROUP; 9 rows:
    the last workgroup has one), give the codes and scales of one row a workgroup, bit for bit: f32 and vec4 reads,
    rotated units."""
    rng = np.random.default_rng(off + rot)
    rows, k, ldx = 9, 256, 264
    full = dev.upload((rng.standard_normal((rows, ldx)) * 3).astype(np.float32).ravel())
    cs = dev.upload(rng.uniform(0.5, 2.0, k).astype(np.float32))
    got = []
    for per_wg in (1, 4):
        monkeypatch.setattr(quantize_ops, "SCALED_ROWS_PER_WORKGROUP", per_wg)
        out = i8_buffers(dev, rows, k, 128, f"rows {per_wg}")
        quantize_i8_gpu(dev, full, out, ldx=ldx, x_offset=off, col_scales=cs, rot=rot)
        got.append((dev.read(out.codes, np.int8, (rows, k)), dev.read(out.scales, np.float32, (rows, 2))))
    assert np.any(got[0][0]) and np.all(got[0][1] > 0)
    np.testing.assert_array_equal(got[1][0], got[0][0])
    np.testing.assert_array_equal(got[1][1], got[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("rot", [32, 64, 128])
@pytest.mark.parametrize(
    "k,chunk,scaled,row_wg", [(4096, 4096, False, 64), (1024, 256, True, 64), (640, 640, False, 256)]
)
def test_quantize_units_are_the_vec4_quantizer(
    dev: Device, monkeypatch: pytest.MonkeyPatch, rot: int, k: int, chunk: int, scaled: bool, row_wg: int
) -> None:
    """quantize_i8_gpu of rotated rows on quantize_i8_units (units of 16: UNIT_ROWS) gives the codes and scales of
    the kernel that reads and rotates vec4s, bit for bit: one chunk or several (the rotation's signs from each
    chunk's first column), times column scales or not, rows on 64 or 256 invocations, rows shorter than the
    workgroup's units (640 on 256)."""
    monkeypatch.setattr(quantize_ops, "SHORT_ROW_WORKGROUP", row_wg)
    rng = np.random.default_rng(k + rot)
    rows = 3
    x = (rng.standard_normal((rows, k)) * 2).astype(np.float32)
    x[:, 5] *= 30.0
    xb = dev.upload(x)
    cs = dev.upload(rng.uniform(0.5, 2.0, k).astype(np.float32)) if scaled else None
    got = []
    for units in (False, True):
        monkeypatch.setattr(quantize_ops, "UNIT_ROWS", units)
        out = i8_buffers(dev, rows, k, chunk, f"units {units}")
        quantize_i8_gpu(dev, xb, out, col_scales=cs, rot=rot)
        got.append((dev.read(out.codes, np.uint8, (rows * k,)), dev.read(out.scales, np.float32, (rows * k // chunk,))))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])
    assert got[1][1].min() > 0 and (got[1][0] != 0).mean() > 0.5


def _check_gemm_lora(
    dev: Device, m: int, n: int, k: int, r: int, cfg: I8Config | None, layout: str = "rows", **kw
) -> float:
    """C (+)= alpha A . W^T + s t . L in one GEMM (the LoRA term packed to f16 by lora_term, written on the f16
    tensor cores in the epilogue; L given as L^T [n, r] or L [r, n] by layout) against float64 on the same codes
    and the same f16 roundings; C's other columns and elements before c_offset untouched."""
    rng = np.random.default_rng(m + n + k + r)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    t, lo = rng.standard_normal((m, r)).astype(np.float32), rng.standard_normal((r, n)).astype(np.float32)
    alpha, scale = kw.get("alpha", 1.0), 0.75
    wq, a = upload_i8(dev, w, k, "w"), i8_buffers(dev, m, k, k, "x")
    quantize_i8_gpu(dev, dev.upload(x), a)
    ac, asc = dev.read(a.codes, np.int8, (m, k)), dev.read(a.scales, np.float32, (m, 1))
    t16, lo16 = (scale * t).astype(np.float16), lo.astype(np.float16)
    lora_ref = t16.astype(np.float64) @ lo16.astype(np.float64)
    ref = gemm_i8_reference(ac, asc, *quantize_i8(w, k)) + lora_ref / alpha
    stored = np.ascontiguousarray(lo.T if layout == "rows" else lo)
    lr = lora_rank16(r)
    bufs = dev.buffer(2 * m * lr), dev.buffer(2 * n * lr)
    term = lora_term(dev, dev.upload(t), dev.upload(stored), m, n, r, scale, layout, *bufs)
    packed = dev.read(term.t16, np.float16, (m, lr))
    assert np.array_equal(packed[:, :r], t16) and not packed[:, r:].any(), "t16: f16(s t), zero padded"
    return _run_into_c(dev, rng, ref, lambda c: gemm_i8(dev, a, wq, c, cfg=cfg, lora=term, **kw), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("m,n,k,r", [(80, 48, 128, 16), (32, 48, 64, 4), (16, 16, 64, 40)])
def test_gemm_lora_epilogue_emulated(dev: Device, m: int, n: int, k: int, r: int, layout: str) -> None:
    """The LoRA variants (L stored transposed or not; tiles past M and N, ranks 4 / 16 / 40 padded to 16 / 16 / 48,
    alpha != 1, C with a stride and an offset, accumulating or not) within TOL of float64; a LoRA term with several
    chunks, "nn", rows or columns of C not multiples of 16, another layout or short operands is refused."""
    cfg = I8Config(2, 1, 1, 2, 32, 1)
    for acc in (False, True):
        kw = {"alpha": 0.5, "ldc": n + 6, "c_offset": 3, "accumulate": acc}
        assert _check_gemm_lora(dev, m, n, k, r, cfg, layout, emulate=True, **kw) < TOL
    if k % 64 == 0:  # the scaling scratch in the staging buffers, beside the LoRA blocks' own
        kw = {"alpha": 0.5, "ldc": n + 6, "c_offset": 3, "accumulate": True}
        cs_cfg = I8Config(2, 1, 2, 2, 64, 1, cs_in_stage=True)
        assert _check_gemm_lora(dev, m, n, k, r, cs_cfg, layout, emulate=True, **kw) < TOL
    a, w = i8_buffers(dev, 16, 64, 64, "x"), upload_i8(dev, np.ones((16, 64), np.float32), 64, "w")
    term = LoraTerm(dev.buffer(2 * 16 * 16), dev.buffer(2 * 16 * 16), 16, layout)
    c = dev.buffer(4 * 256)
    with pytest.raises(DeviceError, match="multiples of 16"):
        gemm_i8(dev, i8_buffers(dev, 8, 64, 64, "x"), w, c, emulate=True, lora=term)
    with pytest.raises(DeviceError, match="LoRA layout 'diag'"):
        gemm_i8(dev, a, w, c, emulate=True, lora=LoraTerm(term.t16, term.l16, 16, "diag"))
    with pytest.raises(DeviceError, match="row length 8 is not a multiple of 16"):
        gemm_i8(dev, a, w, c, emulate=True, lora=LoraTerm(term.t16, term.l16, 8, layout))
    with pytest.raises(DeviceError, match="fewer than 16 or 16 rows of 32"):
        gemm_i8(dev, a, w, c, emulate=True, lora=LoraTerm(term.t16, term.l16, 32, layout))
    with pytest.raises(DeviceError, match="lora_term: layout 'diag'"):
        lora_term(dev, c, c, 16, 16, 4, 1.0, "diag", term.t16, term.l16)


@pytest.mark.tensorcore
@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("acc,r", [(False, 16), (True, 16), (False, 40)])
def test_gemm_lora_epilogue_on_tensor_cores(layout: str, acc: bool, r: int) -> None:
    """The LoRA variants with the preset tile and the narrow one on the integer tensor cores, the term on the f16
    ones (tiles past M and N, ranks past the first 16; Dawn only); and with 16 subgroups, the scaling scratch in the
    staging buffers."""
    kw = {"accumulate": acc, "ldc": 280, "c_offset": 5}
    dev = tensor_core_device_or_skip()
    assert _check_gemm_lora(dev, 304, 272, 256, r, I8_TILE, layout, **kw) < TOL
    assert _check_gemm_lora(dev, 304, 272, 256, r, NARROW_TILE, layout, **kw) < TOL
    assert _check_gemm_lora(dev, 304, 272, 256, r, I8Config(4, 4, 4, 2, 64, 1, cs_in_stage=True), layout, **kw) < TOL


def test_scratch_in_the_staging_buffers_is_checked() -> None:
    """cs_in_stage frees the scratch's workgroup memory (a 16-subgroup tile with a LoRA term fits 48 KiB only so);
    it is refused with two buffers (never free) and where neither staging buffer's blocks hold every subgroup's."""
    tile = I8Config(4, 4, 4, 2, 64, 1)
    with pytest.raises(ValueError, match="needs 6.* B of workgroup memory"):
        tile.validate(lora=True)
    fitted = I8Config(4, 4, 4, 2, 64, 1, cs_in_stage=True)
    fitted.validate(lora=True)
    assert tile.workgroup_bytes(lora=True) - fitted.workgroup_bytes(lora=True) == 16 * 256 * 4
    assert fitted.cs_home() == ("As", 64 * 20 // 256) and fitted.label.endswith("_cs")
    with pytest.raises(ValueError, match="cs_in_stage needs stages=1"):
        I8Config(4, 2, 4, 4, 32, 1, stages=2, cs_in_stage=True).validate()
    with pytest.raises(ValueError, match="neither staging buffer holds 2 x 256 words"):
        I8Config(2, 1, 1, 2, 32, 1, cs_in_stage=True).validate()


@pytest.mark.gpu
def test_rows_longer_than_the_registers_hold(dev: Device) -> None:
    """Rows past the 16,384 values an invocation group holds in registers (int8_codes.wgsl PER) read their rest
    twice: activation and weight codes still equal the twin's, the row's max found in the rest."""
    rng = np.random.default_rng(3)
    k = 16384 + 128
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[1, -5] = 40.0  # the max of row 1 in the part read twice
    out = i8_buffers(dev, 2, k, k, "long")
    quantize_i8_gpu(dev, dev.upload(x), out)
    codes_np, scales_np = quantize_i8(x, k)
    np.testing.assert_allclose(dev.read(out.scales, np.float32, (2, 1)), scales_np, rtol=1e-6)
    assert np.abs(dev.read(out.codes, np.int8, (2, k)).astype(int) - codes_np).max() <= 1
    kw = 16384 + 32
    raw = random_blocks(T.Q4_0, (2, kw), rng)
    w8 = weight_to_i8(dev, upload_quant(dev, raw, T.Q4_0, (2, kw), name="long w"))
    wc, ws = quantize_i8(dequantize(raw, T.Q4_0).reshape(2, kw).astype(np.float32), kw)
    np.testing.assert_allclose(dev.read(w8.scales, np.float32, (2, 1)), ws, rtol=1e-6)
    assert np.abs(dev.read(w8.codes, np.int8, (2, kw)).astype(int) - wc).max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    "qtype", [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name
)
def test_weight_codes_match_the_twin(dev: Device, qtype: T) -> None:
    """A frozen weight decoded from its GGML type on the GPU to per-row int8 codes: the twin's codes (a tie may
    land one code off) and scales, on the dequantized weight; decoded again with those scales given (fixed_scales:
    no absmax), bitwise the same codes, plain and rotated."""
    rng = np.random.default_rng(int(qtype))
    n, k = 5, 256
    raw = random_blocks(qtype, (n, k), rng)
    w = upload_quant(dev, raw, qtype, (n, k), name="w")
    out = weight_to_i8(dev, w)
    codes_np, scales_np = quantize_i8(dequantize(raw, qtype).reshape(n, k).astype(np.float32), k)
    np.testing.assert_allclose(dev.read(out.scales, np.float32, (n, 1)), scales_np, rtol=1e-6)
    diff = np.abs(dev.read(out.codes, np.int8, (n, k)).astype(int) - codes_np)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-2
    assert out.chunks == 1
    for rot in (0, 128):
        want = weight_to_i8(dev, w, rot=rot)
        again = Int8Matrix(dev.buffer(n * k), want.scales, n, k, k)
        weight_to_i8(dev, w, again, rot=rot, fixed_scales=True)
        np.testing.assert_array_equal(
            dev.read(again.codes, np.uint8, (n * k,)), dev.read(want.codes, np.uint8, (n * k,))
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "k,rot,n,row_wg",
    [(256, 0, 3, 256), (4352, 0, 11, 256), (16640, 0, 3, 256), (256, 128, 11, 256), (4352, 128, 3, 256),
     (14336, 128, 17, 256), (2048, 0, 5, 64), (4096, 128, 5, 64)],
)  # fmt: skip
def test_q4_k_codes_equal_the_generic_decode(
    dev: Device, k: int, rot: int, n: int, row_wg: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """weight_i8_q4_k (whole 16-byte pieces of the blocks) gives the generic weight_i8 decode's codes and scales,
    bit for bit, on rows whose units fill one slot, two, and more than the registers hold; rotated too (the same
    butterflies in the same order, in units of 16 instead of groups of 4); rows of at most 4096 on 64 invocations
    too (quantize_i8.SHORT_ROW_WORKGROUP: 2 and 4 units each), rows whose last slot is partly empty (their loads
    clamped inside the row); each with the row scales given (fixed) too."""
    monkeypatch.setattr(quantize_ops, "SHORT_ROW_WORKGROUP", row_wg)
    from gpu.ops.common import grid, pack
    from gpu.registry import pipeline

    rng = np.random.default_rng(k)
    w = upload_quant(dev, random_blocks(T.Q4_K, (n, k), rng), T.Q4_K, (n, k), name="w")
    fast = weight_to_i8(dev, w, rot=rot)
    generic = i8_buffers(dev, n, k, k, "generic")
    bindings = [pack(n, k, 0, 0), w.binding, generic.codes, generic.scales]
    dev.dispatch(pipeline(dev, "weight_i8", wtype="Q4_K", rot=rot, tint=tint(dev), fixed=False), bindings, grid(n, 1))
    for a, b, dtype in ((fast.codes, generic.codes, np.uint8), (fast.scales, generic.scales, np.uint32)):
        np.testing.assert_array_equal(dev.read(a, dtype), dev.read(b, dtype))
    fixed = weight_to_i8(dev, w, Int8Matrix(dev.buffer(n * k), fast.scales, n, k, k), rot=rot, fixed_scales=True)
    np.testing.assert_array_equal(dev.read(fixed.codes, np.uint8), dev.read(fast.codes, np.uint8))


def _bitwise_fused(dev: Device, separate: tuple[Any, Int8Matrix], fused: tuple[Any, Int8Matrix]) -> None:
    """A fused kernel's f32 output and int8 operand are bitwise the separate kernel's and quantizer's; the codes reach
    127 (the scale is each row's absmax)."""
    (y_sep, sep), (y_fused, q) = separate, fused
    for a, b, n in (
        (y_sep, y_fused, 4 * q.rows * q.k),
        (sep.codes, q.codes, q.rows * q.k),
        (sep.scales, q.scales, 4 * q.rows),
    ):
        np.testing.assert_array_equal(dev.read(a, np.uint8, (n,)), dev.read(b, np.uint8, (n,)))
    assert np.abs(dev.read(q.codes, np.int8, (q.rows, q.k))).max() == 127


@pytest.mark.gpu
@pytest.mark.parametrize(
    "h,rot,rows", [(256, 0, 3), (256, 128, 5), (4096, 128, 3), (4352, 0, 2), (2048, 32, 4), (576, 64, 3)]
)
@pytest.mark.parametrize("units", [True, False])
def test_rmsnorm_i8_is_the_norm_then_the_quantizer(
    dev: Device, monkeypatch: pytest.MonkeyPatch, h: int, rot: int, rows: int, units: bool
) -> None:
    """rmsnorm_i8 (the norm and its output's codes in one pass): bitwise rmsnorm_forward's output and
    quantize_i8_gpu's codes and scales of it, plain and rotated (rotated rows on either kernel: UNIT_ROWS, units of
    16 a block of 64 or 128 values, rows shorter than the workgroup's units), on rows with an outlier column, within
    the registers and longer (re-read); a rotated row past FUSED_NORM_ROTATED_WIDTH refused. store_y=False: the same
    codes and scales, y left as it was on the rotated units' kernel (its caller needs the codes alone)."""
    from gpu.ops import quantize_i8 as ops
    from gpu.ops.rmsnorm import rmsnorm_forward

    rng = np.random.default_rng(h + rot)
    x = rng.standard_normal((rows, h)).astype(np.float32)
    x[:, 7] *= 40.0
    w = rng.uniform(0.5, 1.5, h).astype(np.float32)
    xb, wb = dev.upload(x), dev.upload(w)
    y_sep, y_fused = dev.buffer(x.nbytes), dev.buffer(x.nbytes)
    sep, fused = i8_buffers(dev, rows, h, h, "separate"), i8_buffers(dev, rows, h, h, "fused")
    rmsnorm_forward(dev, xb, wb, y_sep, rows, h, 1e-5)
    monkeypatch.setattr(ops, "UNIT_ROWS", False)  # the reference: the quantizer reading and rotating vec4s
    quantize_i8_gpu(dev, y_sep, sep, rot=rot)
    monkeypatch.setattr(ops, "UNIT_ROWS", units)
    rmsnorm_i8(dev, xb, wb, y_fused, fused, 1e-5, rot)
    _bitwise_fused(dev, (y_sep, sep), (y_fused, fused))
    _codes_alone(dev, lambda y, out: rmsnorm_i8(dev, xb, wb, y, out, 1e-5, rot, store_y=False), fused, rot and units)
    if rot:
        wide = i8_buffers(dev, 1, 8192, 8192, "wide")
        with pytest.raises(DeviceError, match="rmsnorm_i8"):
            rmsnorm_i8(dev, dev.buffer(4 * 8192), dev.buffer(4 * 8192), dev.buffer(4 * 8192), wide, 1e-5, rot)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "h,rows,residual,dy_rot",
    [(256, 3, True, 0), (4096, 2, True, 0), (4352, 2, False, 0), (64, 5, False, 0), (256, 3, True, 128),
     (4096, 2, True, 128), (96, 3, False, 32)],
)  # fmt: skip
def test_rmsnorm_backward_i8_is_the_norm_backward_then_the_quantizer(
    dev: Device, h: int, rows: int, residual: bool, dy_rot: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rmsnorm_backward_i8 (the norm's input gradient, plus a residual, and its codes times column scales in one pass):
    bitwise rmsnorm_backward's gradient (dx holding the residual, accumulate) and quantize_i8_gpu's codes and scales
    of it with col_scales, within the registers and longer (re-read); the residual as dx refused. dy_rot: dy given
    rotated (dY R), turned back in the kernel: bitwise rotate_rows then the same, dy itself untouched; rows longer
    than NORM_TURNED_MAX refused. (Its sums run in the scalar rmsnorm_backward's order, not rmsnorm_backward4's.)"""
    from gpu.ops import rmsnorm
    from gpu.ops.rmsnorm import rmsnorm_backward
    from model.int8 import NORM_TURNED_MAX, hadamard_rows

    monkeypatch.setattr(rmsnorm, "VEC4_BACKWARD", False)

    rng = np.random.default_rng(h + rows + dy_rot)
    x, dy, r = (rng.standard_normal((rows, h)).astype(np.float32) for _ in range(3))
    dy[:, 5] *= 30.0
    w = rng.uniform(0.5, 1.5, h).astype(np.float32)
    cs = rng.uniform(0.001, 0.02, h).astype(np.float32)
    given = hadamard_rows(dy, dy_rot).astype(np.float32) if dy_rot else dy  # what the summed GEMMs leave: dY R
    xb, dyb, wb, csb, givenb = dev.upload(x), dev.upload(given), dev.upload(w), dev.upload(cs), dev.upload(given)
    if dy_rot:
        rotate_rows(dev, dyb, rows, h, dy_rot)  # the separate pass the fused kernel replaces
    rb = dev.upload(r) if residual else None
    dx_sep, dx_fused = dev.upload(r if residual else np.zeros_like(r)), dev.buffer(x.nbytes)
    sep, fused = i8_buffers(dev, rows, h, h, "separate"), i8_buffers(dev, rows, h, h, "fused")
    rmsnorm_backward(dev, dyb, xb, wb, dx_sep, rows, h, 1e-5, accumulate=residual)
    quantize_i8_gpu(dev, dx_sep, sep, col_scales=csb)
    rmsnorm_backward_i8(dev, givenb, xb, wb, dx_fused, fused, csb, 1e-5, residual=rb, dy_rot=dy_rot)
    _bitwise_fused(dev, (dx_sep, sep), (dx_fused, fused))
    np.testing.assert_array_equal(dev.read(givenb, np.float32, (rows, h)), given)
    if dy_rot:
        wide = i8_buffers(dev, 1, 2 * NORM_TURNED_MAX, 2 * NORM_TURNED_MAX, "wide")
        big = dev.buffer(8 * NORM_TURNED_MAX)
        with pytest.raises(DeviceError, match="rotated dy"):
            rmsnorm_backward_i8(dev, big, big, big, dev.buffer(8 * NORM_TURNED_MAX), wide, big, 1e-5, dy_rot=dy_rot)
    # the gradient itself against float64 (the kernel's formula, not only its twin's)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64) * w
    rstd = 1.0 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5)
    want = rstd * dy64 - x64 * rstd**3 * (dy64 * x64).mean(1, keepdims=True) + (r if residual else 0.0)
    np.testing.assert_allclose(dev.read(dx_fused, np.float32, (rows, h)), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(DeviceError, match="residual"):
        rmsnorm_backward_i8(dev, dyb, xb, wb, dx_fused, fused, csb, 1e-5, residual=dx_fused)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize(
    "f,rot,rows", [(256, 0, 3), (512, 128, 2), (14336, 128, 2), (17408, 0, 2), (1536, 64, 3), (8192, 32, 2)]
)
@pytest.mark.parametrize("units", [True, False])
def test_glu_i8_is_the_gated_unit_then_the_quantizer(
    dev: Device, monkeypatch: pytest.MonkeyPatch, act: str, f: int, rot: int, rows: int, units: bool
) -> None:
    """glu_i8 (a gated unit's forward and its output's codes in one pass): bitwise swiglu_forward's / geglu_forward's
    output and quantize_i8_gpu's codes and scales of it, plain and rotated (rotated rows on either kernel: UNIT_ROWS,
    64 or 256 invocations a row, rows shorter than the workgroup's units), a row within the registers and longer;
    store_y=False: the same codes and scales, y left as it was on the rotated units' kernel."""
    from gpu.ops import quantize_i8 as ops
    from gpu.ops.gated import geglu_forward, swiglu_forward

    rng = np.random.default_rng(f + rot)
    g, u = (rng.standard_normal((rows, f)).astype(np.float32) * 3 for _ in range(2))
    gb, ub = dev.upload(g), dev.upload(u)
    y_sep, y_fused = dev.buffer(g.nbytes), dev.buffer(g.nbytes)
    sep, fused = i8_buffers(dev, rows, f, f, "separate"), i8_buffers(dev, rows, f, f, "fused")
    (swiglu_forward if act == "swiglu" else geglu_forward)(dev, gb, ub, y_sep, rows * f)
    monkeypatch.setattr(ops, "UNIT_ROWS", False)  # the reference: the quantizer reading and rotating vec4s
    quantize_i8_gpu(dev, y_sep, sep, rot=rot)
    monkeypatch.setattr(ops, "UNIT_ROWS", units)
    glu_i8(dev, act, gb, ub, y_fused, fused, rot)
    for a, b, n in ((y_sep, y_fused, 4 * rows * f), (sep.codes, fused.codes, rows * f)):
        np.testing.assert_array_equal(dev.read(a, np.uint8, (n,)), dev.read(b, np.uint8, (n,)))
    np.testing.assert_array_equal(
        dev.read(sep.scales, np.float32, (rows,)), dev.read(fused.scales, np.float32, (rows,))
    )
    _codes_alone(dev, lambda y, out: glu_i8(dev, act, gb, ub, y, out, rot, store_y=False), fused, rot and units)


def _codes_alone(dev: Device, run, want: Int8Matrix, skips: bool) -> None:
    """run(y, out) with store_y=False: out's codes and scales bitwise want's; y (filled with a pattern first) left
    as it was where the kernel skips it (skips), else written."""
    pattern = np.full(want.rows * want.k, 7.25, np.float32)
    y, out = dev.upload(pattern), i8_buffers(dev, want.rows, want.k, want.k, "codes alone")
    run(y, out)
    for a, b, n in ((want.codes, out.codes, want.rows * want.k), (want.scales, out.scales, 4 * want.rows)):
        np.testing.assert_array_equal(dev.read(a, np.uint8, (n,)), dev.read(b, np.uint8, (n,)))
    assert np.array_equal(dev.read(y, np.float32, (pattern.size,)), pattern) == bool(skips)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(68, 96), (128, 64), (4, 288)])
def test_transpose_i8_is_exact(dev: Device, n: int, k: int) -> None:
    """W's codes transposed on the GPU (tiles of 64 x 64, partial at both edges) equal numpy's transpose byte for
    byte; the rows' scales are the buffer given; sizes that are no multiple of 4 are refused."""
    rng = np.random.default_rng(n + k)
    codes = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    w = i8_buffers(dev, n, k, k, "w")
    dev.write(w.codes, pack_i8(codes))
    ones = dev.upload(np.ones(k, np.float32))
    out = transpose_i8(dev, w, dev.buffer(n * k), ones)
    assert (out.rows, out.k, out.chunk, out.scales) == (k, n, n, ones)
    np.testing.assert_array_equal(dev.read(out.codes, np.int8, (k, n)), codes.T)
    with pytest.raises(DeviceError, match="multiples of 4"):
        transpose_i8(dev, i8_buffers(dev, 6, 64, 64, "odd"), dev.buffer(6 * 64), ones)
    with pytest.raises(DeviceError, match="fewer than"):
        transpose_i8(dev, w, dev.buffer(n * k - 4), ones)


def _check_gemm(dev: Device, m: int, n: int, k: int, chunk: int, cfg: I8Config | None, *, emulate: bool, **kw) -> float:
    rng = np.random.default_rng(m * 7 + n + chunk)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    wq = upload_i8(dev, w, chunk, "w")
    a = i8_buffers(dev, m, k, chunk, "x")
    quantize_i8_gpu(dev, dev.upload(x), a)
    ac = dev.read(a.codes, np.int8, (m, k))
    asc = dev.read(a.scales, np.float32, (m, k // chunk))
    ref = gemm_i8_reference(ac, asc, *quantize_i8(w, chunk))
    return _run_into_c(dev, rng, ref, lambda c: gemm_i8(dev, a, wq, c, cfg=cfg, emulate=emulate, **kw), **kw)


def _run_into_c(dev: Device, rng: np.random.Generator, ref: np.ndarray, call, **kw) -> float:
    """Run call(c) on a random C [c_offset + m * ldc] (gemm_i8's keywords in kw) and check it against
    alpha * ref [m, n] (+ C's old values with accumulate, + the residual buffer's, laid out as C, with residual):
    nothing written outside the m x n block; returns the worst error relative to the result's max."""
    m, n = ref.shape
    ldc, c_off, alpha = kw.get("ldc", n), kw.get("c_offset", 0), kw.get("alpha", 1.0)
    c0 = rng.standard_normal(c_off + m * ldc).astype(np.float32)
    c = dev.upload(c0)
    call(c)
    got = dev.read(c, np.float32, (c_off + m * ldc,))
    before, out = c0[c_off:].reshape(m, ldc), got[c_off:].reshape(m, ldc)
    want = alpha * ref + (before[:, :n] if kw.get("accumulate", False) else 0.0)
    if kw.get("residual") is not None:
        want = want + dev.read(kw["residual"], np.float32, (c_off + m * ldc,))[c_off:].reshape(m, ldc)[:, :n]
    assert np.array_equal(out[:, n:], before[:, n:]), "wrote past the last column"
    assert np.array_equal(got[:c_off], c0[:c_off]), "wrote before c_offset"
    return float(np.abs(out[:, :n] - want).max() / np.abs(want).max())


EMU_CASES = [  # (m, n, k, chunk, tile): edges in M and N, one and several chunks, both pipelines
    (70, 50, 128, 128, I8Config(2, 1, 1, 2, 32, 1)),
    (70, 50, 128, 64, I8Config(2, 1, 1, 2, 32, 1)),
    (33, 40, 192, 64, I8Config(1, 2, 2, 1, 64, 2, stages=2)),
    (16, 16, 64, 32, I8Config(2, 2, 1, 1, 32, 1, pad=0, stages=2)),
    # the scaling scratch in the staging buffers: in As's blocks (one and several chunks, the scaling between
    # steps), and in Bs's when As's are too small
    (70, 50, 128, 128, I8Config(2, 1, 2, 2, 64, 1, cs_in_stage=True)),
    (70, 90, 256, 64, I8Config(2, 1, 4, 2, 64, 2, cs_in_stage=True)),
    (40, 70, 128, 64, I8Config(1, 2, 1, 4, 64, 1, cs_in_stage=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,chunk,cfg", EMU_CASES, ids=lambda v: getattr(v, "label", str(v)))
def test_emulated_gemm_matches_the_reference(dev: Device, m: int, n: int, k: int, chunk: int, cfg: I8Config) -> None:
    assert _check_gemm(dev, m, n, k, chunk, cfg, emulate=True) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,old_ahead", [(32, 2), (64, 2), (64, 0), (32, 1), (64, 4)])
def test_emulated_gemm_accumulates_with_alpha_and_strides(dev: Device, chunk: int, old_ahead: int) -> None:
    """C += alpha A . B with C's values read as written (old_ahead 0) or 1, 2, 4 result matrices ahead (of 2)."""
    cfg = I8Config(2, 1, 1, 2, 32, 1, old_ahead=old_ahead)
    err = _check_gemm(dev, 20, 24, 64, chunk, cfg, emulate=True, accumulate=True, alpha=0.5, ldc=30, c_offset=5)
    assert err < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("old_ahead", [2, 0])
def test_emulated_gemm_adds_a_residual(dev: Device, old_ahead: int) -> None:
    """C = R + alpha A . B (R laid out as C, read as an accumulating epilogue reads C, ahead or as written; C's own
    values ignored), with and without the LoRA term; with accumulate it is refused."""
    rng = np.random.default_rng(old_ahead)
    kw = {"alpha": 0.5, "ldc": 40, "c_offset": 3}
    res = dev.upload(rng.standard_normal(3 + 48 * 40).astype(np.float32))
    cfg = I8Config(2, 1, 1, 2, 32, 1, old_ahead=old_ahead)
    assert _check_gemm(dev, 48, 32, 64, 64, cfg, emulate=True, residual=res, **kw) < TOL
    assert _check_gemm_lora(dev, 48, 32, 64, 16, cfg, "rows", emulate=True, residual=res, **kw) < TOL
    w = upload_i8(dev, np.ones((32, 64), np.float32), 64, "w")
    with pytest.raises(DeviceError, match="residual is read like C"):
        gemm_i8(dev, i8_buffers(dev, 48, 64, 64, "x"), w, dev.buffer(4 * 48 * 32), emulate=True, residual=res,
                accumulate=True)  # fmt: skip


@pytest.mark.gpu
def test_gemm_refuses_mismatched_operands(dev: Device) -> None:
    w = upload_i8(dev, np.ones((4, 128), np.float32), 64, "w.blk0")
    a = i8_buffers(dev, 4, 128, 128, "x")
    with pytest.raises(DeviceError, match=r"'w.blk0'.*chunk=128.*chunk=64"):
        gemm_i8(dev, a, w, dev.buffer(64), emulate=True)
    a = i8_buffers(dev, 4, 128, 64, "x")
    with pytest.raises(DeviceError, match="multiples of bk=128"):
        gemm_i8(dev, a, w, dev.buffer(64), emulate=True, cfg=I8Config(2, 1, 1, 1, 128, 1))
    if dev.backend != "dawn":  # lavapipe (CI): no integer tensor cores
        with pytest.raises(DeviceError, match="integer tensor cores need wgpudawn"):
            gemm_i8(dev, a, w, dev.buffer(64))


def _check_gemm_nn(dev: Device, m: int, r: int, p: int, cfg: I8Config | None, *, emulate: bool, **kw) -> float:
    """dX [m, p] = dY [m, r] . W [r, p] the way the engine runs it: W's per-row scales folded into dY before its
    8-bit rounding (quantize_i8_gpu col_scales), C's columns scaled by ones; against the float64 definition on
    the same codes. Also the fold itself: the codes of dY * sw equal the twin's."""
    rng = np.random.default_rng(m + r + p)
    dy = rng.standard_normal((m, r)).astype(np.float32)
    w = upload_i8(dev, rng.standard_normal((r, p)).astype(np.float32), p, "w")
    a = i8_buffers(dev, m, r, r, "dy")
    quantize_i8_gpu(dev, dev.upload(dy), a, col_scales=w.scales)
    ac, asc = dev.read(a.codes, np.int8, (m, r)), dev.read(a.scales, np.float32, (m, 1))
    wc, wsc = dev.read(w.codes, np.int8, (r, p)), dev.read(w.scales, np.float32, (r, 1))
    twin, twin_scales = quantize_i8(dy * wsc[:, 0][None, :], r)
    np.testing.assert_allclose(asc, twin_scales, rtol=1e-6)
    assert np.abs(ac.astype(int) - twin).max() <= 1
    ones = dev.upload(np.ones(p, np.float32))
    ref = (ac.astype(np.float64) @ wc.astype(np.float64)) * asc.astype(np.float64)
    nn = lambda c: gemm_i8(dev, a, w, c, orient="nn", col_scales=ones, cfg=cfg, emulate=emulate, **kw)  # noqa: E731
    return _run_into_c(dev, rng, ref, nn, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,r,p,cfg",
    [
        (70, 64, 96, I8Config(2, 1, 1, 2, 32, 1)),
        (33, 128, 160, I8Config(1, 2, 2, 1, 64, 2, stages=2)),
        (70, 128, 96, I8Config(2, 1, 2, 2, 64, 1, cs_in_stage=True)),
    ],
    ids=lambda v: getattr(v, "label", str(v)),
)
def test_emulated_input_gradient_gemm(dev: Device, m: int, r: int, p: int, cfg: I8Config) -> None:
    assert _check_gemm_nn(dev, m, r, p, cfg, emulate=True) < TOL


@pytest.mark.gpu
def test_emulated_input_gradient_gemm_accumulates(dev: Device) -> None:
    cfg = I8Config(2, 1, 1, 2, 32, 1)
    assert _check_gemm_nn(dev, 20, 64, 32, cfg, emulate=True, accumulate=True, alpha=0.5, ldc=40, c_offset=3) < TOL


TC_CASES = [  # the preset and candidate tiles, per-row and chunked scales, edges in M and N
    (4096, 1024, 4096, 4096, None),
    (4096, 256, 2048, 2048, NARROW_TILE),  # a k / v projection of the TinyLlama shape on the narrow tile
    (300, 200, 512, 512, NARROW_TILE),
    (300, 200, 512, 512, I8_TILE),
    (300, 200, 512, 128, I8_TILE),
    (300, 200, 512, 256, I8Config(4, 2, 4, 2, 32, 2, stages=2)),
    (300, 200, 512, 128, I8_TILE_CHUNKED),
    (300, 200, 512, 512, I8Config(4, 2, 4, 4, 32, 1, stages=2)),
    (300, 200, 512, 512, I8Config(4, 4, 4, 2, 64, 1, cs_in_stage=True)),
    (300, 200, 512, 128, I8Config(2, 4, 4, 4, 64, 2, cs_in_stage=True)),
]


@pytest.mark.tensorcore
@pytest.mark.parametrize("m,n,k,chunk,cfg", TC_CASES, ids=lambda v: getattr(v, "label", str(v)))
def test_gemm_on_tensor_cores(m: int, n: int, k: int, chunk: int, cfg: I8Config | None) -> None:
    dev = tensor_core_device_or_skip()
    assert _check_gemm(dev, m, n, k, chunk, cfg, emulate=False) < TOL


def test_narrow_products_pick_the_narrow_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """pick_i8_config: the narrow tile where the preset's grid has fewer than NARROW_WORKGROUPS (100) workgroups (k / v
    of the TinyLlama and SmolLM2 shapes) or fills less than NARROW_FILL of its waves of WAVE (SmolLM2's 1,536-wide
    products: 192 workgroups, 1.45 waves of 132), the preset at the Llama-3-8B's (k / v: 128, 0.97 of a wave) and
    TinyLlama's wide ones, never for chunked scales; BK 32 for chunks of 32; every pick is a registered variant's
    tile; NARROW_FILL 0 the grid count alone, NARROW_WORKGROUPS 0 the preset everywhere."""
    from gpu.ops import matmul_i8

    monkeypatch.setattr(matmul_i8, "NARROW_WORKGROUPS", 100)
    monkeypatch.setattr(matmul_i8, "WAVE", 132)
    monkeypatch.setattr(matmul_i8, "NARROW_FILL", 0.8)
    assert NARROW_TILE.bm * NARROW_TILE.bn < I8_TILE.bm * I8_TILE.bn
    for m, p in ((4096, 256), (4096, 192), (4096, 576), (300, 200), (4096, 1536)):
        assert pick_i8_config(1, 64, m, p) == NARROW_TILE, (m, p)
        assert pick_i8_config(1, 32, m, p).bk == 32
        assert pick_i8_config(2, 64, m, p) == I8_TILE_CHUNKED
    for m, p in ((4096, 1024), (4096, 4096), (4096, 14336), (4096, 2048), (4096, 5632)):
        assert pick_i8_config(1, 64, m, p) == I8_TILE, (m, p)
    assert pick_i8_config(1, 64) == I8_TILE
    tiles = {v.cfg for v in all_i8_variants()}
    assert {pick_i8_config(1, c, 4096, 256) for c in (32, 64)} <= tiles
    monkeypatch.setattr(matmul_i8, "NARROW_FILL", 0.0)
    assert pick_i8_config(1, 64, 4096, 1536) == I8_TILE
    assert pick_i8_config(1, 64, 4096, 256) == NARROW_TILE
    monkeypatch.setattr(matmul_i8, "NARROW_WORKGROUPS", 0)
    monkeypatch.setattr(matmul_i8, "NARROW_FILL", 0.8)
    assert pick_i8_config(1, 64, 4096, 256) == I8_TILE
    assert pick_i8_config(1, 64, 4096, 1536) == I8_TILE


@pytest.mark.tensorcore
@pytest.mark.parametrize("m,r,p", [(4096, 4096, 1024), (300, 512, 224), (260, 96, 64), (4096, 2048, 256)])
def test_input_gradient_gemm_on_tensor_cores(m: int, r: int, p: int) -> None:
    dev = tensor_core_device_or_skip()
    assert _check_gemm_nn(dev, m, r, p, None, emulate=False) < TOL
    assert _check_gemm_nn(dev, m, r, p, None, emulate=False, accumulate=True, alpha=2.0, ldc=p + 8, c_offset=4) < TOL


@pytest.mark.tensorcore
def test_gemm_on_tensor_cores_accumulates() -> None:
    dev = tensor_core_device_or_skip()
    for cfg in (I8_TILE, NARROW_TILE):
        kw = {"accumulate": True, "alpha": 2.0, "ldc": 140, "c_offset": 4}
        assert _check_gemm(dev, 260, 130, 256, 128, cfg, emulate=False, **kw) < TOL
    res = dev.upload(np.random.default_rng(1).standard_normal(4 + 272 * 280).astype(np.float32))
    kw = {"ldc": 280, "c_offset": 4, "residual": res}
    assert _check_gemm(dev, 260, 130, 256, 128, None, emulate=False, alpha=2.0, **kw) < TOL
    assert _check_gemm_lora(tensor_core_device_or_skip(), 272, 256, 256, 16, None, "rows", **kw) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("f,rows", [(256, 3), (4128, 2), (14336, 2), (17408, 2), (32768, 1)])
def test_glu_backward_i8_is_the_backward_then_the_quantizers(dev: Device, act: str, f: int, rows: int) -> None:
    """glu_backward_i8 (a gated unit's backward and both gradients' codes times the weights' row scales, in one
    pass): bitwise swiglu_backward's / geglu_backward's dg and du and quantize_i8_gpu's codes and scales of them
    (col_scales), on workgroups from 64 to 1,024 invocations (rows of 256 to 32,768), and with store_grads=False the
    same codes with dg and u untouched, and from dY R (dy_rot: the widest block dividing f) bitwise after rotate_rows's
    pass turning it back;
    operands outside one i8_pair refused, rows past the registers too."""
    from gpu.ops.gated import geglu_backward, swiglu_backward
    from gpu.ops.quantize_i8 import glu_backward_i8, i8_pair, pair_bytes

    rng = np.random.default_rng(f + rows)
    dy, g, u = (rng.standard_normal((rows, f)).astype(np.float32) * 2 for _ in range(3))
    cg, cu = (rng.uniform(0.001, 0.01, f).astype(np.float32) for _ in range(2))
    dyb, gb, cgb, cub = dev.upload(dy), dev.upload(g), dev.upload(cg), dev.upload(cu)
    u_sep, u_fused = dev.upload(u), dev.upload(u)
    dg_sep, dg_fused = dev.buffer(g.nbytes), dev.buffer(g.nbytes)
    (swiglu_backward if act == "swiglu" else geglu_backward)(dev, dyb, gb, u_sep, dg_sep, rows * f)
    sep = [i8_buffers(dev, rows, f, f, f"sep {n}") for n in range(2)]
    quantize_i8_gpu(dev, dg_sep, sep[0], col_scales=cgb)
    quantize_i8_gpu(dev, u_sep, sep[1], col_scales=cub)
    q_bytes, s_bytes = pair_bytes(rows, f, dev.offset_alignment)
    fused = i8_pair(dev.buffer(q_bytes), dev.buffer(s_bytes), rows, f, dev.offset_alignment, "fused")
    u_codes, dg_codes = dev.upload(u), dev.upload(np.full_like(g, 7.0))
    glu_backward_i8(dev, act, dyb, gb, u_fused, dg_fused, cgb, cub, *fused)
    for a, b in ((dg_sep, dg_fused), (u_sep, u_fused)):
        np.testing.assert_array_equal(dev.read(a, np.uint32, (rows * f,)), dev.read(b, np.uint32, (rows * f,)))

    def check_codes() -> None:
        for want, got in zip(sep, fused, strict=True):
            codes = dev.read(got.codes.buffer, np.uint8, (rows * f,), offset=got.codes.offset)
            scales = dev.read(got.scales.buffer, np.float32, (rows,), offset=got.scales.offset)
            np.testing.assert_array_equal(dev.read(want.codes, np.uint8, (rows * f,)), codes)
            np.testing.assert_array_equal(dev.read(want.scales, np.float32, (rows,)), scales)

    check_codes()
    for got in fused:  # the codes alone (store_grads=False): the same codes, dg and u left as they were
        dev.write(got.codes.buffer, np.zeros(pair_bytes(rows, f, dev.offset_alignment)[0] // 4, np.uint32))
    glu_backward_i8(dev, act, dyb, gb, u_codes, dg_codes, cgb, cub, *fused, store_grads=False)
    check_codes()
    np.testing.assert_array_equal(dev.read(u_codes, np.float32, (rows, f)), u)
    np.testing.assert_array_equal(dev.read(dg_codes, np.float32, (rows, f)), np.full_like(g, 7.0))
    with pytest.raises(DeviceError, match="i8_pair"):
        glu_backward_i8(dev, act, dyb, gb, u_fused, dg_fused, cgb, cub, sep[0], sep[1])
    for rot in [max(r for r in ROTATIONS[1:] if f % r == 0)] if f <= ROTATED_MAX else []:  # dY R turned back as read
        dyr, u_rot = dev.upload(dy), dev.upload(u)
        rotate_rows(dev, dyb, rows, f, rot, out=dyr, forward=True)
        back = dev.buffer(dy.nbytes)
        rotate_rows(dev, dyr, rows, f, rot, out=back, add=False)  # the pass it replaces
        u_sep, u_rot = dev.upload(u), dev.upload(u)
        (swiglu_backward if act == "swiglu" else geglu_backward)(dev, back, gb, u_sep, dg_sep, rows * f)
        quantize_i8_gpu(dev, dg_sep, sep[0], col_scales=cgb)
        quantize_i8_gpu(dev, u_sep, sep[1], col_scales=cub)
        glu_backward_i8(dev, act, dyr, gb, u_rot, dg_fused, cgb, cub, *fused, dy_rot=rot)
        for a, b in ((dg_sep, dg_fused), (u_sep, u_rot)):
            np.testing.assert_array_equal(dev.read(a, np.uint32, (rows * f,)), dev.read(b, np.uint32, (rows * f,)))
        check_codes()
    if f == 32768:  # one value more than a row of 1,024 invocations holds
        wide_q, wide_s = pair_bytes(1, f + 4, dev.offset_alignment)
        wide = i8_pair(dev.buffer(wide_q), dev.buffer(wide_s), 1, f + 4, dev.offset_alignment, "wide")
        with pytest.raises(DeviceError, match="operands of 1 x 32772"):
            glu_backward_i8(dev, act, dyb, gb, u_fused, dg_fused, cgb, cub, *wide)


def test_plain_products_pick_the_plain_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """pick_i8_config(plain=True): PLAIN_TILE (2 x 4 subgroups, the preset's area) for one chunk where the preset
    would be picked, the narrow tile where the grid is narrow, the chunked preset for several chunks, BK 32 for chunks
    of 32, each a registered variant's tile; PLAIN_TILE None: the preset. (gemm_i8 asks for it for a plain "nt"
    product: no LoRA term, no residual, not accumulating; the tensor-core GEMM tests run it against float64.)"""
    from gpu.ops import matmul_i8

    plain = matmul_i8.PLAIN_TILE
    assert plain is not None and plain != I8_TILE and plain.bm * plain.bn == I8_TILE.bm * I8_TILE.bn
    for m, p in ((4096, 4096), (4096, 14336), (4096, 1024)):
        assert pick_i8_config(1, 64, m, p, plain=True) == plain, (m, p)
        assert pick_i8_config(1, 64, m, p) == I8_TILE
    assert pick_i8_config(1, 64, 4096, 256, plain=True) == NARROW_TILE
    assert pick_i8_config(2, 64, 4096, 4096, plain=True) == I8_TILE_CHUNKED
    assert pick_i8_config(1, 32, 4096, 4096, plain=True).bk == 32
    tiles = {v.cfg for v in all_i8_variants()}
    assert {pick_i8_config(1, c, 4096, 4096, plain=True) for c in (32, 64)} <= tiles
    monkeypatch.setattr(matmul_i8, "PLAIN_TILE", None)
    assert pick_i8_config(1, 64, 4096, 4096, plain=True) == I8_TILE
