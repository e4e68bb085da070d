"""model.quant: bit-exact parity with gguf-py, K-quant round trips, error ordering, edge rows, errors."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from model import quant

LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
KQUANTS = (Q.Q4_K, Q.Q6_K)
QUANTS = LEGACY + KQUANTS


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def _round_trip(x: np.ndarray, qtype: Q) -> np.ndarray:
    return quant.dequantize(quant.quantize(x, qtype), qtype, x.shape)


def _gaussian(rows: int, row_len: int, seed: int) -> np.ndarray:
    """Gaussian rows with per-row scales spanning a few decades (exercises f16 scale rounding)."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 1, (rows, 1))
    return (rng.standard_normal((rows, row_len)) * scale).astype(np.float32)


def _random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with every f16 field replaced by a finite value of either sign."""
    c = quant.codec(qtype)
    blocks = rng.integers(0, 256, (n_blocks, c.type_size), dtype=np.uint8)
    for off in c.f16_offsets:
        vals = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-6, 2, n_blocks)).astype(np.float16)
        blocks[:, off : off + 2] = vals.reshape(-1, 1).view(np.uint8)
    if qtype == Q.F32:
        blocks = rng.standard_normal((n_blocks, 1)).astype(np.float32).view(np.uint8)
    return blocks


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(smollm2_path))


@pytest.fixture(scope="module")
def real_weights(smollm2: gguf.GGUFReader) -> np.ndarray:
    """A few dequantized ffn_down weights (row length 1536 = 6 x 256), stacked."""
    by_name = {t.name: t for t in smollm2.tensors}
    mats = []
    for name in ("blk.0.ffn_down.weight", "blk.14.ffn_down.weight", "blk.29.ffn_down.weight"):
        t = by_name[name]
        mats.append(quant.dequantize(t.data, t.tensor_type, tuple(int(v) for v in reversed(t.shape))))
    return np.concatenate(mats)


def test_supported_types_and_sizes_match_ggml() -> None:
    assert set(quant.SUPPORTED_TYPES) == {Q.F32, Q.F16, *QUANTS}
    for qtype in quant.SUPPORTED_TYPES:
        assert (quant.block_size(qtype), quant.type_size(qtype)) == GGML_QUANT_SIZES[qtype]
        assert quant.block_size(int(qtype)) == GGML_QUANT_SIZES[qtype][0]  # plain int ids work too
    assert quant.row_bytes(Q.Q4_K, 1536) == 6 * 144
    assert quant.row_bytes(Q.Q4_0, 576) == 18 * 18


@pytest.mark.parametrize("qtype", (Q.F32, Q.F16, *QUANTS), ids=lambda q: q.name)
def test_decode_random_bytes_bit_exact(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    bs = quant.block_size(qtype)
    row_len = 512 if bs > 1 else 96
    rows = 24
    blocks = _random_blocks(qtype, rows * row_len // bs, rng)
    data = blocks.reshape(rows, -1)
    ours = quant.dequantize(data, qtype, (rows, row_len))
    theirs = gq.dequantize(data, qtype).reshape(rows, row_len)
    assert ours.dtype == np.float32 and ours.shape == (rows, row_len)
    assert np.isfinite(ours).all()
    assert np.array_equal(ours, theirs)
    # flat input and a 3-D logical shape decode to the same values
    flat = quant.dequantize(data.reshape(-1), qtype, (2, rows // 2, row_len))
    assert np.array_equal(flat.reshape(rows, row_len), ours)


def test_decode_every_smollm2_tensor_bit_exact(smollm2: gguf.GGUFReader) -> None:
    seen: set[Q] = set()
    compared = 0
    for t in smollm2.tensors:
        shape = tuple(int(v) for v in reversed(t.shape))  # GGUFReader reports ggml order (ne[0] first)
        ours = quant.dequantize(t.data, t.tensor_type, shape)
        theirs = np.asarray(gq.dequantize(t.data, t.tensor_type))
        assert ours.shape == shape and theirs.shape == shape, t.name
        assert np.array_equal(ours, theirs), t.name
        seen.add(Q(t.tensor_type))
        compared += 1
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= seen
    assert compared == len(smollm2.tensors) > 200


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_legacy_encoders_match_gguf_bytes(qtype: Q) -> None:
    x = _gaussian(48, 256, seed=int(qtype))
    rng = np.random.default_rng(7)
    x[0] = 0.0  # all-zero row
    x[1] = 0.75  # constant row
    x[2] = rng.integers(-8, 8, 256) * 0.125  # values on the grid: rounding ties
    x[3, :32] = -x[3, :32].max()  # block whose max-abs value is negative and repeated
    x[4] = rng.integers(-100, 100, 256) + 0.5  # with 127 in each block, Q8_0 sees exact .5 ties
    x[4, ::32] = 127.0
    ours = quant.quantize(x, qtype)
    theirs = gq.quantize(x, qtype)
    assert ours.dtype == np.uint8 and ours.shape == (48, quant.row_bytes(qtype, 256))
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_kquant_round_trip_through_gguf(qtype: Q) -> None:
    x = _gaussian(32, 1024, seed=int(qtype))
    data = quant.quantize(x, qtype)
    assert data.shape == (32, quant.row_bytes(qtype, 1024))
    ours = quant.dequantize(data, qtype, x.shape)
    theirs = np.asarray(gq.dequantize(data, qtype)).reshape(x.shape)
    assert np.array_equal(ours, theirs)
    # per-row relative error: 4-bit affine ~ 0.07 of the row's std on Gaussians, 6-bit ~ 0.02
    rel = np.sqrt(np.mean((ours - x) ** 2, axis=1)) / x.std(axis=1)
    assert rel.max() < (0.09 if qtype == Q.Q4_K else 0.025), rel.max()


# --- Scalar transliteration of llama.cpp's reference K-quant encoders (ggml-quants.c), used as an oracle:
# one f32 operation at a time in C's order, so our vectorised encoders must reproduce its bytes exactly.
F = np.float32


def _nearest_int(v: np.float32) -> int:
    """ggml nearest_int: add 1.5*2^23 and read the mantissa bits (round half to even)."""
    bits = np.array([F(v) + F(12582912.0)], dtype=np.float32).view(np.int32)[0]
    return int((bits & 0x007FFFFF) - 0x00400000)


def _ref_make_qkx2(x: np.ndarray, w: list[np.float32]) -> tuple[list[int], np.float32, np.float32]:
    nmax, rmin, rdelta, nstep = 15, F(-1.0), F(0.1), 20
    lo, hi, sum_w = x[0], x[0], w[0]
    sum_x = sum_w * x[0]
    for i in range(1, len(x)):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if lo > 0:
        lo = F(0)
    if hi == lo:
        return [0] * len(x), F(0), -lo
    iscale = F(nmax) / (hi - lo)
    scale = F(1) / iscale
    levels = [max(0, min(nmax, _nearest_int(iscale * (v - lo)))) for v in x]
    best = F(0)
    for i, v in enumerate(x):
        diff = scale * F(levels[i]) + lo - v
        best += w[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + F(nmax)) / (hi - lo)
        aux = [max(0, min(nmax, _nearest_int(iscale * (v - lo)))) for v in x]
        sum_l = sum_l2 = sum_xl = F(0)
        for i, v in enumerate(x):
            sum_l += w[i] * F(aux[i])
            sum_l2 += w[i] * F(aux[i]) * F(aux[i])
            sum_xl += w[i] * F(aux[i]) * v
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min, this_scale = F(0), sum_xl / sum_l2
            err = F(0)
            for i, v in enumerate(x):
                diff = this_scale * F(aux[i]) + this_min - v
                err += w[i] * (diff * diff)
            if err < best:
                levels, best, scale, lo = aux, err, this_scale, this_min
    return levels, scale, -lo


def _ref_q4_k(x: np.ndarray) -> bytes:
    """quantize_row_q4_K_ref for one 256-value block."""
    levels, scales, mins = [], [], []
    for j in range(8):
        xs = x[32 * j : 32 * j + 32]
        sum_x2 = F(0)
        for v in xs:
            sum_x2 += v * v
        av_x = np.sqrt(sum_x2 / F(32))
        lv, sc, mn = _ref_make_qkx2(xs, [av_x + abs(v) for v in xs])
        levels += lv
        scales.append(sc)
        mins.append(mn)
    max_scale, max_min = max([F(0), *scales]), max([F(0), *mins])
    inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
    inv_min = F(63) / max_min if max_min > 0 else F(0)
    ls = [min(63, _nearest_int(inv_scale * s) & 0xFF) for s in scales]
    lm = [min(63, _nearest_int(inv_min * m) & 0xFF) for m in mins]
    packed = [0] * 12
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            packed[j - 4] |= (ls[j] >> 4) << 6
            packed[j] |= (lm[j] >> 4) << 6
    d, dmin = np.float16(max_scale / F(63)), np.float16(max_min / F(63))
    for j in range(8):
        dj = F(d) * F(ls[j])
        if dj == 0:
            continue
        dm = F(dmin) * F(lm[j])
        for i in range(32):
            levels[32 * j + i] = max(0, min(15, _nearest_int((x[32 * j + i] + dm) / dj)))
    qs = [levels[64 * c + i] | (levels[64 * c + 32 + i] << 4) for c in range(4) for i in range(32)]
    return d.tobytes() + dmin.tobytes() + bytes(packed) + bytes(qs)


def _ref_make_qx(x: np.ndarray, nmax: int = 32) -> tuple[list[int], np.float32]:
    amax, xmax = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, xmax = abs(v), v
    if amax < F(1e-15):
        return [0] * len(x), F(0)

    def fit(iscale: np.float32) -> tuple[list[int], np.float32, np.float32]:
        lv = [max(-nmax, min(nmax - 1, _nearest_int(iscale * v))) for v in x]
        sumlx = suml2 = F(0)
        for v, q in zip(x, lv, strict=True):
            w = v * v
            sumlx += w * v * F(q)
            suml2 += w * F(q) * F(q)
        return lv, sumlx, suml2

    levels, sumlx, suml2 = fit(F(-nmax) / xmax)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step:
            lv, sumlx, suml2 = fit(-(F(nmax) + F(0.1) * F(step)) / xmax)
            if suml2 > 0 and sumlx * sumlx > best * suml2:
                levels, scale = lv, sumlx / suml2
                best = scale * sumlx
    return [q + nmax for q in levels], scale


def _ref_q6_k(x: np.ndarray) -> bytes:
    """quantize_row_q6_K_ref for one 256-value block."""
    levels, scales = [], []
    for ib in range(16):
        lv, sc = _ref_make_qx(x[16 * ib : 16 * ib + 16])
        levels += lv
        scales.append(sc)
    max_scale, max_abs = F(0), F(0)
    for sc in scales:
        if abs(sc) > max_abs:
            max_abs, max_scale = abs(sc), sc
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(-128) / max_scale
    d = np.float16(F(1) / iscale)
    sc8 = [min(127, _nearest_int(iscale * sc)) for sc in scales]
    for j in range(16):
        dj = F(d) * F(sc8[j])
        if dj == 0:
            continue
        for i in range(16):
            levels[16 * j + i] = max(-32, min(31, _nearest_int(x[16 * j + i] / dj))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h in range(2):
        q = levels[128 * h : 128 * h + 128]
        for i in range(32):
            ql[64 * h + i] = (q[i] & 0xF) | ((q[i + 64] & 0xF) << 4)
            ql[64 * h + 32 + i] = (q[i + 32] & 0xF) | ((q[i + 96] & 0xF) << 4)
            qh[32 * h + i] = sum((q[i + 32 * k] >> 4) << (2 * k) for k in range(4))
    return bytes(ql) + bytes(qh) + np.array(sc8, dtype=np.int8).tobytes() + d.tobytes()


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_kquant_encoders_match_scalar_llama_cpp_reference(qtype: Q) -> None:
    rng = np.random.default_rng(21)
    gauss = (rng.standard_normal(768) * 0.05).astype(np.float32)
    edge = _edge_rows(256).reshape(-1)  # zeros, constant, negative constant, one huge outlier
    mixed = rng.standard_normal(256).astype(np.float32)
    mixed[:32], mixed[32:64], mixed[64:96] = 0.0, -1.5, np.abs(mixed[64:96])  # flat / one-signed sub-blocks
    mixed[200:216] = 0.0
    skewed = rng.lognormal(0.0, 1.0, 48 * 256)  # skewed: the last search steps sometimes win here
    heavy = rng.standard_t(3, 8 * 256)
    x = np.concatenate([gauss, edge, mixed, skewed, heavy]).astype(np.float32).reshape(-1, 256)
    ref = _ref_q4_k if qtype == Q.Q4_K else _ref_q6_k
    ours = quant.quantize(x, qtype)
    with np.errstate(over="ignore"):
        for i, block in enumerate(x):
            assert ours[i].tobytes() == ref(block), f"{qtype.name} block {i}"


def _check_order(x: np.ndarray) -> dict[str, float]:
    errs = {q.name: _rmse(_round_trip(x, q), x) for q in QUANTS}
    assert errs["Q4_K"] <= errs["Q4_0"], errs
    assert errs["Q6_K"] <= errs["Q5_0"], errs
    assert errs["Q8_0"] < errs["Q6_K"] < errs["Q4_K"], errs
    return errs


def test_rmse_order_gaussian() -> None:
    rng = np.random.default_rng(3)
    errs = _check_order(rng.standard_normal((64, 1536)).astype(np.float32))
    assert 0.03 < errs["Q4_K"] < 0.09 and errs["Q6_K"] < 0.025, errs


def test_rmse_order_real_weights(real_weights: np.ndarray) -> None:
    assert real_weights.shape[1] == 1536
    errs = _check_order(real_weights)
    assert errs["Q4_K"] < 0.05 * float(real_weights.std()), errs


EDGE_ROWS = ("zeros", "constant", "negative_constant", "outlier")


def _edge_rows(row_len: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    x = np.zeros((4, row_len), dtype=np.float32)
    x[1] = 3.0
    x[2] = -0.02
    x[3] = rng.standard_normal(row_len)
    x[3, 77] = 1.0e4  # single huge outlier, still within every type's f16 scale range
    return x


@pytest.mark.parametrize("qtype", QUANTS, ids=lambda q: q.name)
def test_encoders_edge_rows_finite_and_deterministic(qtype: Q) -> None:
    x = _edge_rows(512)
    data = quant.quantize(x, qtype)
    assert np.array_equal(data, quant.quantize(x.copy(), qtype))  # deterministic
    # rows are independent: encoding one row alone gives the same bytes
    for i in range(len(x)):
        assert np.array_equal(quant.quantize(x[i : i + 1], qtype)[0], data[i]), EDGE_ROWS[i]
    y = quant.dequantize(data, qtype, x.shape)
    assert np.isfinite(y).all()
    assert np.array_equal(y[0], np.zeros(512, np.float32))
    np.testing.assert_allclose(y[1], 3.0, rtol=1e-3)
    np.testing.assert_allclose(y[2], -0.02, rtol=1e-3)
    assert abs(y[3, 77] / 1.0e4 - 1) < 1e-3


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_kquants_survive_outliers_beyond_legacy_range(qtype: Q) -> None:
    x = _edge_rows(512)
    x[3, 77] = 1.0e6  # Q4_0's f16 scale (1e6 / 8) would overflow; K-quant super-block scales do not
    y = _round_trip(x, qtype)
    assert np.isfinite(y).all()
    assert abs(y[3, 77] / 1.0e6 - 1) < 1e-3
    with pytest.raises(quant.QuantError, match="Q4_0.*overflows f16"):
        quant.quantize(x, Q.Q4_0)


def test_errors_name_type_and_sizes() -> None:
    assert issubclass(quant.QuantError, ValueError)
    with pytest.raises(quant.QuantError, match="Q2_K is not supported"):
        quant.block_size(Q.Q2_K)
    with pytest.raises(quant.QuantError, match="unknown type id 9999"):
        quant.type_size(9999)
    with pytest.raises(quant.QuantError, match=r"Q4_K: row length 576 .* block size 256"):
        quant.quantize(np.zeros((2, 576), np.float32), Q.Q4_K)
    with pytest.raises(quant.QuantError, match=r"Q8_0: 100 bytes .* \(2, 64\) .* 136 bytes"):
        quant.dequantize(np.zeros(100, np.uint8), Q.Q8_0, (2, 64))
    with pytest.raises(quant.QuantError, match="NaN"):
        quant.quantize(np.full((1, 32), np.nan, np.float32), Q.Q8_0)


def test_choose_student_type_and_requantize() -> None:
    assert quant.choose_student_type(1536) == Q.Q4_K
    assert quant.choose_student_type(576) == Q.Q4_0
    assert quant.choose_student_type(576, preferred=Q.Q6_K, fallback=Q.Q8_0) == Q.Q8_0
    with pytest.raises(quant.QuantError, match="row length 100"):
        quant.choose_student_type(100)
    x = _gaussian(4, 1536, seed=5)
    qtype, data = quant.requantize(x)
    assert qtype == Q.Q4_K and np.array_equal(data, quant.quantize(x, Q.Q4_K))
    qtype, data = quant.requantize(x[:, :576], fallback=int(Q.Q5_0))
    assert qtype == Q.Q5_0 and data.shape == (4, quant.row_bytes(Q.Q5_0, 576))


@pytest.mark.parametrize("qtype", (Q.F32, Q.F16), ids=lambda q: q.name)
def test_float_pass_through(qtype: Q) -> None:
    x = _gaussian(3, 40, seed=1)
    data = quant.quantize(x, qtype)
    assert data.dtype == np.uint8 and data.shape == (3, 40 * quant.type_size(qtype))
    expect = x if qtype == Q.F32 else x.astype(np.float16).astype(np.float32)
    assert np.array_equal(quant.dequantize(data, qtype, x.shape), expect)


def test_kquant_encode_speed() -> None:
    x = np.random.default_rng(0).standard_normal((576, 1536)).astype(np.float32)
    for qtype in KQUANTS:
        t0 = time.perf_counter()
        quant.quantize(x, qtype)
        elapsed = time.perf_counter() - t0
        assert elapsed < 5.0, (qtype.name, elapsed)  # ~0.1 s measured; generous for a shared 2-core box
