"""gemma3 on the GPU's f32 path (lavapipe) against the numpy reference: the new ops one by one (GeGLU forward and
backward; attention with a sliding window and a score scale, forward and backward), relative error <= 1e-4 and
bitwise repeatable, then the whole model: GPUStudent's loss and LoRA gradients and GPUTeacher's top-k on a tiny
gemma3 (post-norms, q/k norms, embedding scale, sliding blocks with their own RoPE base)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.device import Device
from gpu.ops.attention import attention_backward, attention_forward
from gpu.ops.geglu import geglu_backward, geglu_forward
from model import reference as ref
from tests.gpu_helpers import make_device, rel_err, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


@pytest.mark.parametrize("n", [1, 1000])
def test_geglu(dev: Device, n: int) -> None:
    rng = np.random.default_rng(n)
    g, u, dy = (3 * rng.standard_normal(n)).astype(np.float32), *rng.standard_normal((2, n)).astype(np.float32)
    if n > 2:
        g[:2] = [-60.0, 60.0]  # tanh saturates without overflow
    gb, dyb = up(dev, g), up(dev, dy)

    def run() -> list[np.ndarray]:
        ub, y, dg = up(dev, u), dev.buffer(4 * n), dev.buffer(4 * n)
        geglu_forward(dev, gb, ub, y, n)
        geglu_backward(dev, dyb, gb, ub, dg, n)  # du over u
        return [dev.read(b, np.float32, (n,)) for b in (y, dg, ub)]

    y, dg, du = twice(run)
    g64, u64, dy64 = (a.astype(np.float64) for a in (g, u, dy))
    want_dg, want_du = ref.geglu_backward(dy64, g64, u64)
    assert rel_err(y, ref.geglu_forward(g64, u64)) <= TOL
    assert rel_err(dg, want_dg) <= TOL and rel_err(du, want_du) <= TOL


@pytest.mark.parametrize(
    "t,hq,hkv,d,window",
    [(70, 3, 1, 16, 5), (70, 2, 2, 8, 64), (37, 4, 2, 32, 1), (130, 2, 1, 16, 33), (5, 2, 1, 256, 2)],
)
def test_windowed_scaled_attention(dev: Device, t: int, hq: int, hkv: int, d: int, window: int) -> None:
    """Windows below, at and across the 64-row query blocks and the key tiles; a scale that is not 1/sqrt(D)."""
    rng = np.random.default_rng(t + d + window)
    scale = 0.8 / np.sqrt(d)
    q, dout = rng.standard_normal((2, t, hq, d)).astype(np.float32)
    k, v = rng.standard_normal((2, t, hkv, d)).astype(np.float32)
    qb, kb, vb, dob = up(dev, q), up(dev, k), up(dev, v), up(dev, dout)
    kw = {"window": window, "scale": float(scale)}

    def run() -> list[np.ndarray]:
        out, lse = dev.buffer(q.nbytes), dev.buffer(hq * t * 4)
        dq, dk, dv = dev.buffer(q.nbytes), dev.buffer(k.nbytes), dev.buffer(v.nbytes)
        attention_forward(dev, qb, kb, vb, out, lse, t, hq, hkv, d, **kw)
        attention_backward(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d, **kw)
        shapes = (q.shape, q.shape, k.shape, v.shape)
        return [dev.read(b, np.float32, s) for b, s in zip((out, dq, dk, dv), shapes, strict=True)]

    out, dq, dk, dv = twice(run)
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, dout))
    assert rel_err(out, ref.attention_forward(q64, k64, v64, window, scale)) <= TOL
    for got, want in zip((dq, dk, dv), ref.attention_backward(do64, q64, k64, v64, window, scale), strict=True):
        assert rel_err(got, want) <= TOL
    # the window matters: the full causal attention is far from it
    assert rel_err(out, ref.attention_forward(q64, k64, v64, 0, scale)) > 100 * TOL
