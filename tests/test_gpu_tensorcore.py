"""Tensor-core matmul (f16 operands, f32 accumulation) vs float64 on the f16-rounded operands.

Three layers, so that most of it runs without tensor cores:
- emulated (marker gpu, lavapipe in CI): the generated kernel with the subgroup-matrix builtins replaced
  by plain WGSL, which checks all of its indexing (staging, layouts, prefetch, epilogue, bounds);
- compiled (no marker): the real kernels through Dawn's WGSL compiler (Tint) on its Null backend, which
  checks the subgroup-matrix code, its types and uniformity rules without executing anything;
- tensorcore (H200 via the device tool): the real kernels on the hardware. Run there with
  `source .gl/enter.sh; python3 -m pytest -q -m tensorcore tests/test_gpu_tensorcore.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gpu.codegen_tc import TCConfig
from gpu.device import Device, DeviceError
from gpu.ops.matmul_tc import (
    TC_TILE,
    TC_TILE_SMALL_M,
    gemm_tc,
    has_tensor_cores,
    linear_input_grad_tc,
    linear_tc,
)
from gpu.weights import random_blocks, upload_quant
from tests.gpu_fixtures import device_or_skip

ALL_TYPES = [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
GGUF_ENCODABLE = (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0)
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


def _check_product(dev: Device, qtype: T, orient: str, m: int, n: int, k: int, seed: int, **kw: object) -> float:
    """Run gemm_tc on random operands and return its relative error vs the f16-operand reference."""
    rng = np.random.default_rng(seed)
    raw, wd = _weight(qtype, n, k, rng)
    w = upload_quant(dev, raw, qtype, (n, k), name=f"w_{qtype.name}")
    r, p = (k, n) if orient == "nt" else (n, k)
    a = rng.standard_normal((m, r)).astype(np.float32)
    c = dev.buffer(m * p * 4)
    (linear_tc if orient == "nt" else linear_input_grad_tc)(dev, dev.upload(a), w, c, m, **kw)
    ref = _f16(a) @ (wd.T if orient == "nt" else wd)
    return _rel_err(dev.read(c, np.float32, (m, p)), ref)


def _accumulate_case(dev: Device, tol: float, **kw: object) -> None:
    """C[:, 8:8+n] += 0.5 * X . W^T inside a wider output, X (f16 in memory) at an offset with a row
    stride; the columns around the product stay bitwise untouched."""
    rng = np.random.default_rng(7)
    m, n, k, width, lda = 19, 36, 64, 52, 70
    raw, wd = _weight(T.Q8_0, n, k, rng)
    w = upload_quant(dev, raw, T.Q8_0, (n, k))
    xfull = rng.standard_normal(6 + m * lda).astype(np.float16)
    x = xfull[6:].reshape(m, lda)[:, :k]
    c0 = rng.standard_normal((m, width)).astype(np.float32)
    cb = dev.upload(c0)
    opts = dict(accumulate=True, alpha=0.5, lda=lda, a_offset=6, ldc=width, c_offset=8, a_dtype="f16")
    linear_tc(dev, dev.upload(xfull), w, cb, m, **opts, **kw)
    ref = c0.astype(np.float64)
    ref[:, 8 : 8 + n] += 0.5 * (_f16(x) @ wd.T)
    got = dev.read(cb, np.float32, (m, width))
    np.testing.assert_array_equal(got[:, :8], c0[:, :8])
    np.testing.assert_array_equal(got[:, 8 + n :], c0[:, 8 + n :])
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
def test_emulated_accumulate_strides_f16_input(emu_dev: Device) -> None:
    _accumulate_case(emu_dev, TOL, emulate=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [TCConfig(2, 4, 2, 2, 32), TCConfig(1, 2, 2, 1, 64, prefetch=True), TC_TILE_SMALL_M],
    ids=["8sg-noprefetch", "bk64", "small-m"],
)
def test_emulated_other_tiles(emu_dev: Device, cfg: TCConfig) -> None:
    """Several subgroups per workgroup, single/double buffering, BK = 64; odd N gives the scalar A path."""
    for qtype, orient in [(T.Q4_K, "nt"), (T.Q4_0, "nn")]:
        err = _check_product(emu_dev, qtype, orient, 70, 150, 512, seed=3, cfg=cfg, emulate=True)
        assert err <= TOL, f"{cfg} {qtype.name} {orient}: rel err {err:.2e}"


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
from gpu.codegen_tc import TCConfig, TCVariant, matmul_tc_source
from gpu.device import Device
dev = Device(backend="dawn")
failed = []
for cfg in [TCConfig(*c[:5], bool(c[5])) for c in json.loads(sys.argv[1])]:
    for wtype in json.loads(sys.argv[2]):
        for orient in ("nt", "nn"):
            for a_type, a_vec in (("f32", True), ("f32", False), ("f16", True), ("f16", False)):
                v = TCVariant(wtype, orient, cfg, a_type, a_vec, accumulate=a_vec)
                try:
                    dev.device.create_shader_module(code=matmul_tc_source(v))
                except Exception as e:
                    failed.append(f"{v}: {str(e)[-600:]}")
print(json.dumps({"adapter": dev.adapter.summary, "failed": failed}))
"""


def test_tensor_core_kernels_compile_in_tint() -> None:
    pytest.importorskip("wgpudawn")
    cfgs = [[c.sg_m, c.sg_n, c.tm, c.tn, c.bk, int(c.prefetch)] for c in (TC_TILE, TC_TILE_SMALL_M)]
    env = dict(os.environ, WGPU_BACKEND_TYPE="Null", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(cfgs), json.dumps([t.name for t in ALL_TYPES])],
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
    assert not result["failed"], "\n".join(result["failed"][:3])


# ---- tensorcore: the real kernels on a GPU with subgroup matrices (H200 via the device tool) ----------


@pytest.fixture(scope="module")
def tc_dev() -> Device:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dev = Device(backend="dawn")
    except (DeviceError, ImportError, RuntimeError) as e:
        pytest.skip(f"no Dawn adapter: {e}")
    if not has_tensor_cores(dev):
        pytest.skip(f"Dawn adapter {dev.adapter.summary} has no usable subgroup matrices")
    return dev


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


@pytest.mark.tensorcore
@pytest.mark.parametrize(
    "cfg",
    [TC_TILE, TC_TILE_SMALL_M, TCConfig(2, 2, 4, 4, 32), TCConfig(2, 4, 4, 4, 16, prefetch=True)],
    ids=["preset", "small-m", "noprefetch", "8sg-bk16"],
)
def test_tensor_core_tiles_on_larger_shapes(tc_dev: Device, cfg: TCConfig) -> None:
    for qtype, orient in [(T.F16, "nt"), (T.Q4_K, "nn"), (T.Q6_K, "nt")]:
        err = _check_product(tc_dev, qtype, orient, 300, 520, 1024, seed=11, cfg=cfg)
        assert err <= TC_TOL, f"{cfg} {qtype.name} {orient}: rel err {err:.2e}"


@pytest.mark.tensorcore
def test_tensor_core_accumulate_strides_f16_input(tc_dev: Device) -> None:
    _accumulate_case(tc_dev, TC_TOL)


@pytest.mark.tensorcore
def test_tensor_cores_bitwise_reproducible(tc_dev: Device) -> None:
    rng = np.random.default_rng(9)
    m, n, k = 257, 300, 512
    raw, _ = _weight(T.Q4_K, n, k, rng)
    w = upload_quant(tc_dev, raw, T.Q4_K, (n, k))
    x = tc_dev.upload(rng.standard_normal((m, k)).astype(np.float32))
    outs = []
    for _ in range(2):
        y = tc_dev.buffer(m * n * 4)
        linear_tc(tc_dev, x, w, y, m)
        outs.append(tc_dev.read(y, np.uint32, (m, n)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.tensorcore
def test_tensor_core_size_errors(tc_dev: Device) -> None:
    w = upload_quant(tc_dev, np.zeros((8, 64), np.float32), T.F32, (8, 64), name="w")
    with pytest.raises(DeviceError, match="output C has 16 bytes"):
        linear_tc(tc_dev, tc_dev.buffer(4 * 64 * 4), w, tc_dev.buffer(16), 4)
    with pytest.raises(ValueError, match="orient"):
        gemm_tc(tc_dev, tc_dev.buffer(4 * 64 * 4), w, tc_dev.buffer(4 * 8 * 4), 4, orient="tn")
