"""Tensor-core matmul (f16 operands, f32 accumulation) vs float64 on the f16-rounded operands.

Three layers, so that most of it runs without tensor cores:
- emulated (marker gpu, lavapipe in CI): the generated kernel with the subgroup-matrix builtins replaced
  by plain WGSL, which checks all of its indexing (staging, layouts, prefetch, epilogue, bounds);
- compiled (no marker): the real kernels through Dawn's WGSL compiler (Tint) on its Null backend, which
  checks the subgroup-matrix code, its types and uniformity rules without executing anything;
- tensorcore (a GPU with subgroup matrices, e.g. an H200): the real kernels on the hardware. Run there with
  `source .gl/enter.sh; python3 -m pytest -q -m tensorcore tests/test_gpu_tensorcore.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gpu.codegen_tc import TCConfig
from gpu.device import Device, DeviceError
from gpu.ops.half import weight_to_f16
from gpu.ops.matmul_tc import (
    EMU_TILE,
    TC_TILE,
    TC_TILE_NARROW,
    TC_TILE_SMALL_M,
    gemm_tc,
    has_tensor_cores,
    linear_input_grad_tc,
    linear_tc,
)
from gpu.weights import padded_nbytes, random_blocks, upload_quant
from tests.gpu_fixtures import device_or_skip, tensor_core_device_or_skip
from tests.gpu_helpers import gemm_twice

ALL_TYPES = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K]
GGUF_ENCODABLE = (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# f32 accumulation of f16 products: the kernel's error vs float64 is ~1e-6 of the largest output on these
# shapes (the ordering of the f32 sums); an indexing or decode error is O(1).
TOL = 2e-5
# On tensor cores the products are summed in f32 in the hardware's own order and rounding.
TC_TOL = 1e-4


def _weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGML data, float64 of the dequantized weight rounded to f16) for a random (n, k) weight."""
    if qtype in GGUF_ENCODABLE:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, (n, k), rng)
    return raw, _f16(dequantize(raw, qtype).reshape(n, k))


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _check_product(
    dev: Device, qtype: T, orient: str, m: int, n: int, k: int, seed: int, a_dtype: str = "f32", **kw: object
) -> float:
    """Run gemm_tc on random operands (C poisoned with NaN first, so an unwritten element fails) and
    return its relative error vs the f16-operand reference."""
    rng = np.random.default_rng(seed)
    raw, wd = _weight(qtype, n, k, rng)
    w = upload_quant(dev, raw, qtype, (n, k), name=f"w_{qtype.name}")
    r, p = (k, n) if orient == "nt" else (n, k)
    a = rng.standard_normal((m, r)).astype(np.float32)
    c = dev.upload(np.full((m, p), np.nan, np.float32))
    a_dev = dev.upload(a.astype(np.float16) if a_dtype == "f16" else a)
    (linear_tc if orient == "nt" else linear_input_grad_tc)(dev, a_dev, w, c, m, a_dtype=a_dtype, **kw)
    ref = _f16(a) @ (wd.T if orient == "nt" else wd)
    got = dev.read(c, np.float32, (m, p))
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} elements of C unwritten or non-finite"
    return _rel_err(got, ref)


# (m, n, k, width, lda, a_offset, c_offset, alpha): alpha 0.5 and odd strides take the checked epilogue;
# the last case (tile-aligned, alpha 1, 16-byte aligned rows) the direct one, which loads C first.
ACCUMULATE_CASES = [(19, 36, 64, 52, 70, 6, 8, 0.5), (19, 36, 64, 52, 72, 8, 8, 1.0), (64, 64, 96, 72, 96, 0, 4, 1.0)]


def _accumulate_case(
    dev: Device, tol: float, case: tuple[int, int, int, int, int, int, int, float], **kw: object
) -> None:
    """C[:, c_off:c_off+n] += alpha * X . W^T inside a wider output, X (f16 in memory) at an offset with a
    row stride; the columns around the product stay bitwise untouched."""
    m, n, k, width, lda, a_off, c_off, alpha = case
    rng = np.random.default_rng(7)
    raw, wd = _weight(T.Q8_0, n, k, rng)
    w = upload_quant(dev, raw, T.Q8_0, (n, k))
    xfull = rng.standard_normal(a_off + m * lda).astype(np.float16)
    x = xfull[a_off:].reshape(m, lda)[:, :k]
    c0 = rng.standard_normal((m, width)).astype(np.float32)
    cb = dev.upload(c0)
    opts = dict(accumulate=True, alpha=alpha, lda=lda, a_offset=a_off, ldc=width, c_offset=c_off, a_dtype="f16")
    linear_tc(dev, dev.upload(xfull), w, cb, m, **opts, **kw)
    ref = c0.astype(np.float64)
    ref[:, c_off : c_off + n] += alpha * (_f16(x) @ wd.T)
    got = dev.read(cb, np.float32, (m, width))
    np.testing.assert_array_equal(got[:, :c_off], c0[:, :c_off])
    np.testing.assert_array_equal(got[:, c_off + n :], c0[:, c_off + n :])
    assert _rel_err(got, ref) <= tol


# ---- emulated: the generated kernel's indexing on any adapter with shader-f16 (lavapipe) --------------


@pytest.fixture(scope="module")
def emu_dev() -> Device:
    dev = device_or_skip()
    if "shader-f16" not in dev.features:
        pytest.skip(f"adapter {dev.adapter.summary} has no shader-f16")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("orient", ["nt", "nn"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_emulated_kernel_matches_reference(emu_dev: Device, qtype: T, orient: str) -> None:
    """Every weight type, both orientations, M = 1 and M, N off the tile grid, K with a partial tile."""
    k = 256 if qtype in (T.Q4_K, T.Q6_K) else 96
    for m, n in [(1, 44), (37, 52)]:
        err = _check_product(emu_dev, qtype, orient, m, n, k, seed=qtype.value, emulate=True)
        assert err <= TOL, f"{qtype.name} {orient} M={m} N={n} K={k}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ACCUMULATE_CASES, ids=["checked", "checked-aligned", "direct"])
def test_emulated_accumulate_strides_f16_input(emu_dev: Device, case: tuple) -> None:
    _accumulate_case(emu_dev, TOL, case, cfg=EMU_TILE, emulate=True)


# Tiles exercising every generator option: subgroups per workgroup, stages 0/1/2, staging units of 4/8,
# BK = 64, plain raster order, the checked epilogue only.
EMU_TILES = [
    TCConfig(2, 2, 1, 1, 32, stages=0, vec=4),
    TCConfig(1, 2, 2, 1, 64, stages=1, vec=8, group_m=0),
    TCConfig(2, 1, 1, 2, 32, stages=2, vec=4, group_m=2, direct=False),
    TCConfig(2, 2, 1, 1, 32, stages=2, vec=8, split=False),
    TC_TILE_SMALL_M,
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", EMU_TILES, ids=lambda c: c.label)
def test_emulated_other_tiles(emu_dev: Device, cfg: TCConfig) -> None:
    """M, N off the tile grid, reduction tails (R % BK != 0), an "nn" weight with K % 8 != 0 (the checked
    B loaders), f16 A with the 8-, 4- and 1-wide loads."""
    cases = [
        (T.Q4_K, "nt", "f32", 40, 72, 256),
        (T.Q4_0, "nn", "f32", 40, 100, 256),
        (T.F16, "nt", "f16", 33, 72, 96),
        (T.F16, "nn", "f16", 33, 72, 100),
        (T.Q8_0, "nt", "f16", 65, 66, 224),
    ]
    _products_within(emu_dev, cfg, cases, TOL, seed=3, emulate=True)


def _products_within(dev: Device, cfg: TCConfig, cases: list[tuple], tol: float, **kw: object) -> None:
    """_check_product of every (qtype, orient, a_dtype, m, n, k) case on tile cfg, each within tol."""
    for qtype, orient, a_dtype, m, n, k in cases:
        err = _check_product(dev, qtype, orient, m, n, k, a_dtype=a_dtype, cfg=cfg, **kw)  # type: ignore[arg-type]
        assert err <= tol, f"{cfg.label} {qtype.name} {orient} {a_dtype} {m}x{n}x{k}: rel err {err:.2e}"


# The dedicated 8-wide weight loaders (gpu/codegen_tc.py's W_STAGING): several blocks per weight row (the
# block index along K), odd block counts (Q4_0 / Q8_0 blocks alternate between word-aligned and not), M, N
# off the tile grid, "nn" reduction tails (N % BK != 0), and with BK = 64 an "nt" reduction tail (K % 64).
STAGING_CASES = [
    (T.Q4_K, "nt", "f16", 37, 20, 768, EMU_TILE),
    (T.Q4_K, "nn", "f32", 21, 44, 768, EMU_TILE),
    (T.Q6_K, "nn", "f16", 21, 44, 512, EMU_TILE),
    (T.Q4_0, "nt", "f16", 19, 36, 160, TCConfig(1, 2, 2, 1, 64, stages=2, vec=8)),
    (T.Q4_0, "nn", "f16", 19, 84, 96, EMU_TILE),
    (T.Q8_0, "nn", "f32", 19, 52, 160, EMU_TILE),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", STAGING_CASES, ids=lambda c: f"{c[0].name}-{c[1]}-{c[2]}-{c[6].label}")
def test_emulated_dedicated_weight_staging(emu_dev: Device, case: tuple) -> None:
    qtype, orient, a_dtype, m, n, k, cfg = case
    err = _check_product(emu_dev, qtype, orient, m, n, k, seed=5, a_dtype=a_dtype, cfg=cfg, emulate=True)
    assert err <= TOL, f"{qtype.name} {orient} {a_dtype} {m}x{n}x{k}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.F32, T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_emulated_decoded_weight_gives_the_same_products(emu_dev: Device, qtype: T) -> None:
    """weight_to_f16 (the LM head's vocab chunk decoded once for its two products): the decoded rows are within an
    f16 ulp of the float64 dequantization, and the GEMMs over them, both orientations (logits "nt", dh "nn"), give
    bitwise the results of the GEMMs decoding the quantized weight as they stage it."""
    rng = np.random.default_rng(40 + qtype.value)
    n, k, m = 40, 256, 19
    raw, wd = _weight(qtype, n, k, rng)
    w = upload_quant(emu_dev, raw, qtype, (n, k), name="head")
    w16 = weight_to_f16(emu_dev, w, emu_dev.buffer(padded_nbytes(T.F16, (n, k))))
    assert (w16.qtype, w16.shape) == (T.F16, (n, k))
    got = emu_dev.read(w16.buffer, np.float16, (n, k)).astype(np.float64)
    ulp = np.spacing(np.abs(wd).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got - wd) <= ulp), float(np.abs(got - wd).max())
    for orient, r, p in (("nt", k, n), ("nn", n, k)):
        a = emu_dev.upload(rng.standard_normal((m, r)).astype(np.float16))
        outs = []
        for weight in (w, w16):
            c = emu_dev.upload(np.full((m, p), np.nan, np.float32))
            gemm_tc(emu_dev, a, weight, c, m, orient=orient, a_dtype="f16", cfg=EMU_TILE, emulate=True)
            outs.append(emu_dev.read(c, np.float32, (m, p)))
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[1], outs[0], err_msg=orient)


@pytest.mark.gpu
def test_refuses_without_tensor_cores(emu_dev: Device) -> None:
    if has_tensor_cores(emu_dev):
        pytest.skip("this adapter has tensor cores")
    w = upload_quant(emu_dev, np.zeros((4, 32), np.float32), T.F32, (4, 32), name="w")
    with pytest.raises(DeviceError, match="gemm_tc with 'w'"):
        linear_tc(emu_dev, emu_dev.buffer(4 * 32 * 4), w, emu_dev.buffer(16 * 4), 4)


# ---- compiled: the real subgroup-matrix kernels through Tint on Dawn's Null backend -------------------

_COMPILE_SCRIPT = """
import json, sys
from gpu.codegen_tc import TCConfig, matmul_tc_source
from gpu.device import Device
from gpu.ops.matmul_tc import all_variants
dev = Device(backend="dawn")
failed, count = [], 0
for c, types in json.loads(sys.argv[1]):
    for v in all_variants(TCConfig(**c), types):
        count += 1
        try:
            dev.device.create_shader_module(code=matmul_tc_source(v))
        except Exception as e:
            failed.append(f"{v}: {str(e)[-600:]}")
print(json.dumps({"adapter": dev.adapter.summary, "count": count, "failed": failed}))
"""


def test_tensor_core_kernels_compile_in_tint() -> None:
    """Every variant gemm_tc can dispatch with the presets compiles in Tint, for every weight type; the tested
    tiles' variants (each a generator option) for one K-quant and one plain type (the weight decode is the tile's
    same snippet: the presets cover each type's)."""
    pytest.importorskip("wgpudawn")
    presets = {TC_TILE, TC_TILE_NARROW, TC_TILE_SMALL_M}
    tiles = presets | {*EMU_TILES, *TC_TILES}
    some = [T.Q4_K, T.F16]
    cfgs = [(dataclasses.asdict(c), [t.name for t in (ALL_TYPES if c in presets else some)]) for c in tiles]
    env = dict(os.environ, WGPU_BACKEND_TYPE="Null", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cfgs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "Null" not in proc.stdout + proc.stderr:
        pytest.skip(f"Dawn's Null backend is unavailable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Null" in result["adapter"]
    assert result["count"] >= 20 * len(tiles)
    assert not result["failed"], "\n".join(result["failed"][:3])


# ---- tensorcore: the real kernels on a GPU with subgroup matrices (e.g. an H200) ----------


@pytest.fixture(scope="module")
def tc_dev() -> Device:
    return tensor_core_device_or_skip()


@pytest.mark.tensorcore
@pytest.mark.parametrize("orient", ["nt", "nn"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_tensor_cores_match_reference(tc_dev: Device, qtype: T, orient: str) -> None:
    """Both presets (M = 1 and M = 130 pick different tiles); N = 200 leaves partial tiles, and in "nn"
    a partial reduction tile."""
    k = 768 if qtype in (T.Q4_K, T.Q6_K) else 480
    for m in (1, 130):
        err = _check_product(tc_dev, qtype, orient, m, 200, k, seed=qtype.value + 100)
        assert err <= TC_TOL, f"{qtype.name} {orient} M={m} K={k}: rel err {err:.2e}"


# The presets plus the generator's other options on the hardware.
TC_TILES = [
    TC_TILE,
    TC_TILE_NARROW,
    TC_TILE_SMALL_M,
    TCConfig(2, 4, 4, 2, 32, stages=2, vec=8),  # the former preset: 128 x 128, two buffers
    TCConfig(4, 4, 2, 2, 32, stages=0, vec=4),
    TCConfig(2, 2, 4, 4, 64, stages=1, vec=8, group_m=0),
    TCConfig(4, 2, 2, 4, 32, stages=2, vec=4, direct=False),
]


@pytest.mark.tensorcore
@pytest.mark.parametrize("cfg", TC_TILES, ids=lambda c: c.label)
def test_tensor_core_tiles_on_larger_shapes(tc_dev: Device, cfg: TCConfig) -> None:
    """Shapes off every tile grid (and one on it: interior tiles store directly); f16 A at all widths."""
    cases = [
        (T.F16, "nt", "f16", 300, 520, 1024),
        (T.F16, "nn", "f16", 256, 256, 1000),
        (T.Q4_K, "nn", "f32", 300, 520, 1024),
        (T.Q6_K, "nt", "f32", 300, 520, 1024),
        (T.Q4_0, "nt", "f32", 512, 512, 512),
        (T.Q8_0, "nn", "f16", 129, 100, 160),
    ]
    _products_within(tc_dev, cfg, cases, TC_TOL, seed=11)


@pytest.mark.tensorcore
@pytest.mark.parametrize("case", ACCUMULATE_CASES, ids=["checked", "checked-aligned", "direct"])
def test_tensor_core_accumulate_strides_f16_input(tc_dev: Device, case: tuple) -> None:
    _accumulate_case(tc_dev, TC_TOL, case, cfg=TC_TILE_NARROW)


@pytest.mark.tensorcore
def test_tensor_cores_bitwise_reproducible(tc_dev: Device) -> None:
    rng = np.random.default_rng(9)
    raw, _ = _weight(T.Q4_K, 300, 512, rng)
    gemm_twice(tc_dev, linear_tc, raw, T.Q4_K, (257, 300, 512), rng)


@pytest.mark.tensorcore
def test_tensor_core_size_errors(tc_dev: Device) -> None:
    w = upload_quant(tc_dev, np.zeros((8, 64), np.float32), T.F32, (8, 64), name="w")
    with pytest.raises(DeviceError, match="output C has 16 bytes"):
        linear_tc(tc_dev, tc_dev.buffer(4 * 64 * 4), w, tc_dev.buffer(16), 4)
    with pytest.raises(ValueError, match="orient"):
        gemm_tc(tc_dev, tc_dev.buffer(4 * 64 * 4), w, tc_dev.buffer(4 * 8 * 4), 4, orient="tn")
