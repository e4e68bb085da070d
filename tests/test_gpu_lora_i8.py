"""LoRA's thin product t = x A^T from int8 codes (gpu/ops/lora_i8.py, lora_thin_i8.wgsl and its finish pass).

Tolerances: the kernel's sums are exact (i32) and t = s_x s_A sum in f32, so t is within 1e-6 (relative to its
max) of the float64 product of the same codes and scales; its f16 copy is f16(factor t) exactly. A's codes are the
twin's (model/int8.py quantize_i8 of hadamard_rows) where the rotation rounds alike: |diff| <= 1 on under 1 % of
them, the scales within 1e-6. Whole step: tests/test_gpu_student.py holds the int8 step with THIN_I8 on.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

from gpu.device import BufferView, Device
from gpu.ops.lora_i8 import LoraCodes, LoraGradCodes, lora_thin_i8, pick_chunk
from gpu.ops.lora_matmul import HalfCopy
from gpu.ops.matmul_i8 import Int8Matrix, int8_emulation
from model.int8 import hadamard_rows, pack_i8, quantize_i8, rotation_block
from model.lora_layout import LoraSlot
from tests.gpu_fixtures import tensor_core_device_or_skip
from tests.gpu_helpers import make_device, rel_err, up


@pytest.fixture(params=[pytest.param("any", marks=pytest.mark.gpu), pytest.param("dawn", marks=pytest.mark.tensorcore)])
def dev(request: pytest.FixtureRequest) -> Device:
    """lavapipe in CI (the kernel's sums in plain WGSL), and Dawn with subgroup matrices (the integer MMAs)."""
    return make_device() if request.param == "any" else tensor_core_device_or_skip()


def _integer_path(dev: Device):
    return nullcontext() if dev.subgroup_matrix else int8_emulation(dev)


def _codes(dev: Device, buf, off: int, rows: int, k: int) -> np.ndarray:
    words = dev.read(buf, np.uint32, (rows * k // 4,), offset=off)
    return words.view(np.int8).reshape(rows, k).astype(np.int64)


@pytest.mark.parametrize(
    ("m", "k", "r", "groups"),
    [(64, 64, 16, 1), (77, 576, 16, 3), (77, 4096, 16, 2), (130, 1024, 32, 2), (16, 128, 16, 4)],
)
def test_thin_product_matches_the_codes(dev: Device, m: int, k: int, r: int, groups: int) -> None:
    """t_g = s_x s_A x8 A8_g^T for column groups over one x (A's at scattered offsets of the codes buffer, t's at
    their own offsets), split over K where the shape asks for it; f16 copies times the factor."""
    rng = np.random.default_rng(m + k + groups)
    x8 = rng.integers(-127, 128, (m, k)).astype(np.int8)
    sx = (rng.random(m) * 0.02 + 1e-3).astype(np.float32)
    x = Int8Matrix(up(dev, pack_i8(x8), np.uint32), up(dev, sx), m, k, k, "x")
    # parameters: each adapter's A [r, k] (and a B slot the product never reads) between unrelated values
    a_f32 = [(rng.standard_normal((r, k)) * (1 + 3 * g)).astype(np.float32) for g in range(groups)]
    params = [rng.standard_normal(40).astype(np.float32)]
    slots, off = {}, 40
    for g, a in enumerate(a_f32):
        slots[(0, f"t{g}")] = LoraSlot(0, f"t{g}", k, 8, off, off + r * k)
        params += [a.reshape(-1), np.zeros(8 * r + 4, np.float32)]
        off += r * k + 8 * r + 4
    buf = up(dev, np.concatenate(params))
    keys = list(slots)[::-1]  # groups in an order other than the buffer's
    t_offs = [int(o) for o in rng.permutation(groups) * (m * r + 8)]
    t_buf = dev.buffer(4 * (groups * (m * r + 8) + 4))
    h_offs = tuple(int(o) for o in rng.permutation(groups) * (m * r + 16) + 4)
    h_buf = dev.buffer(2 * (groups * (m * r + 16) + 8))
    factor = 0.375
    with _integer_path(dev):
        codes = LoraCodes(dev, slots, r, rotation_block)
        codes.refresh(dev, buf)
        lora_thin_i8(dev, x, codes, keys, BufferView(t_buf, 0, t_buf.size), t_offs, HalfCopy(h_buf, h_offs, r, factor))
    t_all = dev.read(t_buf, np.float32, (t_buf.size // 4,))
    h_all = dev.read(h_buf, np.float16, (h_buf.size // 2,))
    for g, key in enumerate(keys):
        c_off, s_off = codes.offsets(key)
        a8 = _codes(dev, codes.codes, 16 * c_off, r, k)
        sa = dev.read(codes.scales, np.float32, (r,), offset=4 * s_off)
        twin_codes, twin_scales = quantize_i8(hadamard_rows(a_f32[int(key[1][1:])], rotation_block(k)), k)
        diff = np.abs(a8 - twin_codes)
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01
        assert rel_err(sa, twin_scales[:, 0]) < 1e-6
        ref = (x8.astype(np.int64) @ a8.T).astype(np.float64) * sx[:, None] * sa[None, :]
        t = t_all[t_offs[g] : t_offs[g] + m * r].reshape(m, r)
        assert rel_err(t, ref) < 1e-6
        h = h_all[h_offs[g] : h_offs[g] + m * r].reshape(m, r)
        np.testing.assert_array_equal(h, (t * np.float32(factor)).astype(np.float16))


def test_chunks_cover_k_in_whole_steps() -> None:
    """pick_chunk: whole steps of 64 codes, at least 4 a chunk, the chunks covering K and none empty."""
    for m, k in [(4096, 4096), (4096, 14336), (64, 4096), (77, 576), (16, 64)]:
        splits, chunk = pick_chunk(m, k)
        assert chunk % 64 == 0 and (splits - 1) * chunk < k <= splits * chunk
        assert splits == 1 or chunk >= 4 * 64


@pytest.mark.parametrize(("m", "d_out", "r"), [(77, 128, 16), (64, 640, 16), (40, 192, 32)])
def test_grad_codes_give_dt_from_dy_codes(dev: Device, m: int, d_out: int, r: int) -> None:
    """LoraGradCodes: each adapter's B / sW (0 where sW is 0) rounded per rank column, its scales times the LoRA
    scale, the twin's codes (|diff| <= 1 on under 1 %: the division's last ulp); dt = s dY B from dY sW's codes
    over them within 1e-6 of the float64 product of the same codes and scales."""
    rng = np.random.default_rng(d_out + r)
    s = 0.75
    bs = [(rng.standard_normal((d_out, r)) * (0.1 + g)).astype(np.float32) for g in range(2)]
    sws = [(rng.random(d_out) * 0.02 + 1e-3).astype(np.float32) for _ in range(2)]
    sws[1][::7] = 0.0  # rows of W that are all zero
    params, slots, off = [np.zeros(12, np.float32)], {}, 12
    for g, b in enumerate(bs):
        slots[(g, "o")] = LoraSlot(g, "o", 64, d_out, off, off + 64 * r)
        params += [rng.standard_normal(64 * r).astype(np.float32), b.reshape(-1)]
        off += 64 * r + d_out * r
    buf = up(dev, np.concatenate(params))
    y8 = rng.integers(-127, 128, (m, d_out)).astype(np.int8)
    sy = (rng.random(m) * 0.05 + 1e-3).astype(np.float32)
    dy = Int8Matrix(up(dev, pack_i8(y8), np.uint32), up(dev, sy), m, d_out, d_out, "dY")
    dt_buf = dev.buffer(4 * m * r)
    with _integer_path(dev):
        codes = LoraGradCodes(dev, slots, r, s, {key: up(dev, sw) for key, sw in zip(slots, sws, strict=True)})
        codes.refresh(dev, buf)
        for g, key in enumerate(slots):
            c_off, s_off = codes.offsets(key)
            b8 = _codes(dev, codes.codes, 16 * c_off, r, d_out)
            sb = dev.read(codes.scales, np.float32, (r,), offset=4 * s_off)
            safe = np.where(sws[g] > 0, sws[g], 1.0).astype(np.float32)
            twin_codes, twin_scales = quantize_i8(np.where(sws[g] > 0, bs[g].T / safe, 0.0).astype(np.float32), d_out)
            diff = np.abs(b8 - twin_codes)
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01
            assert rel_err(sb, s * twin_scales[:, 0]) < 1e-6
            lora_thin_i8(dev, dy, codes, [key], BufferView(dt_buf, 0, dt_buf.size), [0])
            dt = dev.read(dt_buf, np.float32, (m, r))
            ref = (y8.astype(np.int64) @ b8.T).astype(np.float64) * sy[:, None] * sb[None, :]
            assert rel_err(dt, ref) < 1e-6


@pytest.mark.parametrize(("m", "d_out", "r"), [(256, 128, 16), (512, 192, 16), (192, 64, 32), (1024, 64, 16)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_db_from_dy_codes(dev: Device, m: int, d_out: int, r: int, accumulate: bool) -> None:
    """lora_db_i8: u = sdY t rounded per column over chunks of rows (row_chunk: 256 or fewer), the twin's codes
    (|diff| <= 1 on under 1 %: the division's last ulp) and scales (1e-6); dB = s / sW dY^T u over the chunks within
    1e-6 of the float64 sums of the same codes and scales (0 on rows where sW is 0), added to what dB held with
    accumulate; and within 3e-2 of the exact s dY^T t of the dequantized dY (u's 8-bit rounding)."""
    from gpu.ops.lora_db_i8 import _codes as u_buffers
    from gpu.ops.lora_db_i8 import lora_db_i8, row_chunk

    rng = np.random.default_rng(m + d_out + r)
    s = 0.5
    y8 = rng.integers(-127, 128, (m, d_out)).astype(np.int8)
    sy = (rng.random(m) * 0.05 + 1e-3).astype(np.float32)
    sy[5] = 0.0  # an all-zero row of dY
    t = (rng.standard_normal((m, r)) * np.linspace(0.2, 3.0, m)[:, None]).astype(np.float32)
    sw = (rng.random(d_out) * 0.02 + 1e-3).astype(np.float32)
    sw[::9] = 0.0
    before = rng.standard_normal((d_out, r)).astype(np.float32)
    dy = Int8Matrix(up(dev, pack_i8(y8), np.uint32), up(dev, sy), m, d_out, d_out, "dY")
    db = up(dev, np.concatenate([np.zeros(4, np.float32), before.reshape(-1)]))
    with _integer_path(dev):
        lora_db_i8(dev, dy, up(dev, t), r, up(dev, np.concatenate([np.ones(3, np.float32), sw])), 3, s, db, 4,
                   accumulate=accumulate)  # fmt: skip
    chunk = row_chunk(m)
    q_buf, cs_buf = u_buffers[dev]
    u8 = _codes(dev, q_buf, 0, r, m)
    cs = dev.read(cs_buf, np.float32, (m // chunk, r))
    twin_codes, twin_scales = quantize_i8((sy[:, None] * t).T.copy(), chunk)
    diff = np.abs(u8 - twin_codes)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert rel_err(cs, twin_scales.T) < 1e-6
    got = dev.read(db, np.float32, (d_out, r), offset=16)
    sums = np.stack([y8[z : z + chunk].T.astype(np.int64) @ u8[:, z : z + chunk].T for z in range(0, m, chunk)])
    ref = np.einsum("zon,zn->on", sums.astype(np.float64), cs.astype(np.float64))
    ref *= np.where(sw > 0, s / np.where(sw > 0, sw, 1.0), 0.0)[:, None]
    ref += before if accumulate else 0.0
    assert rel_err(got, ref) < 1e-6
    exact = s * (y8.astype(np.float64) * sy[:, None]).T @ t / np.where(sw > 0, sw, np.inf)[:, None]
    assert rel_err(got - (before if accumulate else 0.0), exact) < 3e-2


@pytest.mark.parametrize(
    ("m", "k", "r", "adapters", "rot"),
    [(256, 128, 16, 1, 0), (512, 256, 16, 3, 128), (192, 64, 32, 2, 32), (1024, 128, 16, 2, 0), (256, 192, 16, 1, 64)],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_da_from_x_codes(dev: Device, m: int, k: int, r: int, adapters: int, rot: int, accumulate: bool) -> None:
    """lora_da_i8: u = sx [dt_1 .. dt_n] (the dt's at aligned slots of one buffer) rounded per column over chunks of
    rows, the twin's codes (|diff| <= 1 on under 1 %) and scales (1e-6); each dA_j = (sum over the chunks of u_j's
    codes times x's, times their scales) R^T within 1e-5 of the float64 sums of the same codes and scales turned
    back by model/int8.py hadamard_rows (R: rotation rot; 0: none), added to what dA_j held with accumulate, the
    values beside each dA untouched; and within 3e-2 of the exact dt_j^T x of the dequantized x (u's rounding)."""
    from gpu.ops.lora_da_i8 import lora_da_i8
    from gpu.ops.lora_db_i8 import _codes as u_buffers
    from gpu.ops.lora_db_i8 import row_chunk
    from model.lora_layout import aligned_floats

    rng = np.random.default_rng(m + k + r + adapters + rot)
    x8 = rng.integers(-127, 128, (m, k)).astype(np.int8)
    sx = (rng.random(m) * 0.05 + 1e-3).astype(np.float32)
    sx[3] = 0.0  # an all-zero row of x
    x = Int8Matrix(up(dev, pack_i8(x8), np.uint32), up(dev, sx), m, k, k, "x")
    dts = [(rng.standard_normal((m, r)) * np.linspace(0.2, 3.0, m)[:, None] * (1 + g)).astype(np.float32)
           for g in range(adapters)]  # fmt: skip
    slot = aligned_floats(m * r)
    dt_buf = up(dev, np.concatenate([np.pad(dt.reshape(-1), (0, slot - m * r)) for dt in dts]))
    dt_views = [BufferView(dt_buf, 4 * g * slot, 4 * m * r) for g in range(adapters)]
    # the dA's between other values of one gradient buffer (aligned, as a LoRA layout places them)
    gap = aligned_floats(r * k) + 64
    before = rng.standard_normal(gap * adapters + 64).astype(np.float32)
    grads = up(dev, before)
    da_views = [BufferView(grads, 4 * (64 + g * gap), 4 * r * k) for g in range(adapters)]
    with _integer_path(dev):
        lora_da_i8(dev, x, dt_views, da_views, r, rot, accumulate=accumulate)
    chunk, n = row_chunk(m), r * adapters
    q_buf, cs_buf = u_buffers[dev]
    u8 = _codes(dev, q_buf, 0, n, m)
    cs = dev.read(cs_buf, np.float32, (m // chunk, n))
    twin_codes, twin_scales = quantize_i8((sx[:, None] * np.concatenate(dts, axis=1)).T.copy(), chunk)
    diff = np.abs(u8 - twin_codes)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert rel_err(cs, twin_scales.T) < 1e-6
    got_all = dev.read(grads, np.float32, (before.size,))
    sums = np.stack([u8[:, z : z + chunk].astype(np.int64) @ x8[z : z + chunk] for z in range(0, m, chunk)])
    rotated = np.einsum("znk,zn->nk", sums.astype(np.float64), cs.astype(np.float64))
    x_rows = (x8.astype(np.float64) * sx[:, None]).astype(np.float32)
    x_exact = hadamard_rows(x_rows, rot, back=True) if rot else x_rows.astype(np.float64)
    untouched = np.ones(before.size, bool)
    for g in range(adapters):
        at = 64 + g * gap
        got = got_all[at : at + r * k].reshape(r, k)
        untouched[at : at + r * k] = False
        ref = rotated[g * r : (g + 1) * r]
        ref = hadamard_rows(ref.astype(np.float32), rot, back=True) if rot else ref
        held = before[at : at + r * k].reshape(r, k)
        assert rel_err(got - (held if accumulate else 0.0), ref) < 1e-5
        assert rel_err(got - (held if accumulate else 0.0), dts[g].T.astype(np.float64) @ x_exact) < 3e-2
    assert np.array_equal(got_all[untouched], before[untouched])
