"""Fused-dequant matmul vs X . dequant(W)^T in float64, every weight type, both orientations (lavapipe)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gpu.codegen import TileConfig
from gpu.device import Device, DeviceError
from gpu.ops.matmul import gemm, linear, linear_input_grad
from gpu.weights import random_blocks, upload_quant, wrap_f32
from tests.gpu_fixtures import device_or_skip
from tests.gpu_helpers import gemm_twice

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev() -> Device:
    return device_or_skip()


TOL = 1e-4
# (M, N): M=1 (decode), M not a tile multiple, N not a multiple of 4 tiles; K per block size below.
SHAPES = [(1, 64), (7, 100), (33, 100)]
GGUF_ENCODABLE = (T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def _weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGML bytes or array, float64 dequantized [n, k]) — gguf-py encodes where it can."""
    if qtype in GGUF_ENCODABLE:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, (n, k), rng)
    return raw, dequantize(raw, qtype).reshape(n, k).astype(np.float64)


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("orient", ["nt", "nn"])
@pytest.mark.parametrize(
    "qtype", [T.F32, T.F16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name
)
def test_matmul_matches_dequantized_reference(dev: Device, qtype: T, orient: str) -> None:
    rng = np.random.default_rng([qtype.value, orient == "nt"])
    k = 512 if qtype in (T.Q4_K, T.Q6_K) else 160  # 5 blocks a row: odd rows of Q4_0 are not 4-aligned
    for m, n in SHAPES:
        raw, wd = _weight(qtype, n, k, rng)
        w = upload_quant(dev, raw, qtype, (n, k), name=f"w_{qtype.name}")
        r, p = (k, n) if orient == "nt" else (n, k)
        a = rng.standard_normal((m, r)).astype(np.float32)
        c = dev.buffer(m * p * 4)
        (linear if orient == "nt" else linear_input_grad)(dev, dev.upload(a), w, c, m)
        ref = a.astype(np.float64) @ (wd.T if orient == "nt" else wd)
        err = _rel_err(dev.read(c, np.float32, (m, p)), ref)
        assert err <= TOL, f"{qtype.name} {orient} M={m} N={n} K={k}: rel err {err:.2e}"


@pytest.mark.parametrize(
    "tile", [TileConfig(8, 8, 4, 4, 4), TileConfig(16, 32, 8, 8, 8, unroll=False)], ids=["tiny", "loop"]
)
def test_other_tiles_agree(dev: Device, tile: TileConfig) -> None:
    """Generator parameters (tile sizes, rolled reduction loop) give the same products; K = 100 (F32) leaves
    a partial reduction tile in both orientations."""
    rng = np.random.default_rng(5)
    m, n = 13, 40
    for qtype, k, orient in [
        (T.Q4_K, 256, "nt"),
        (T.Q4_K, 256, "nn"),
        (T.F32, 100, "nt"),
        (T.F32, 100, "nn"),
    ]:
        raw, wd = _weight(qtype, n, k, rng)
        w = upload_quant(dev, raw, qtype, (n, k))
        r, p = (k, n) if orient == "nt" else (n, k)
        a = rng.standard_normal((m, r)).astype(np.float32)
        c = dev.buffer(m * p * 4)
        gemm(dev, dev.upload(a), w, c, m, orient=orient, tile=tile)
        ref = a.astype(np.float64) @ (wd.T if orient == "nt" else wd)
        assert _rel_err(dev.read(c, np.float32, (m, p)), ref) <= TOL


def test_accumulate_alpha_strides_offsets(dev: Device) -> None:
    """C[:, 8:8+n] += 0.5 * X . W^T inside a wider output; X read at an offset with a row stride."""
    rng = np.random.default_rng(7)
    m, n, k, width, lda = 9, 36, 64, 52, 70
    raw, wd = _weight(T.Q8_0, n, k, rng)
    w = upload_quant(dev, raw, T.Q8_0, (n, k))
    xfull = rng.standard_normal(5 + m * lda).astype(np.float32)
    x = xfull[5:].reshape(m, lda)[:, :k]
    c0 = rng.standard_normal((m, width)).astype(np.float32)
    cb = dev.upload(c0)
    linear(
        dev,
        dev.upload(xfull),
        w,
        cb,
        m,
        accumulate=True,
        alpha=0.5,
        lda=lda,
        a_offset=5,
        ldc=width,
        c_offset=8,
    )
    ref = c0.astype(np.float64)
    ref[:, 8 : 8 + n] += 0.5 * (x.astype(np.float64) @ wd.T)
    got = dev.read(cb, np.float32, (m, width))
    np.testing.assert_array_equal(got[:, :8], c0[:, :8])  # untouched columns stay bitwise equal
    np.testing.assert_array_equal(got[:, 8 + n :], c0[:, 8 + n :])
    assert _rel_err(got, ref) <= TOL


def test_transposed_a_gives_lora_weight_gradient(dev: Device) -> None:
    """dB[out, r] = dY^T . T with dY [tokens, out], T [tokens, r] — trans_a + "nn" on an F32 view."""
    rng = np.random.default_rng(8)
    tokens, out, rank = 37, 20, 8
    dy = rng.standard_normal((tokens, out)).astype(np.float32)
    t = rng.standard_normal((tokens, rank)).astype(np.float32)
    tview = wrap_f32(dev.upload(t), (tokens, rank), name="t")
    db = dev.buffer(out * rank * 4)
    gemm(dev, dev.upload(dy), tview, db, out, orient="nn", trans_a=True)
    ref = dy.astype(np.float64).T @ t.astype(np.float64)
    assert _rel_err(dev.read(db, np.float32, (out, rank)), ref) <= TOL


def test_bitwise_reproducible(dev: Device) -> None:
    rng = np.random.default_rng(9)
    raw, _ = _weight(T.Q6_K, 48, 256, rng)
    gemm_twice(dev, linear, raw, T.Q6_K, (17, 48, 256), rng)


def test_shape_and_size_errors(dev: Device) -> None:
    rng = np.random.default_rng(10)
    with pytest.raises(ValueError, match="'blk.0.ffn_down.weight'.*multiple of 256"):
        upload_quant(dev, np.zeros(144, np.uint8), T.Q4_K, (1, 128), name="blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match="'w'.*35 data bytes.*needs 36"):
        upload_quant(dev, np.zeros(35, np.uint8), T.Q4_0, (2, 32), name="w")
    with pytest.raises(ValueError, match="Q2_K"):
        upload_quant(dev, np.zeros(84, np.uint8), T.Q2_K, (1, 256))
    raw, _ = _weight(T.Q4_0, 8, 64, rng)
    w = upload_quant(dev, raw, T.Q4_0, (8, 64), name="w")
    with pytest.raises(DeviceError, match="output C has 16 bytes"):
        linear(dev, dev.buffer(4 * 64 * 4), w, dev.buffer(16), 4)
