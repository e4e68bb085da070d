"""lora_matmul over int8 codes (gpu/ops/lora_matmul.py Codes, gpu/kernels/lora_gemm_codes.wgsl) vs float64 numpy on
the same codes and factors: relative error (max abs err / max abs ref) <= 1e-5, in the four forms the integer path
uses (t = x^ A^T and dt = dY^ B along the codes' rows, dB = dY^T t and dA^T = x^T dt across them), with factors
times and divided (a zero divisor zeroing its column), column groups, splits (a short last one), accumulate, ranks
that fill no block of 16 (1, 3, 20), rows past the workgroup's, and codes after others in their buffer."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.device import Device, DeviceError
from gpu.ops.lora_matmul import DIVIDED, TIMES, Codes, ColumnGroups, lora_matmul
from gpu.ops.strided_matmul import Operand, row_major, transposed
from model.int8 import pack_i8
from tests.gpu_helpers import make_device, rel_err, up

pytestmark = pytest.mark.gpu
TOL = 1e-5


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _codes(rng: np.random.Generator, rows: int, cols: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes [rows, cols] (the full range, +-127) and their packed words with `pad` codes before them."""
    c = rng.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    flat = np.concatenate([np.full(pad, 99, np.int8), c.reshape(-1)])
    flat = np.concatenate([flat, np.zeros(-len(flat) % 4, np.int8)])
    return c, pack_i8(flat.reshape(1, -1)).reshape(-1)


def _factor(f: np.ndarray | None, mode: int) -> np.ndarray:
    if f is None or mode == 0:
        return np.float64(1.0)
    f = f.astype(np.float64)
    return f if mode == TIMES else np.divide(1.0, f, out=np.zeros_like(f), where=f != 0)


CASES = [
    ("rows", 70, 256, 16, TIMES, 0, None),  # t = x^ A^T: x's row scales
    ("rows", 37, 144, 3, TIMES, DIVIDED, 2),  # dt = dY^ B: dY's row scales, W's row scales divided out
    ("rows", 300, 64, 20, TIMES, DIVIDED, None),
    ("rows", 5, 336, 16, TIMES, 0, 3),
    ("across", 300, 128, 16, DIVIDED, TIMES, None),  # dB = dY^T t: W's row scales out, dY's row scales in
    ("across", 171, 68, 1, DIVIDED, TIMES, 5),
    ("across", 90, 272, 32, 0, TIMES, 4),  # dA^T = x^T dt: x's row scales
]


def _check(dev: Device, case: tuple, accumulate: bool, tol: float, s_scale: float = 1.0, s_kfast: bool = False) -> None:
    """One product of CASES over codes (S times s_scale; S read k-fast: A's rows) against float64, twice (bitwise
    the same)."""
    form, t, d, r, row_mode, step_mode, splits = case
    rng = np.random.default_rng(t * 1000 + d + r)
    pad = 16
    codes, words = _codes(rng, t, d, pad)
    tok_scale = rng.uniform(0.01, 0.1, t).astype(np.float32)
    feat_scale = rng.uniform(0.5, 2.0, d).astype(np.float32)
    feat_scale[d // 3] = 0.0  # a zeroed column (a weight row of zeros): divided out to 0
    if form == "rows":  # A(i = token, k = feature) = code[i, k]; rows: tokens, steps: features
        m, k = t, d
        a = Operand(None, pad, d, 1)
        rows_f, steps_f = tok_scale, feat_scale
        full = codes.astype(np.float64)
    else:  # A(i = feature, k = token) = code[k, i]; rows: features, steps: tokens
        m, k = d, t
        a = Operand(None, pad, 1, d)
        rows_f, steps_f = feat_scale, tok_scale
        full = codes.astype(np.float64).T
    s = (rng.standard_normal((k, r)) * s_scale).astype(np.float32)
    want = _factor(rows_f, row_mode).reshape(-1, 1) * (full * _factor(steps_f, step_mode)) @ s.astype(np.float64)
    alpha = 0.75
    old = (rng.standard_normal((m, r)) * np.abs(want).max()).astype(np.float32)
    want = alpha * want + (old if accumulate else 0.0)
    rb, sb = up(dev, rows_f), up(dev, steps_f)
    spec = Codes(None if row_mode == 0 else (rb, row_mode), None if step_mode == 0 else (sb, step_mode))
    s_op = transposed(up(dev, s.T), k) if s_kfast else row_major(up(dev, s), r)
    out = []
    for _ in range(2):
        c = up(dev, old)
        lora_matmul(
            dev, Operand(up(dev, words, np.uint32), a.off, a.s0, a.s1), s_op, c, m, r, k, alpha=alpha,
            accumulate=accumulate, splits=splits, codes=spec,
        )  # fmt: skip
        out.append(dev.read(c, np.float32, (m, r)))
    err = rel_err(out[0], want)
    assert err < tol, f"{form} {t}x{d} r{r}: rel err {err:.2e}"
    np.testing.assert_array_equal(out[0], out[1])
    if row_mode == DIVIDED and not accumulate:
        assert not out[0][d // 3].any()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-r{c[3]}" for c in CASES])
@pytest.mark.parametrize("accumulate", [False, True])
def test_lora_matmul_codes(monkeypatch: pytest.MonkeyPatch, dev: Device, case: tuple, accumulate: bool) -> None:
    """The f32 multiply-adds (lora_codes_rows / lora_codes_across) on any adapter."""
    from gpu.ops import lora_matmul as lm

    monkeypatch.setattr(lm, "CODES_TENSOR_CORES", False)
    _check(dev, case, accumulate, TOL)
    if case[0] == "rows":
        _check(dev, case, accumulate, TOL, s_kfast=True)


# on the f16 tensor cores S is rounded to f16 (relative 2^-11 an element) after the chunk's power-of-two scaling;
# the sums stay f32: a few 1e-4 of the largest output
TC_TOL = 2e-3


@pytest.mark.tensorcore
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-r{c[3]}" for c in CASES])
def test_lora_matmul_codes_tensor_cores(monkeypatch: pytest.MonkeyPatch, case: tuple) -> None:
    """The same products on lora_codes_tc (H200 only), S at its natural size and at 1e-30 and 1e30 of it (the chunk's
    scaling keeps them inside f16), accumulate on and off."""
    from gpu.ops import lora_matmul as lm
    from tests.gpu_fixtures import tensor_core_device_or_skip

    dev = tensor_core_device_or_skip()
    monkeypatch.setattr(lm, "CODES_TENSOR_CORES", True)
    asked, real = [], lm.pipeline
    monkeypatch.setattr(lm, "pipeline", lambda dev, name, **v: asked.append(name) or real(dev, name, **v))
    for accumulate, s_scale in ((False, 1.0), (True, 1.0), (False, 1e-30), (False, 1e30)):
        _check(dev, case, accumulate, TC_TOL, s_scale)
    if case[0] == "rows":
        _check(dev, case, False, TC_TOL, s_kfast=True)
    # rows of codes that start inside a vec4 (across, d = 68) take the multiply-adds
    assert set(asked) - {"lora_reduce"} == {"lora_codes_tc" if case[2] % 16 == 0 else "lora_codes_across"}


def test_lora_matmul_codes_column_groups(dev: Device) -> None:
    """t of two adapters sharing x^ in one product: each group's S at its own offset, each t at its own."""
    rng = np.random.default_rng(7)
    t, d, r = 130, 96, 16
    codes, words = _codes(rng, t, d, 0)
    scale = rng.uniform(0.01, 0.1, t).astype(np.float32)
    a1, a2 = (rng.standard_normal((r, d)).astype(np.float32) for _ in range(2))
    s = np.concatenate([a1.reshape(-1), a2.reshape(-1)])
    out = up(dev, np.zeros(2 * t * r + 64, np.float32))
    groups = ColumnGroups(r, (0, r * d), (0, t * r + 64))
    lora_matmul(
        dev, row_major(up(dev, words, np.uint32), d), transposed(up(dev, s), d), out, t, 2 * r, d, csm=r, groups=groups,
        codes=Codes((up(dev, scale), TIMES)),
    )  # fmt: skip
    got = dev.read(out, np.float32, (2 * t * r + 64,))
    x = codes.astype(np.float64) * scale.reshape(-1, 1)
    assert rel_err(got[: t * r].reshape(t, r), x @ a1.T.astype(np.float64)) < TOL
    assert rel_err(got[t * r + 64 :].reshape(t, r), x @ a2.T.astype(np.float64)) < TOL


def test_lora_matmul_codes_bounds(dev: Device) -> None:
    """Codes that end before A does, or rows that start inside a vec4 of codes: a clear error, nothing dispatched."""
    words = up(dev, np.zeros(8, np.uint32), np.uint32)  # 32 codes
    s, c = row_major(up(dev, np.zeros((16, 4), np.float32)), 4), up(dev, np.zeros(12, np.float32))
    with pytest.raises(DeviceError, match="codes A .* read past"):
        lora_matmul(dev, row_major(words, 16), s, c, 3, 4, 16, codes=Codes())
    with pytest.raises(DeviceError, match="whole 16-code vec4s"):
        lora_matmul(dev, row_major(words, 8), s, c, 3, 4, 8, codes=Codes())
