"""Tensor-core attention (gpu/ops/attention_tc.py) vs the float64 reference (model/reference.py).

Tolerance: q, k, v, dO, P and dS are rounded to f16 for the tensor-core products (f32 everywhere else), so
each output (out, lse, dq, dk, dv) must lie within TOL of its own max abs; an indexing, masking or rescale
error is O(1). The shapes cover T off the 16-row and 64-column tiles, GQA groups 1 and 8, head_dim 64 and
128, several key tiles with scores spread widely enough that the running max moves (rescales O), gradients
of 1e-7 (the dO scale sigma), and a batch of sequences in one call. Runs where Dawn has subgroup matrices (the
H200 with Vulkan and wgpudawn installed: `python3 -m pytest -q -m tensorcore tests/test_gpu_attention_tc.py`);
the Tint compile of every variant is in tests/test_kernel_registry.py, the refusal elsewhere runs on lavapipe.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu.device import Device, DeviceError
from gpu.ops.attention_tc import attention_backward_tc, attention_forward_tc
from gpu.ops.matmul_tc import has_tensor_cores
from gpu.registry import kernel_key, pipeline
from model import reference as ref
from tests.gpu_fixtures import device_or_skip, tensor_core_device_or_skip

TOL = 2e-3


@pytest.fixture(scope="module")
def tc_dev() -> Device:
    return tensor_core_device_or_skip()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _run(dev: Device, q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray) -> dict[str, np.ndarray]:
    """Forward then backward on the device, outputs poisoned with NaN first (an unwritten element fails)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qb, kb, vb, dob = (dev.upload(np.ascontiguousarray(x, np.float32)) for x in (q, k, v, do))
    nan = np.float32(np.nan)
    out, dq = dev.upload(np.full(q.shape, nan)), dev.upload(np.full(q.shape, nan))
    dk, dv = dev.upload(np.full(k.shape, nan)), dev.upload(np.full(k.shape, nan))
    lse = dev.upload(np.full((hq, t), nan))
    attention_forward_tc(dev, qb, kb, vb, out, lse, t, hq, hkv, d)
    attention_backward_tc(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d)
    shapes = {"out": q.shape, "lse": (hq, t), "dq": q.shape, "dk": k.shape, "dv": v.shape}
    bufs = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    got = {n: dev.read(bufs[n], np.float32, s) for n, s in shapes.items()}
    # packed=True right after a forward over the same q, k, v (the student's recomputed blocks): bitwise the same
    attention_forward_tc(dev, qb, kb, vb, out, lse, t, hq, hkv, d)
    attention_backward_tc(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d, packed=True)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(dev.read(bufs[n], np.float32, shapes[n]), got[n], err_msg=f"packed {n}")
    return got


def _expected(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray) -> dict[str, np.ndarray]:
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    t, hq, d = q.shape
    s = np.einsum("thd,shd->hts", q64, np.repeat(k64, hq // k.shape[1], axis=1)) / np.sqrt(d)
    s = np.where(np.triu(np.ones((t, t), dtype=bool), k=1), -np.inf, s)
    dq, dk, dv = ref.attention_backward(do64, q64, k64, v64)
    return {"out": ref.attention_forward(q64, k64, v64), "lse": ref.logsumexp(s)[..., 0], "dq": dq, "dk": dk, "dv": dv}


# (T, Hq, Hkv, D, score spread, dO scale, ramp): T off the tiles, GQA 8 and 1, D 64 and 128, several key tiles;
# ramp > 0 adds ramp * (j // 64) / sqrt(D) to every score of key j (q's first component 1, k's that, both exact in
# f16), so each new 64 keys pass the forward's lazy reference max by more than its threshold of 8 (its rescaling
# of O runs, again and again; without a ramp few rows ever trigger it). The ramp cases hold the forward's outputs
# only: the backward's dQ = dS K sums f16-rounded dS against K's large ramp component, whose per-row sum cancels
# (sum_j dS_j = 0), so it lands ~1e-2 of max |dQ| off there (3.3e-2 / 7.3e-3 on an H100 2026-12-05), a bound of
# the f16 dS, not of the forward.
CASES = [
    (77, 8, 1, 64, 1.0, 1.0, 0.0),
    (130, 4, 4, 64, 1.0, 1.0, 0.0),
    (300, 8, 1, 64, 2.0, 1e-7, 0.0),
    (17, 2, 1, 64, 1.0, 1.0, 0.0),
    (45, 4, 4, 128, 1.0, 1.0, 0.0),
    (200, 16, 2, 128, 2.0, 1.0, 0.0),
    (300, 8, 1, 64, 1.0, 1.0, 72.0),
    (200, 16, 2, 128, 1.0, 1.0, 96.0),
]


@pytest.mark.tensorcore
@pytest.mark.parametrize("t,hq,hkv,d,spread,gscale,ramp", CASES)
def test_attention_tc_matches_reference(
    tc_dev: Device, t: int, hq: int, hkv: int, d: int, spread: float, gscale: float, ramp: float
) -> None:
    """The forward and backward at the defaults."""
    _check_against_reference(tc_dev, t, hq, hkv, d, spread, gscale, ramp)


def _case_inputs(
    seed: int, t: int, hq: int, hkv: int, d: int, spread: float, gscale: float, ramp: float
) -> tuple[np.ndarray, ...]:
    """q, k, v, dO (f32) of a CASES row: scores spread by `spread`, dO scaled by `gscale`, the ramp (see CASES)."""
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((t, hq, d)) * s for s in (spread, gscale))
    k = rng.standard_normal((t, hkv, d)) * spread
    if ramp:
        q[:, :, 0], k[:, :, 0] = 1.0, (ramp * (np.arange(t) // 64))[:, None]
    v = rng.standard_normal((t, hkv, d))
    return tuple(x.astype(np.float32) for x in (q, k, v, do))


def _check_against_reference(
    tc_dev: Device, t: int, hq: int, hkv: int, d: int, spread: float, gscale: float, ramp: float
) -> None:
    rng = np.random.default_rng(t + hq + d)
    q = (rng.standard_normal((t, hq, d)) * spread).astype(np.float32)
    k = (rng.standard_normal((t, hkv, d)) * spread).astype(np.float32)
    if ramp:
        q[:, :, 0], k[:, :, 0] = 1.0, (ramp * (np.arange(t) // 64))[:, None]
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    do = (rng.standard_normal((t, hq, d)) * gscale).astype(np.float32)
    got, want = _run(tc_dev, q, k, v, do), _expected(q, k, v, do)
    errs = {n: _rel(got[n], want[n]) for n in (("out", "lse") if ramp else want)}
    print(
        f"T={t} Hq={hq} Hkv={hkv} D={d} spread={spread} dO*{gscale} ramp={ramp}: "
        + " ".join(f"{n} {e:.2e}" for n, e in errs.items())
    )
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    assert not bad, f"rel err over {TOL}: {bad}"


@pytest.mark.tensorcore
@pytest.mark.parametrize("one_flag", [False, True])
@pytest.mark.parametrize("subgroups,kernel", [(4, "attention_tc_forward"), (8, "attention_tc_forward8")])
@pytest.mark.parametrize("t,hq,hkv,d,spread,gscale,ramp", CASES)
def test_attention_tc_forward_tiles_match_reference(
    tc_dev: Device, monkeypatch: pytest.MonkeyPatch, one_flag: bool, subgroups: int, kernel: str, t: int, hq: int,
    hkv: int, d: int, spread: float, gscale: float, ramp: float,
) -> None:  # fmt: skip
    """Both forward tiles hold the tolerance on every case, the ramps' lazy rescaling too: 4 subgroups a workgroup
    (64 query rows, key tiles of 64 at head dim 64, 32 at 128: attention_tc_forward) and 8 (128 query rows sharing
    each key tile of 32: attention_tc_forward8, at both head dims); with the reference max's flags exchanged before
    P (all subgroups' rows moving together) or after it (ONE_FLAG: each subgroup's own)."""
    from gpu.ops import attention_tc

    monkeypatch.setattr(attention_tc, "ONE_FLAG", one_flag)
    monkeypatch.setattr(attention_tc, "FORWARD_SUBGROUPS", subgroups)
    monkeypatch.setattr(attention_tc, "WIDE_FORWARD_HEAD_DIMS", (64, 128))
    used = _kernels_used(monkeypatch)
    _check_against_reference(tc_dev, t, hq, hkv, d, spread, gscale, ramp)
    assert kernel in used and not set(used) & {"attention_tc_forward", "attention_tc_forward8"} - {kernel}, used


def _kernels_used(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels gpu/ops/attention_tc.py asks for from now on (filled as it asks)."""
    from gpu.ops import attention_tc

    used: list[str] = []

    def recording(dev: Device, name: str, **variant: object) -> object:
        used.append(name)
        return pipeline(dev, name, **variant)

    monkeypatch.setattr(attention_tc, "pipeline", recording)
    return used


@pytest.mark.tensorcore
@pytest.mark.parametrize("t,hq,hkv,d,spread,gscale,ramp", [c for c in CASES if not c[6]])
def test_attention_tc_paired_backward_is_the_sequential_one(
    tc_dev: Device, monkeypatch: pytest.MonkeyPatch, t: int, hq: int, hkv: int, d: int, spread: float,
    gscale: float, ramp: float,
) -> None:  # fmt: skip
    """The backward with S and dP side by side (PAIRED_BACKWARD: the dK/dV pass at both head dims, the dQ pass at
    128): the same products of the same values in fewer barriers, so bitwise the sequential kernels' gradients."""
    from gpu.ops import attention_tc

    rng = np.random.default_rng(t + hq + d)
    q, do = (rng.standard_normal((t, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((t, hkv, d)).astype(np.float32) for _ in range(2))
    monkeypatch.setattr(attention_tc, "DQ_FROM_DS", False)
    monkeypatch.setattr(attention_tc, "PAIRED_BACKWARD", False)
    plain = _run(tc_dev, q, k, v, do)
    monkeypatch.setattr(attention_tc, "PAIRED_BACKWARD", True)
    paired = _run(tc_dev, q, k, v, do)
    assert any(key[0] == "attention_tc_backward_dkv_paired" for key in tc_dev._pipelines)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(paired[name], plain[name], err_msg=name)


@pytest.mark.tensorcore
@pytest.mark.parametrize("t,hq,hkv,d,spread,gscale,ramp", CASES)
def test_attention_tc_dq_from_stored_ds(
    tc_dev: Device, monkeypatch: pytest.MonkeyPatch, t: int, hq: int, hkv: int, d: int, spread: float,
    gscale: float, ramp: float,
) -> None:  # fmt: skip
    """DQ_FROM_DS: the dK/dV pass stores dS and dQ = dS K reads it back (attention_tc_backward_dkv_ds, _dqs). dK and
    dV are the paired pass's bitwise (the same products of the same values; L from the delta pass's copy), dQ holds
    the reference tolerance (the same f16 dS, summed in another order); the ramps' cases too."""
    from gpu.ops import attention_tc

    q, k, v, do = _case_inputs(t + hq + d + 1, t, hq, hkv, d, spread, gscale, ramp)
    monkeypatch.setattr(attention_tc, "PAIRED_BACKWARD", True)
    monkeypatch.setattr(attention_tc, "DQ_FROM_DS", False)
    dqs = kernel_key("attention_tc_backward_dqs", {"head_dim": d, "skip_masked": attention_tc.SKIP_MASKED})
    tc_dev._pipelines.pop(dqs, None)
    paired = _run(tc_dev, q, k, v, do)
    assert dqs not in tc_dev._pipelines
    monkeypatch.setattr(attention_tc, "DQ_FROM_DS", True)
    stored = _run(tc_dev, q, k, v, do)
    assert dqs in tc_dev._pipelines
    for name in ("out", "lse", "dk", "dv"):
        np.testing.assert_array_equal(stored[name], paired[name], err_msg=name)
    want = _expected(q, k, v, do)
    err, err_paired = _rel(stored["dq"], want["dq"]), _rel(paired["dq"], want["dq"])
    print(f"T={t} Hq={hq} Hkv={hkv} D={d} ramp={ramp}: dq from the store {err:.2e}, recomputed {err_paired:.2e}")
    assert err <= (max(TOL, 2 * err_paired) if ramp else TOL), (err, err_paired)


@pytest.mark.tensorcore
@pytest.mark.parametrize("subgroups", [4, 8])
@pytest.mark.parametrize("t,hq,hkv,d,spread,gscale,ramp", CASES)
def test_attention_tc_skip_masked_is_bitwise(
    tc_dev: Device, monkeypatch: pytest.MonkeyPatch, subgroups: int, t: int, hq: int, hkv: int, d: int,
    spread: float, gscale: float, ramp: float,
) -> None:  # fmt: skip
    """SKIP_MASKED: each subgroup skips the products of the blocks the causal mask zeroes whole for its rows (the
    forward on either tile, the dK/dV pass with the dS store, dQ from it); what they would add is zeros, or scores
    the mask replaces, so every output is bitwise the full products' (the ramps' rescaling too)."""
    from gpu.ops import attention_tc

    q, k, v, do = _case_inputs(t + hq + d + 2, t, hq, hkv, d, spread, gscale, ramp)
    monkeypatch.setattr(attention_tc, "FORWARD_SUBGROUPS", subgroups)
    monkeypatch.setattr(attention_tc, "PAIRED_BACKWARD", True)
    monkeypatch.setattr(attention_tc, "DQ_FROM_DS", True)
    monkeypatch.setattr(attention_tc, "SKIP_MASKED", False)
    full = _run(tc_dev, q, k, v, do)
    monkeypatch.setattr(attention_tc, "SKIP_MASKED", True)
    used = _kernels_used(monkeypatch)
    skipped = _run(tc_dev, q, k, v, do)
    forward = "attention_tc_forward8" if subgroups == 8 else "attention_tc_forward"
    assert {forward, "attention_tc_backward_dkv_ds", "attention_tc_backward_dqs"} <= set(used), used
    for name in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_array_equal(skipped[name], full[name], err_msg=name)


@pytest.mark.tensorcore
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("from_ds", [False, True])
def test_attention_tc_batch_matches_reference(
    tc_dev: Device, monkeypatch: pytest.MonkeyPatch, d: int, from_ds: bool
) -> None:
    """Three sequences in one call (grid z), lse at a padded per-sequence stride: each sequence matches its own
    float64 reference within TOL, and the lse padding between sequences stays unwritten (from_ds: dQ from the
    dS store, whose planes and lse copy are per sequence too)."""
    from gpu.ops import attention_tc

    monkeypatch.setattr(attention_tc, "DQ_FROM_DS", from_ds)
    b, t, hq, hkv = 3, 150, 8, 2
    stride = hq * t + 64
    rng = np.random.default_rng(d)
    q, do = (rng.standard_normal((b * t, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b * t, hkv, d)).astype(np.float32) for _ in range(2))
    dev = tc_dev
    qb, kb, vb, dob = (dev.upload(x) for x in (q, k, v, do))
    nan = np.float32(np.nan)
    out, dq = dev.upload(np.full(q.shape, nan)), dev.upload(np.full(q.shape, nan))
    dk, dv = dev.upload(np.full(k.shape, nan)), dev.upload(np.full(k.shape, nan))
    lse = dev.upload(np.full(b * stride, nan))
    attention_forward_tc(dev, qb, kb, vb, out, lse, t, hq, hkv, d, n_seqs=b, lse_stride=stride)
    attention_backward_tc(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d, n_seqs=b, lse_stride=stride)
    got = {
        n: dev.read(x, np.float32, s)
        for n, x, s in (("out", out, q.shape), ("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, v.shape))
    }
    lses = dev.read(lse, np.float32, (b, stride))
    assert np.isnan(lses[:, hq * t :]).all(), "lse written past a sequence's [Hq, T]"
    for z in range(b):
        rows = slice(z * t, (z + 1) * t)
        want = _expected(q[rows], k[rows], v[rows], do[rows])
        mine = {n: got[n][rows] for n in got} | {"lse": lses[z, : hq * t].reshape(hq, t)}
        errs = {n: _rel(mine[n], want[n]) for n in want}
        print(f"batch seq {z} D={d}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        bad = {n: e for n, e in errs.items() if not e <= TOL}
        assert not bad, f"sequence {z}: rel err over {TOL}: {bad}"


@pytest.mark.tensorcore
def test_attention_tc_bitwise_reproducible(tc_dev: Device) -> None:
    rng = np.random.default_rng(5)
    q, do = rng.standard_normal((2, 100, 8, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 100, 2, 64)).astype(np.float32)
    a, b = _run(tc_dev, q, k, v, do), _run(tc_dev, q, k, v, do)
    for name in a:
        np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32), err_msg=name)


@pytest.mark.gpu
def test_attention_tc_refuses_without_tensor_cores() -> None:
    dev = device_or_skip()
    if has_tensor_cores(dev):
        pytest.skip("this adapter has tensor cores")
    buf = dev.buffer(4 * 16 * 64)
    with pytest.raises(DeviceError, match="tensor-core attention"):
        attention_forward_tc(dev, buf, buf, buf, buf, dev.buffer(4 * 16), 4, 4, 4, 64)
