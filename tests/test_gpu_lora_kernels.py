"""LoRA's own kernels (gpu/ops/lora_matmul.py: lora_gemm + lora_reduce) and the ops on them (gpu/ops/lora.py)
vs a float64 numpy reference: relative error (max abs err / max abs ref) <= 1e-4 (f32 sums of <= a few
hundred terms), at awkward shapes (T not a multiple of the split, d not a multiple of 4, r = 1, 3, 16, 32),
accumulate on and off, alpha != 1, and bitwise equal results from two calls."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.codegen_lora import STREAM_UNROLLS
from gpu.device import Device, DeviceError
from gpu.ops.lora import lora_backward, lora_forward
from gpu.ops.lora_matmul import MIN_CHUNK, fast_path, lora_matmul, pick_splits
from gpu.ops.strided_matmul import Operand, row_major, transposed
from model import reference as ref
from tests.gpu_helpers import make_device, rel_err, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4
# the bandwidth kernel each thin product takes when its operands read as vec4s (gpu/ops/lora_matmul.py fast_path)
_FAST = {"x_wT": "rows_kfast", "dy_w": "rows", "dyT_t": "stream", "xT_t_into_rd": "stream"}


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


@pytest.fixture(autouse=True)
def fast_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bandwidth kernels on (they are opt-in): every product whose operands read as vec4s takes them here."""
    from gpu.ops import lora_matmul as lm

    monkeypatch.setattr(lm, "FAST_PATHS", True)


def _product(kind: str, t: int, d: int, r: int) -> tuple[str, str, int, int, int, bool]:
    """(A operand, B operand, m, n, k, store transposed) of LoRA's products on x/dy [t, d], w [r, d] or [d, r],
    thin [t, r]: thin = x w^T, thin = dy w (w [d, r]), dW [d, r] = dy^T thin, dA^T = x^T thin stored into [r, d],
    y = thin w^T (w [d, r]), y = thin w (w [r, d])."""
    return {
        "x_wT": ("big", "w_rd^T", t, r, d, False),
        "dy_w": ("big", "w_dr", t, r, d, False),
        "dyT_t": ("big^T", "thin", d, r, t, False),
        "xT_t_into_rd": ("big^T", "thin", d, r, t, True),
        "t_wT": ("thin", "w_dr^T", t, d, r, False),
        "t_w": ("thin", "w_rd", t, d, r, False),
    }[kind]


@pytest.mark.parametrize(
    "kind,t,d,r,splits",
    [
        ("x_wT", 37, 259, 3, 3),  # d split in 3 chunks (the last shorter), d odd
        ("x_wT", 70, 130, 16, None),
        ("dy_w", 65, 203, 32, 2),
        ("dy_w", 5, 9, 1, None),
        ("dyT_t", 300, 130, 16, None),  # T = 300 tokens: 3 splits of 128, the last 44
        ("dyT_t", 171, 67, 1, 5),
        ("xT_t_into_rd", 300, 259, 3, None),
        ("xT_t_into_rd", 90, 66, 32, 4),
        ("t_wT", 70, 130, 16, None),
        ("t_wT", 33, 67, 3, None),
        ("t_w", 65, 259, 32, None),
        ("t_w", 19, 5, 1, None),
        # the bandwidth paths (operands that read as vec4s): partial row / column blocks, a partial block of 16
        # columns (r = 20), split and not, and a short last split
        ("x_wT", 300, 132, 16, None),
        ("x_wT", 70, 260, 20, 3),
        ("dy_w", 300, 132, 32, None),
        ("dy_w", 129, 68, 20, 1),
        ("dyT_t", 300, 132, 16, None),
        ("dyT_t", 301, 68, 20, 5),
        ("xT_t_into_rd", 300, 260, 32, None),
        ("xT_t_into_rd", 77, 4, 16, 1),
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_lora_matmul(dev: Device, kind: str, t: int, d: int, r: int, splits: int | None, accumulate: bool) -> None:
    """Each product within TOL of float64 on the path its operands take (lora_gemm, or a bandwidth kernel when
    d and r are multiples of 4: which one is asserted, so a case cannot fall back unnoticed)."""
    rng = np.random.default_rng(t * 7 + d + r)
    a_kind, b_kind, m, n, k, store_t = _product(kind, t, d, r)
    big = rng.standard_normal((t, d)).astype(np.float32)
    thin = rng.standard_normal((t, r)).astype(np.float32)
    w_rd = rng.standard_normal((r, d)).astype(np.float32)
    w_dr = rng.standard_normal((d, r)).astype(np.float32)
    mats = {
        "big": (big, row_major, d),
        "big^T": (big, transposed, d),
        "thin": (thin, row_major, r),
        "w_rd": (w_rd, row_major, d),
        "w_rd^T": (w_rd, transposed, d),
        "w_dr": (w_dr, row_major, r),
        "w_dr^T": (w_dr, transposed, r),
    }
    (a_np, a_view, a_cols), (b_np, b_view, b_cols) = mats[a_kind], mats[b_kind]
    a64 = a_np.astype(np.float64) if a_view is row_major else a_np.T.astype(np.float64)
    b64 = b_np.astype(np.float64) if b_view is row_major else b_np.T.astype(np.float64)
    assert a64.shape == (m, k) and b64.shape == (k, n)
    c0 = rng.standard_normal((n, m) if store_t else (m, n)).astype(np.float32)
    alpha = 0.37
    ab, bb = up(dev, a_np), up(dev, b_np)
    strides = {"csm": 1, "csn": m} if store_t else {}

    aligned = d % 4 == 0 and r % 4 == 0 and kind in _FAST
    assert fast_path(a_view(ab, a_cols), b_view(bb, b_cols), m, n, k) == (_FAST[kind] if aligned else "")

    def run() -> list[np.ndarray]:
        c = up(dev, c0)
        lora_matmul(
            dev, a_view(ab, a_cols), b_view(bb, b_cols), c, m, n, k, alpha=alpha, accumulate=accumulate,
            splits=splits, **strides,
        )  # fmt: skip
        return [dev.read(c, np.float32, c0.shape)]

    (got,) = twice(run)
    want = alpha * (a64 @ b64)
    if store_t:
        want = want.T
    if accumulate:
        want = want + c0
    assert rel_err(got, want) <= TOL


def test_splits_cover_the_long_reductions() -> None:
    """The shapes below split their reductions (so the tests above exercise lora_reduce), chunks of whole
    staged steps whose count covers k exactly."""
    assert pick_splits(130, 16, 300, 16)[0] == 3
    assert pick_splits(37, 3, 259, 16)[0] == 3
    assert pick_splits(4096, 16, 5632, 16) == (16, 352)
    assert pick_splits(4096, 5632, 16, 64) == (1, 16)
    for m, n, k in ((2048, 16, 4096), (256, 16, 4096), (5632, 16, 4096), (4096, 16, 576), (576, 16, 4096)):
        s, chunk = pick_splits(m, n, k, 16)
        assert chunk % 32 == 0 and chunk >= MIN_CHUNK and (s - 1) * chunk < k <= s * chunk
        assert s * m * n * 4 <= 32 << 20


@pytest.mark.parametrize(
    "t,d_in,d_out,r",
    [(300, 259, 130, 16), (171, 66, 203, 3), (129, 40, 24, 1), (257, 136, 72, 32), (1, 40, 24, 4), (33, 20, 50, 8)],
)
@pytest.mark.parametrize("accumulate_grads", [False, True])
def test_lora_forward_backward(dev: Device, t: int, d_in: int, d_out: int, r: int, accumulate_grads: bool) -> None:
    """The ops at shapes where dA, dB (over T) and t, dt (over d) split, gradients accumulated or not."""
    rng = np.random.default_rng(t + d_in + r)
    x = rng.standard_normal((t, d_in)).astype(np.float32)
    a = (rng.standard_normal((r, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = rng.standard_normal((d_out, r)).astype(np.float32)
    base = rng.standard_normal((t, d_out)).astype(np.float32)
    dy = rng.standard_normal((t, d_out)).astype(np.float32)
    dx0 = rng.standard_normal((t, d_in)).astype(np.float32)
    da0 = rng.standard_normal(a.shape).astype(np.float32)
    db0 = rng.standard_normal(b.shape).astype(np.float32)
    s = 1.75
    xb, ab, bb, dyb = up(dev, x), up(dev, a), up(dev, b), up(dev, dy)

    def run() -> list[np.ndarray]:
        tb, y, dx, dt = dev.buffer(4 * t * r), up(dev, base), up(dev, dx0), dev.buffer(4 * t * r)
        da, db = up(dev, da0), up(dev, db0)
        lora_forward(dev, xb, ab, bb, tb, y, t, d_in, d_out, r, s)
        lora_backward(dev, dyb, xb, ab, bb, tb, da, db, dx, dt, t, d_in, d_out, r, s, accumulate_grads=accumulate_grads)
        shapes = ((t, d_out), (t, d_in), a.shape, b.shape)
        return [dev.read(buf, np.float32, sh) for buf, sh in zip((y, dx, da, db), shapes, strict=True)]

    y, dx, da, db = twice(run)
    x64, a64, b64, dy64 = (v.astype(np.float64) for v in (x, a, b, dy))
    assert rel_err(y, base + ref.lora_forward(x64, a64, b64, s)) <= TOL
    dx_ref, da_ref, db_ref = ref.lora_backward(dy64, x64, a64, b64, s)
    assert rel_err(dx, dx0 + dx_ref) <= TOL
    if accumulate_grads:
        da_ref, db_ref = da_ref + da0, db_ref + db0
    assert rel_err(da, da_ref) <= TOL
    assert rel_err(db, db_ref) <= TOL


@pytest.mark.parametrize("t,d_out", [(300, 130), (300, 600), (513, 40), (1, 24), (256, 256)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_lora_dual_matches_reference(dev: Device, t: int, d_out: int, accumulate: bool) -> None:
    """lora_dual (dB and dt in one pass over dY, rank 16): several column tiles and row chunks, partial ones, one
    token; dB accumulated or not, dt overwritten; bitwise repeatable; and lora_backward through it (DUAL) as close
    to the float64 reference as through lora_matmul."""
    from gpu.ops import lora_dual

    r, s = 16, 1.75
    rng = np.random.default_rng(t + d_out)
    dy, tt = rng.standard_normal((t, d_out)).astype(np.float32), rng.standard_normal((t, r)).astype(np.float32)
    b, db0 = (rng.standard_normal((d_out, r)).astype(np.float32) for _ in range(2))
    dyb, tb, bb = up(dev, dy), up(dev, tt), up(dev, b)

    def run() -> list[np.ndarray]:
        dt, db = up(dev, np.full((t, r), np.nan, np.float32)), up(dev, db0)
        lora_dual.lora_dual(dev, dyb, tb, bb, dt, db, t, d_out, s, accumulate=accumulate)
        return [dev.read(dt, np.float32, (t, r)), dev.read(db, np.float32, (d_out, r))]

    dt, db = twice(run)
    dy64 = dy.astype(np.float64)
    assert rel_err(dt, s * dy64 @ b) <= TOL
    assert rel_err(db, s * dy64.T @ tt + (db0 if accumulate else 0)) <= TOL


def test_lora_backward_through_the_dual_pass(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """lora_backward with DUAL (rank 16): every gradient within TOL of float64, as through lora_matmul."""
    from gpu.ops import lora_dual

    monkeypatch.setattr(lora_dual, "DUAL", True)
    test_lora_forward_backward(dev, 300, 259, 300, 16, True)


def test_lora_matmul_refuses_short_operands(dev: Device) -> None:
    small, c = dev.buffer(4 * 10), dev.buffer(4 * 64)
    with pytest.raises(DeviceError, match="lora_matmul: operand A"):
        lora_matmul(dev, Operand(small, 0, 4, 1), row_major(c, 4), c, 4, 4, 4)
    with pytest.raises(DeviceError, match="lora_matmul: output C"):
        lora_matmul(dev, row_major(c, 4), row_major(c, 4), small, 4, 4, 4)


@pytest.mark.parametrize(
    "kind,t,d,r,groups,splits",
    [
        ("x_wT", 70, 130, 16, 3, None),  # t = x A^T of q, k, v: one pass over x
        ("x_wT", 37, 259, 3, 2, 3),  # split over d (partials, then the grouped reduce)
        ("xT_t_into_rd", 300, 66, 16, 3, None),  # dA^T = x^T dt of three adapters, stored into [r, d] each
        ("xT_t_into_rd", 90, 67, 5, 4, 4),
        # the bandwidth paths (d a multiple of 4, groups of whole blocks of 16 at offsets of whole vec4s)
        ("x_wT", 70, 132, 16, 3, None),
        ("x_wT", 300, 260, 32, 2, 3),
        ("xT_t_into_rd", 300, 68, 16, 3, None),
        ("xT_t_into_rd", 90, 132, 16, 4, 4),
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_lora_matmul_column_groups(
    dev: Device, kind: str, t: int, d: int, r: int, groups: int, splits: int | None, accumulate: bool
) -> None:
    """lora_matmul with ColumnGroups: the products of several adapters that share A (each B and C at its own offset
    in one buffer, with gaps) in one dispatch, each within TOL of float64 (split and not, accumulate and not); the
    elements between the groups' outputs untouched; a column count that is not the groups' refused."""
    from gpu.ops.lora_matmul import ColumnGroups

    rng = np.random.default_rng(t + d + r + groups)
    big = rng.standard_normal((t, d)).astype(np.float32)
    aligned = d % 4 == 0 and r % 16 == 0
    gap = 4 if aligned else 7
    if kind == "x_wT":  # B group g: w_g [r, d] at b_offs[g] (B(k, n) = w_g[n, k]); C group g: [t, r] at c_offs[g]
        b_size, c_rows, c_cols = r * d, t, r
        a_op, m, k = row_major(dev.upload(big), d), t, d
    else:  # B group g: thin_g [t, r]; C group g: dA_g [r, d] (C(m, n) = dA_g[n, m])
        b_size, c_rows, c_cols = t * r, r, d
        a_op, m, k = transposed(dev.upload(big), d), d, t
    b_offs = [g * (b_size + gap) for g in range(groups)]
    c_offs = [g * (c_rows * c_cols + gap) for g in range(groups)]
    b_host = rng.standard_normal(b_offs[-1] + b_size).astype(np.float32)
    c_host = rng.standard_normal(c_offs[-1] + c_rows * c_cols + gap).astype(np.float32)
    bb, cb = dev.upload(b_host), dev.upload(c_host)
    if kind == "x_wT":
        b_op, csm, csn = transposed(bb, d), r, 1
    else:
        b_op, csm, csn = row_major(bb, r), 1, d
    cols = ColumnGroups(r, tuple(b_offs), tuple(c_offs))
    assert fast_path(a_op, b_op, m, r * groups, k, cols) == (_FAST[kind] if aligned else "")
    lora_matmul(
        dev, a_op, b_op, cb, m, r * groups, k, alpha=0.5, accumulate=accumulate, splits=splits, groups=cols,
        csm=csm, csn=csn,
    )  # fmt: skip
    got = dev.read(cb, np.float32, c_host.shape)
    want = c_host.astype(np.float64).copy()
    for g in range(groups):
        part = b_host[b_offs[g] : b_offs[g] + b_size].astype(np.float64)
        if kind == "x_wT":
            out = big.astype(np.float64) @ part.reshape(r, d).T  # [t, r]
        else:
            out = (big.astype(np.float64).T @ part.reshape(t, r)).T  # dA [r, d]
        sl = slice(c_offs[g], c_offs[g] + c_rows * c_cols)
        want[sl] = 0.5 * out.reshape(-1) + (want[sl] if accumulate else 0.0)
        assert rel_err(got[sl], want[sl]) <= TOL, g
    keep = np.ones(c_host.shape, bool)
    for g in range(groups):
        keep[c_offs[g] : c_offs[g] + c_rows * c_cols] = False
    np.testing.assert_array_equal(got[keep], c_host[keep])
    with pytest.raises(DeviceError, match="groups of"):
        lora_matmul(dev, a_op, b_op, cb, m, r * groups + 1, k, groups=cols, csm=csm, csn=csn)


@pytest.mark.parametrize("unroll", STREAM_UNROLLS)
def test_lora_stream_variants(dev: Device, monkeypatch: pytest.MonkeyPatch, unroll: int) -> None:
    """Each lora_stream variant (rows loaded at a time) within TOL of float64 on dA^T = x^T dt stored into [r, d],
    over a split whose rows are not a multiple of the unroll, accumulated."""
    from gpu.ops import lora_matmul as lm

    monkeypatch.setattr(lm, "STREAM_UNROLL", unroll)
    rng = np.random.default_rng(unroll)
    t, d, r = 203, 72, 16
    x, dt, da0 = (rng.standard_normal(s).astype(np.float32) for s in ((t, d), (t, r), (r, d)))
    a_op, b_op = transposed(up(dev, x), d), row_major(up(dev, dt), r)
    assert fast_path(a_op, b_op, d, r, t) == "stream"
    da = up(dev, da0)
    lora_matmul(dev, a_op, b_op, da, d, r, t, alpha=0.5, accumulate=True, splits=3, csm=1, csn=d)
    want = 0.5 * (x.astype(np.float64).T @ dt).T + da0
    assert rel_err(dev.read(da, np.float32, (r, d)), want) <= TOL
