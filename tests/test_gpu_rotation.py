"""The rotated integer GEMM's Walsh-Hadamard rotation (model/int8.py hadamard_rows; gpu/kernels/hadamard.wgsl).

The twin against the explicit matrix; the kernels (activation quantizer, weight decode, rotate_rows) against the
twin on lavapipe (marker gpu) and on Dawn (marker tensorcore). Tolerances: the rotation is a sum of `block` signed
f32 values scaled by 1/sqrt(block), so the kernels' f32 results differ from the float64 twin by ~log2(block) ulps
of the row's magnitude: 1e-5 of the row's max holds it (a wrong sign or partner is O(1)); codes may land one off
at a rounding tie, as the unrotated quantizer's (test_gpu_int8.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import gpu.ops.quantize_i8 as quantize_ops
from gpu.device import Device, DeviceError
from gpu.ops.matmul_i8 import i8_buffers
from gpu.ops.quantize_i8 import quantize_i8_gpu, rotate_rows, weight_to_i8
from gpu.weights import random_blocks, upload_quant
from model.int8 import ROTATED_MAX, hadamard_rows, quantize_i8, rotation_block, rotation_signs
from tests.gpu_fixtures import device_or_skip, tensor_core_device_or_skip


def sylvester(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix, H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    return np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]), -1.0, 1.0)


@pytest.mark.parametrize("block", [32, 64, 128])
def test_twin_is_signs_then_the_block_diagonal_hadamard_product(block: int) -> None:
    rng = np.random.default_rng(block)
    x = rng.standard_normal((3, 2 * block)).astype(np.float32)
    s = rotation_signs(2 * block)
    r = np.kron(np.eye(2), sylvester(block) / np.sqrt(block))
    rot = np.diag(s) @ r
    np.testing.assert_allclose(hadamard_rows(x, block), x @ rot, rtol=0, atol=1e-6)
    np.testing.assert_allclose(hadamard_rows(x, block, back=True), x @ rot.T, rtol=0, atol=1e-6)
    np.testing.assert_allclose(hadamard_rows(hadamard_rows(x, block), block, back=True), x, rtol=0, atol=1e-6)


def test_signs_are_balanced_and_not_periodic_in_a_block() -> None:
    s = rotation_signs(4096)
    assert set(np.unique(s)) == {-1.0, 1.0} and abs(s.mean()) < 0.1
    blocks = s.reshape(-1, 128)
    assert len({b.tobytes() for b in blocks}) == len(blocks)
    np.testing.assert_array_equal(rotation_signs(64, col0=128), s[128:192])


def test_rotation_block_is_the_largest_dividing_power() -> None:
    assert [rotation_block(k) for k in (576, 1536, 4096, 14336, 96, 48)] == [64, 128, 128, 128, 32, 0]
    assert rotation_block(ROTATED_MAX) == 128 and rotation_block(ROTATED_MAX + 128) == 0
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rows(np.zeros((1, 96), np.float32), 48)


def test_rotation_spreads_an_outlier_and_keeps_the_product() -> None:
    """Why it is there: one outlier channel sets a row's scale; rotated, the row's 8-bit error drops."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    x[:, 7] *= 60.0
    w = rng.standard_normal((32, 512)).astype(np.float32)
    xr, wr = hadamard_rows(x, 128), hadamard_rows(w, 128)
    np.testing.assert_allclose(xr @ wr.T, x @ w.T, rtol=1e-4, atol=1e-3)

    def err(a: np.ndarray) -> float:
        codes, scales = quantize_i8(a, a.shape[1])
        return float(np.abs(codes * scales - a).mean())

    assert err(xr) < err(x) / 4


@pytest.fixture(params=[pytest.param("any", marks=pytest.mark.gpu), pytest.param("dawn", marks=pytest.mark.tensorcore)])
def dev(request: pytest.FixtureRequest) -> Device:
    """lavapipe in CI (subgroups of 8: blocks of 32 exchange through shuffles, larger ones through workgroup
    memory), and Dawn on the H200 (subgroups of 32: every exchange a shuffle)."""
    return device_or_skip() if request.param == "any" else tensor_core_device_or_skip()


def _check_codes(dev: Device, out, x_rot: np.ndarray) -> None:
    rows, k = x_rot.shape
    codes_np, scales_np = quantize_i8(x_rot, out.chunk)
    scales = dev.read(out.scales, np.float32, scales_np.shape)
    np.testing.assert_allclose(scales, scales_np, rtol=1e-5)
    diff = np.abs(dev.read(out.codes, np.int8, (rows, k)).astype(int) - codes_np)
    assert diff.max() <= 1 and (diff > 0).mean() < 2e-2


@pytest.mark.parametrize("row_wg", [256, 64])
@pytest.mark.parametrize("k,rot,chunk", [(576, 64, 576), (1536, 128, 1536), (256, 32, 128), (4224, 128, 4224)])
def test_quantizer_rotates_like_the_twin(
    dev: Device, k: int, rot: int, chunk: int, row_wg: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activation codes of rotated rows (per row, or per chunk of a multiple of the block): the twin's codes of
    hadamard_rows(x). k 4224: an invocation holds 5 groups of four (more than one slot of the registers); rows of
    at most 4096 also on 64 invocations a row (quantize_i8.SHORT_ROW_WORKGROUP), where 1536 holds 6 groups each."""
    monkeypatch.setattr(quantize_ops, "SHORT_ROW_WORKGROUP", row_wg)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[:, 3] *= 50.0
    out = i8_buffers(dev, 5, k, chunk, "x")
    quantize_i8_gpu(dev, dev.upload(x), out, rot=rot)
    _check_codes(dev, out, hadamard_rows(x, rot))


@pytest.mark.parametrize("row_wg", [256, 64])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_weight_decode_rotates_like_the_twin(
    dev: Device, qtype: T, row_wg: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every type's rotated int8 decode against the twin (Q4_K's kernel also on 64 invocations a row)."""
    monkeypatch.setattr(quantize_ops, "SHORT_ROW_WORKGROUP", row_wg)
    rng = np.random.default_rng(int(qtype))
    n, k = 4, 512
    raw = random_blocks(qtype, (n, k), rng)
    out = weight_to_i8(dev, upload_quant(dev, raw, qtype, (n, k), name="w"), rot=128)
    _check_codes(dev, out, hadamard_rows(dequantize(raw, qtype).reshape(n, k).astype(np.float32), 128))


@pytest.mark.parametrize("mode", ["back", "back_add", "forward"])
def test_rotate_rows_in_place_accumulating_and_forward(dev: Device, mode: str) -> None:
    """x R^T in place, y += x R^T, and y = x R (the LoRA A of the input gradient's epilogue term) against the twin."""
    rng = np.random.default_rng(5)
    rows, k = 7, 1536
    x = rng.standard_normal((rows, k)).astype(np.float32)
    y = rng.standard_normal((rows, k)).astype(np.float32)
    xb, yb = dev.upload(x), dev.upload(y)
    rotate_rows(dev, xb, rows, k, 128, out=None if mode == "back" else yb, forward=mode == "forward")
    got = dev.read(xb if mode == "back" else yb, np.float32, (rows, k))
    if mode == "forward":
        want = hadamard_rows(x, 128)
        np.testing.assert_array_equal(dev.read(xb, np.float32, (rows, k)), x)
    else:
        want = hadamard_rows(x, 128, back=True) + (y if mode == "back_add" else 0.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_rotation_refuses_what_it_cannot_hold(dev: Device) -> None:
    out = i8_buffers(dev, 2, 96, 96, "x")
    with pytest.raises(DeviceError, match="rotation 64"):
        quantize_i8_gpu(dev, dev.upload(np.zeros((2, 96), np.float32)), out, rot=64)
    with pytest.raises(DeviceError, match="rotate_rows"):
        rotate_rows(dev, dev.upload(np.zeros(2 * 96, np.float32)), 2, 96, 0)
    with pytest.raises(DeviceError, match="forward=True writes into `out`"):
        rotate_rows(dev, dev.upload(np.zeros(2 * 128, np.float32)), 2, 128, 128, forward=True)
