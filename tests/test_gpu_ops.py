"""GPU ops vs the numpy reference (model/reference.py) on tiny shapes: forward and backward, float64 oracle,
relative error (max abs err / max abs ref) <= 1e-4, and every op run twice with bitwise-equal results."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gpu.device import Device
from gpu.ops.add import add, add_inplace, scale_inplace
from gpu.ops.attention import attention_backward, attention_forward
from gpu.ops.embedding import embedding_forward
from gpu.ops.gated import swiglu_backward, swiglu_forward
from gpu.ops.half import add_unscaled, to_f16, to_f16_scaled
from gpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gpu.weights import quantize_upload
from model import reference as ref
from model.quant import dequantize, quantize
from tests.gpu_helpers import make_device, rel_err, rope_matches_reference, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_embedding(dev: Device, qtype: str) -> None:
    rng = np.random.default_rng(0)
    v, h = 37, 64
    table = rng.standard_normal((v, h)).astype(np.float32)
    qt = GGMLQuantizationType[qtype]
    w = quantize_upload(dev, table, qt, name=f"emb_{qtype}")
    ids = np.array([3, 0, 36, 3, 17, 5, 9], np.uint32)
    want = ref.embedding_forward(dequantize(quantize(table, qt), qt, (v, h)).astype(np.float64), ids)
    ids_buf = up(dev, ids, np.uint32)

    def run() -> list[np.ndarray]:
        out = dev.buffer(ids.size * h * 4)
        embedding_forward(dev, w, ids_buf, out, ids.size)
        return [dev.read(out, np.float32, (ids.size, h))]

    (got,) = twice(run)
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("t,h", [(1, 72), (5, 72), (3, 200), (2, 4100), (2, 77)])
@pytest.mark.parametrize("vec4", [True, False])
def test_rmsnorm(dev: Device, t: int, h: int, vec4: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and input gradient (set and accumulated) against float64; the gradient on rmsnorm_backward4 (vec4s,
    rows within its registers and longer: 4100 > 4096 values; 77 takes the scalar kernel) and the scalar kernel."""
    from gpu.ops import rmsnorm

    monkeypatch.setattr(rmsnorm, "VEC4_BACKWARD", vec4)
    rng = np.random.default_rng(t * 1000 + h)
    x = rng.standard_normal((t, h)) * 2.0
    w = 1.0 + 0.1 * rng.standard_normal(h)
    dy = rng.standard_normal((t, h))
    prev = rng.standard_normal((t, h))
    eps = 1e-5
    x32, w32, dy32 = (a.astype(np.float32) for a in (x, w, dy))
    xb, wb, dyb = up(dev, x32), up(dev, w32), up(dev, dy32)

    def run() -> list[np.ndarray]:
        y, dx, dacc = dev.buffer(t * h * 4), dev.buffer(t * h * 4), up(dev, prev)
        rmsnorm_forward(dev, xb, wb, y, t, h, eps)
        rmsnorm_backward(dev, dyb, xb, wb, dx, t, h, eps)
        rmsnorm_backward(dev, dyb, xb, wb, dacc, t, h, eps, accumulate=True)
        return [dev.read(b, np.float32, (t, h)) for b in (y, dx, dacc)]

    y, dx, dacc = twice(run)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x32, w32, dy32))
    assert rel_err(y, ref.rmsnorm_forward(x64, w64, eps)) <= TOL
    dx_ref = ref.rmsnorm_backward(dy64, x64, w64, eps)
    assert rel_err(dx, dx_ref) <= TOL
    assert rel_err(dacc, dx_ref + prev.astype(np.float32)) <= TOL


@pytest.mark.parametrize("t,nh,start,use_buf", [(1, 3, 0, False), (6, 3, 5, False), (6, 2, 2, True)])
def test_rope(dev: Device, t: int, nh: int, start: int, use_buf: bool) -> None:
    rope_matches_reference(dev, np.random.default_rng(t + nh), t, nh, 16, 10000.0, start, use_buf)


@pytest.mark.parametrize("neox", [False, True])
def test_attention_pack_with_rope_is_rope_then_pack(dev: Device, neox: bool) -> None:
    """The tensor-core attention's q/k packs with RoPE applied on the way (attention_tc._pack_roped): bitwise the f16
    pack of rope_forward's output, every sequence of a batch at its rows' positions (shuffled), the padding rows zero
    (over a destination full of garbage); a table of another head dim refused."""
    from gpu.ops.attention_tc import RopeAt, _pack, _pack_roped, padded_rows
    from gpu.ops.rope import RopeTable, rope_forward

    if "shader-f16" not in dev.features:
        pytest.skip("adapter without shader-f16")
    rng = np.random.default_rng(11 + neox)
    b, t, heads, d = 3, 21, 2, 16
    x = (rng.standard_normal((b * t, heads, d)) * 3).astype(np.float32)
    positions = np.concatenate([rng.permutation(40)[:t] for _ in range(b)]).astype(np.uint32)
    table = RopeTable.build(dev, d, 10000.0, 64, neox=neox)
    xb, pos = up(dev, x), up(dev, positions, np.uint32)
    roped = dev.buffer(x.nbytes)
    rope_forward(dev, table, xb, roped, b * t, heads, positions=pos)
    n16 = b * padded_rows(t) * heads * d
    want, got = dev.buffer(2 * n16), up(dev, rng.integers(1, 2**15, n16).astype(np.uint16), np.uint16)
    _pack(dev, roped, want, t, heads, d, b)
    _pack_roped(dev, xb, got, RopeAt(table, pos), t, heads, d, b)
    w, g = dev.read(want, np.uint16, (n16,)), dev.read(got, np.uint16, (n16,))
    np.testing.assert_array_equal(g, w)
    assert not w.reshape(b, padded_rows(t), -1)[:, t:].any() and w.reshape(b, padded_rows(t), -1)[:, :t].any()
    with pytest.raises(ValueError, match="head dim"):
        _pack_roped(dev, xb, got, RopeAt(table, pos), t, heads * 2, d // 2, b)


@pytest.mark.parametrize("t,hq,hkv,d", [(1, 3, 1, 16), (70, 3, 1, 16), (37, 2, 2, 8), (5, 2, 1, 64)])
def test_attention(dev: Device, t: int, hq: int, hkv: int, d: int) -> None:
    rng = np.random.default_rng(t * 7 + hq + d)
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    dout = rng.standard_normal((t, hq, d)).astype(np.float32)
    qb, kb, vb, dob = up(dev, q), up(dev, k), up(dev, v), up(dev, dout)

    def run() -> list[np.ndarray]:
        out, lse = dev.buffer(q.nbytes), dev.buffer(hq * t * 4)
        dq, dk, dv = dev.buffer(q.nbytes), dev.buffer(k.nbytes), dev.buffer(v.nbytes)
        attention_forward(dev, qb, kb, vb, out, lse, t, hq, hkv, d)
        attention_backward(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d)
        shapes = (q.shape, (hq, t), q.shape, k.shape, v.shape)
        return [dev.read(b, np.float32, s) for b, s in zip((out, lse, dq, dk, dv), shapes, strict=True)]

    out, lse, dq, dk, dv = twice(run)
    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, dout))
    assert rel_err(out, ref.attention_forward(q64, k64, v64)) <= TOL
    s = np.einsum("thd,shd->hts", q64, np.repeat(k64, hq // hkv, axis=1)) / np.sqrt(d)
    s = np.where(np.triu(np.ones((t, t), dtype=bool), k=1), -np.inf, s)
    assert rel_err(lse, ref.logsumexp(s)[..., 0]) <= TOL
    for got, want in zip((dq, dk, dv), ref.attention_backward(do64, q64, k64, v64), strict=True):
        assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("n", [1, 1000])
def test_swiglu_and_add(dev: Device, n: int) -> None:
    rng = np.random.default_rng(n)
    g, u, dy, b = (rng.standard_normal(n).astype(np.float32) * 4.0 for _ in range(4))
    gb, ub, dyb, bb = up(dev, g), up(dev, u), up(dev, dy), up(dev, b)

    def run() -> list[np.ndarray]:
        y, dg, du, s, acc, sc = (dev.buffer(4 * n) for _ in range(6))
        swiglu_forward(dev, gb, ub, y, n)
        dev.copy(ub, du, 4 * n)  # the backward writes dU over U
        swiglu_backward(dev, dyb, gb, du, dg, n)
        add(dev, y, bb, s, n)
        dev.copy(dyb, acc, 4 * n)
        add_inplace(dev, acc, bb, n)
        dev.copy(bb, sc, 4 * n)
        scale_inplace(dev, sc, 0.37, n)
        return [dev.read(x, np.float32, (n,)) for x in (y, dg, du, s, acc, sc)]

    y, dg, du, s, acc, sc = twice(run)
    g64, u64, dy64, b64 = (a.astype(np.float64) for a in (g, u, dy, b))
    assert rel_err(y, ref.swiglu_forward(g64, u64)) <= TOL
    dg_ref, du_ref = ref.swiglu_backward(dy64, g64, u64)
    assert rel_err(dg, dg_ref) <= TOL
    assert rel_err(du, du_ref) <= TOL
    assert rel_err(s, y.astype(np.float64) + b64) <= 1e-7
    assert rel_err(acc, dy64 + b64) <= 1e-7
    np.testing.assert_array_equal(sc, b * np.float32(0.37))  # one f32 multiply


def test_f16_copies_from_producers(dev: Device) -> None:
    """rmsnorm_forward / swiglu_forward with y16 write the same f32 y as without, and y16 bitwise equal to the
    f16 pack of y (gpu/ops/half.py to_f16, what the tensor-core GEMMs read otherwise), with values past f16's
    range (inf) and below its normal range (subnormal) among them."""
    if "shader-f16" not in dev.features:
        pytest.skip("adapter without shader-f16")
    rng = np.random.default_rng(3)
    t, h = 3, 200
    x = (rng.standard_normal((t, h)) * 2.0).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    w[:2] = (1e6, 1e-6)  # normed values past f16's range, and below its normal range
    g, u = (rng.standard_normal(t * h).astype(np.float32) * 4.0 for _ in range(2))
    u[:3] = (1e5, 1e-6, -3e4)
    xb, wb, gb, ub = up(dev, x), up(dev, w), up(dev, g), up(dev, u)
    n = t * h
    for name, produce in (
        ("rmsnorm", lambda y, y16: rmsnorm_forward(dev, xb, wb, y, t, h, 1e-5, y16=y16)),
        ("swiglu", lambda y, y16: swiglu_forward(dev, gb, ub, y, n, y16=y16)),
    ):
        plain, y, y16, packed = dev.buffer(4 * n), dev.buffer(4 * n), dev.buffer(2 * n), dev.buffer(2 * n)
        produce(plain, None)
        produce(y, y16)
        assert to_f16(dev, y, packed, n)
        got, want = dev.read(y16, np.uint16, (n,)), dev.read(packed, np.uint16, (n,))
        np.testing.assert_array_equal(dev.read(y, np.float32, (n,)), dev.read(plain, np.float32, (n,)), err_msg=name)
        np.testing.assert_array_equal(got, want, err_msg=name)
        halves = got.view(np.float16)
        assert np.isinf(halves).any() and (np.abs(halves[halves != 0]) < 6.1e-5).any(), name


@pytest.mark.parametrize("gate", ["swiglu", "geglu"])
def test_gated_backward_f16_copies_equal_the_pack(dev: Device, gate: str) -> None:
    """The gated unit's backward, variant half: dg and du bitwise the plain kernel's, and their f16 copies bitwise
    to_f16's of them (the gate and up projections' tensor-core operands, read without a pack of their own)."""
    from gpu.ops.gated import gated_backward

    if "shader-f16" not in dev.features:
        pytest.skip("adapter without shader-f16")
    rng = np.random.default_rng(4)
    n = 4 * 301
    dy, g, u = (rng.standard_normal(n).astype(np.float32) * 3.0 for _ in range(3))
    dy[:2] = (1e5, 1e-6)  # gradients past f16's range and below its normal range
    dyb, gb = up(dev, dy), up(dev, g)
    u_plain, u_half = up(dev, u), up(dev, u)
    dg_plain, dg_half, dg16, du16 = dev.buffer(4 * n), dev.buffer(4 * n), dev.buffer(2 * n), dev.buffer(2 * n)
    gated_backward(dev, gate, dyb, gb, u_plain, dg_plain, n)
    gated_backward(dev, gate, dyb, gb, u_half, dg_half, n, dg16, du16)
    for plain, half, copy in ((dg_plain, dg_half, dg16), (u_plain, u_half, du16)):
        np.testing.assert_array_equal(dev.read(half, np.uint32, (n,)), dev.read(plain, np.uint32, (n,)))
        packed = dev.buffer(2 * n)
        assert to_f16(dev, half, packed, n)
        np.testing.assert_array_equal(dev.read(copy, np.uint16, (n,)), dev.read(packed, np.uint16, (n,)))


def test_scaled_f16_copy_and_unscale(dev: Device) -> None:
    """to_f16_scaled: the f16 copy of values far below f16's normal range (as dL/dlogits: ~1e-7) times a power of
    two sigma with max |x| sigma in [2^14, 2^15), each within f16's rounding (2^-11 relative) of x sigma down to
    2^-10 of the max; add_unscaled brings a product of it back exactly (a power of two), overwriting or adding."""
    if "shader-f16" not in dev.features:
        pytest.skip("adapter without shader-f16")
    rng = np.random.default_rng(11)
    n = 4 * 3001  # several absmax workgroups' strided shares
    x = (rng.standard_normal(n) * 1e-7).astype(np.float32)
    x[1234] = -9e-7  # the max is negative
    xb, x16, stats = up(dev, x), dev.buffer(2 * n), dev.buffer(8)
    to_f16_scaled(dev, xb, x16, stats, n)
    got = dev.read(x16, np.uint16, (n,)).view(np.float16).astype(np.float64)
    sigma = 2.0 ** round(np.log2(abs(got[1234]) / 9e-7))
    assert 2**14 <= np.abs(got).max() < 2**15, np.abs(got).max()
    assert np.abs(x * sigma).max() < 2**15
    big = np.abs(x) >= np.abs(x).max() * 2**-10
    np.testing.assert_allclose(got[big], (x * sigma)[big], rtol=2**-11)
    b = rng.standard_normal(n).astype(np.float32)
    prev = rng.standard_normal(n).astype(np.float32)
    bb, y, acc = up(dev, b), dev.buffer(4 * n), up(dev, prev)
    add_unscaled(dev, bb, stats, y, n, accumulate=False)
    add_unscaled(dev, bb, stats, acc, n, accumulate=True)
    np.testing.assert_array_equal(dev.read(y, np.float32, (n,)), b / np.float32(sigma))
    np.testing.assert_array_equal(dev.read(acc, np.float32, (n,)), prev + b / np.float32(sigma))


def test_attention_refuses_head_dim_without_kernel(dev: Device) -> None:
    t, h, d = 4, 2, 12
    bufs = [dev.buffer(4 * t * h * d) for _ in range(4)]
    with pytest.raises(ValueError, match="head_dim=12 has no kernel variant; gpu/registry.py HEAD_DIMS"):
        attention_forward(dev, *bufs, dev.buffer(4 * h * t), t, h, h, d)
