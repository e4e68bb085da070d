"""The fused LoRA pairs (gpu/ops/lora_fused.py, gpu/kernels/lora_fused.wgsl: t = x A^T and y += s t B^T in one
dispatch, dt = s dy B and dx += dt A in another) and the ops on them (gpu/ops/lora.py lora_forward /
lora_backward with fused=True) vs a float64 numpy reference: relative error (max abs err / max abs ref) <= 1e-4
in f32, at T not a multiple of the 16-row block, d not a multiple of the staged tiles, every rank bucket
(r = 1, 5, 16, 32, 64), gradients accumulated or not; results bitwise equal over two calls; ranks above 64 take
the split path."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

from gpu.device import Device, DeviceError
from gpu.ops import lora as lora_ops
from gpu.ops.lora import lora_backward, lora_forward
from gpu.ops.lora_fused import covers, lora_fused
from gpu.ops.strided_matmul import row_major, transposed
from model import reference as ref
from tests.gpu_helpers import make_device, rel_err, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _problem(t: int, d_in: int, d_out: int, r: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(t * 31 + d_in * 7 + d_out + r)
    shapes = {
        "x": (t, d_in), "a": (r, d_in), "b": (d_out, r), "y0": (t, d_out), "dy": (t, d_out), "dx0": (t, d_in),
        "da0": (r, d_in), "db0": (d_out, r),
    }  # fmt: skip
    p = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    p["a"] = (p["a"] / np.sqrt(d_in)).astype(np.float32)
    return p


def _run(
    dev: Device, p: dict[str, np.ndarray], r: int, s: float, acc: bool, forward: Callable, backward: Callable
) -> list[np.ndarray]:
    """forward + backward on fresh outputs: y, t, dx, dt, dA, dB."""
    (t, d_in), d_out = p["x"].shape, p["b"].shape[0]
    xb, ab, bb, dyb = up(dev, p["x"]), up(dev, p["a"]), up(dev, p["b"]), up(dev, p["dy"])
    tb, dt = dev.buffer(4 * t * r), dev.buffer(4 * t * r)
    y, dx, da, db = up(dev, p["y0"]), up(dev, p["dx0"]), up(dev, p["da0"]), up(dev, p["db0"])
    forward(dev, xb, ab, bb, tb, y, t, d_in, d_out, r, s)
    backward(dev, dyb, xb, ab, bb, tb, da, db, dx, dt, t, d_in, d_out, r, s, accumulate_grads=acc)
    shapes = ((t, d_out), (t, r), (t, d_in), (t, r), (r, d_in), (d_out, r))
    return [dev.read(buf, np.float32, sh) for buf, sh in zip((y, tb, dx, dt, da, db), shapes, strict=True)]


def _check(p: dict[str, np.ndarray], got: list[np.ndarray], s: float, acc: bool) -> None:
    y, t, dx, dt, da, db = got
    x, a, b, dy = (p[k].astype(np.float64) for k in ("x", "a", "b", "dy"))
    assert rel_err(t, x @ a.T) <= TOL
    assert rel_err(y, p["y0"] + ref.lora_forward(x, a, b, s)) <= TOL
    assert rel_err(dt, s * dy @ b) <= TOL
    dx_ref, da_ref, db_ref = ref.lora_backward(dy, x, a, b, s)
    assert rel_err(dx, p["dx0"] + dx_ref) <= TOL
    if acc:
        da_ref, db_ref = da_ref + p["da0"], db_ref + p["db0"]
    assert rel_err(da, da_ref) <= TOL
    assert rel_err(db, db_ref) <= TOL


@pytest.mark.parametrize(
    "t,d_in,d_out,r",
    [
        (37, 600, 600, 1),  # bucket 8: 5 staged steps of 128, 3 column blocks of 256
        (300, 259, 130, 16),  # T = 18 blocks + 12 rows; 5 steps of 64 (the last 3 wide), 2 blocks of 128 (the last 2)
        (17, 130, 259, 16),  # one row past a block
        (33, 130, 300, 5),  # rank 5 in bucket 8: padded ranks stay zero
        (129, 136, 72, 32),
        (50, 259, 130, 64),  # bucket 64: 9 steps of 32, 5 blocks of 32 (the last 2 wide)
        (1, 40, 24, 64),
    ],
)
@pytest.mark.parametrize("acc", [False, True])
def test_fused_forward_backward(dev: Device, t: int, d_in: int, d_out: int, r: int, acc: bool) -> None:
    p, s = _problem(t, d_in, d_out, r), 1.75
    got = twice(lambda: _run(dev, p, r, s, acc, partial(lora_forward, fused=True), partial(lora_backward, fused=True)))
    _check(p, got, s, acc)


def test_fused_pair_scales(dev: Device) -> None:
    """lora_fused on its own: both alphas applied, Y accumulated onto, T written with alpha1."""
    t, k, n, r = 45, 70, 90, 16
    rng = np.random.default_rng(5)
    x, w1, w2, y0 = (rng.standard_normal(s).astype(np.float32) for s in ((t, k), (k, r), (r, n), (t, n)))
    tb, y = dev.buffer(4 * t * r), up(dev, y0)
    lora_fused(dev, up(dev, x), row_major(up(dev, w1), r), row_major(up(dev, w2), n), tb, y, t, k, n, r,
               alpha1=0.5, alpha2=-3.0)  # fmt: skip
    t_ref = 0.5 * x.astype(np.float64) @ w1
    assert rel_err(dev.read(tb, np.float32, (t, r)), t_ref) <= TOL
    assert rel_err(dev.read(y, np.float32, (t, n)), y0 - 3.0 * t_ref @ w2) <= TOL


@pytest.mark.parametrize("fused,r,dispatches", [(True, 16, (1, 5)), (True, 65, (3, 7)), (False, 16, (3, 7))])
def test_ops_pick_the_path(
    dev: Device, monkeypatch: pytest.MonkeyPatch, fused: bool, r: int, dispatches: tuple[int, int]
) -> None:
    """lora_forward / lora_backward take the fused kernels when FUSED is set and r <= 64, else the split path
    (counted in dispatches at a shape whose reductions split: t over d_in = 600, dt over d_out = 300, dA/dB over
    T = 300 tokens); both give the reference's results."""
    monkeypatch.setattr(lora_ops, "FUSED", fused)
    counts = [0]
    record = dev.dispatch

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts[0] += 1
        return record(*args, **kwargs)

    p, s = _problem(300, 600, 300, r), 0.5
    monkeypatch.setattr(dev, "dispatch", counting)
    forward_counts: list[int] = []

    def forward(*args: Any) -> None:
        lora_ops.lora_forward(*args)
        forward_counts.append(counts[0])

    got = _run(dev, p, r, s, False, forward, lora_ops.lora_backward)
    assert (forward_counts[0], counts[0] - forward_counts[0]) == dispatches
    _check(p, got, s, False)


def test_coverage_and_refusals(dev: Device) -> None:
    assert covers(4096, 1) and covers(4096, 64) and not covers(4096, 65)
    buf = dev.buffer(4 * 1024)
    with pytest.raises(DeviceError, match="lora_fused: 8 rows at rank 65 are not covered"):
        lora_fused(dev, buf, transposed(buf, 8), transposed(buf, 65), buf, buf, 8, 8, 8, 65)
    with pytest.raises(DeviceError, match="lora_fused: X needs 8192 B"):
        lora_fused(dev, buf, transposed(buf, 64), transposed(buf, 4), buf, buf, 32, 64, 4, 4)
