"""bf16 copies (gpu/ops/half.py to_bf16 / from_bf16, the tensor-core path's checkpointed block inputs) against
their numpy twin model/bf16.py, and the twin against torch's bfloat16 (round to nearest even): bit for bit,
with ties, the largest finite values, infinities, NaN, signed zeros and subnormals among the inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.device import Device
from gpu.ops.half import from_bf16, to_bf16
from model.bf16 import bf16_bits, bf16_round
from tests.gpu_helpers import make_device, up


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(4000) * np.exp2(rng.integers(-140, 120, 4000))).astype(np.float32)
    one = np.float32(1.0)
    special = np.array(
        [
            0.0, -0.0, one, one + np.float32(2.0**-8), one + np.float32(3 * 2.0**-8),  # ties to even: down, up
            -(one + np.float32(2.0**-8)), np.finfo(np.float32).max, -np.finfo(np.float32).max,  # round to +-inf
            np.inf, -np.inf, np.nan, 1e-40, -1e-45, np.finfo(np.float32).tiny, 65504.0, 1e5, 3.0e38,
        ],
        np.float32,
    )  # fmt: skip
    return np.concatenate([special, wide, np.float32([-np.nan])]).astype(np.float32)


def test_numpy_twin_matches_torch() -> None:
    x = _values()
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bf16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(bf16_round(x)[~finite]).all()
    assert np.signbit(bf16_round(x)[~finite]).tolist() == np.signbit(x[~finite]).tolist()
    assert bf16_round(np.float32([1 + 2.0**-8, 1 + 3 * 2.0**-8])).tolist() == [1.0, 1 + 2.0**-6]
    assert np.isinf(bf16_round(np.float32([np.finfo(np.float32).max]))).all()


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


@pytest.mark.gpu
def test_to_bf16_and_back_match_the_twin(dev: Device) -> None:
    x = _values()
    n = x.size - x.size % 2
    x = x[:n]
    words = dev.buffer(2 * n)
    back = dev.upload(np.full(n, 7.0, np.float32))
    to_bf16(dev, up(dev, x), words, n)
    from_bf16(dev, words, back, n)
    got_bits = dev.read(words, np.uint16, (n,))  # little-endian: element 2i is the low half of word i
    want_bits = bf16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got_bits[finite], want_bits[finite])
    got = dev.read(back, np.float32, (n,))
    np.testing.assert_array_equal(got[finite].view(np.uint32), bf16_round(x)[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()


@pytest.mark.gpu
def test_bf16_refuses_odd_counts(dev: Device) -> None:
    buf = dev.buffer(64)
    with pytest.raises(ValueError, match="multiple of 2"):
        to_bf16(dev, buf, buf, 3)
