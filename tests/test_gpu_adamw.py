"""AdamW on the GPU vs a float64 numpy AdamW (PyTorch semantics): several steps with clipping active, a NaN
gradient step and an infinite loss step that must be skipped (params and moments untouched); bitwise repeatable."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.device import Device
from gpu.ops.adamw import AdamW, AdamWConfig
from tests.gpu_helpers import make_device, rel_err, up

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def np_adamw(p, g, m, v, step, lr, c: AdamWConfig):
    """One PyTorch-style AdamW step with global-norm clipping, float64."""
    norm = float(np.sqrt(np.sum(g * g)))
    scale = min(1.0, c.max_grad_norm / (norm + 1e-6)) if c.max_grad_norm > 0 else 1.0
    g = g * scale
    p = p * (1.0 - lr * c.weight_decay)
    m = c.beta1 * m + (1 - c.beta1) * g
    v = c.beta2 * v + (1 - c.beta2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - c.beta2**step) + c.eps
    p = p - lr / (1 - c.beta1**step) * m / denom
    return p, m, v, norm, scale


def _run(dev: Device, n: int, cfg: AdamWConfig, p0, grads, losses, lrs):
    opt = AdamW(dev, n, cfg)
    p = up(dev, p0)
    gbuf, lbuf = dev.buffer(4 * n), dev.buffer(4)
    out, step = [], 1
    for g, loss, lr in zip(grads, losses, lrs, strict=True):
        dev.write(gbuf, g.astype(np.float32))
        dev.write(lbuf, np.array([loss], np.float32))
        with dev.step():
            opt.step(p, gbuf, step, lr=lr, loss=lbuf)
        st = opt.read_stats()
        out.append((st, dev.read(p, np.float32, (n,)), dev.read(opt.m, np.float32, (n,)), dev.read(opt.v)))
        step += 0 if st.skipped else 1
    return out


def test_adamw_matches_numpy_and_skips_nonfinite(dev: Device) -> None:
    rng = np.random.default_rng(0)
    n = 10_000  # 3 partial-norm workgroups, the last one partial
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=5.0)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * s for s in (1.0, 0.01, 1.0, 1.0, 0.5)]
    grads[2][1234] = np.nan
    losses = [1.0, 2.0, 3.0, np.inf, 0.5]
    lrs = [1e-2, 2e-2, 2e-2, 2e-2, 5e-3]
    got = _run(dev, n, cfg, p0, grads, losses, lrs)
    again = _run(dev, n, cfg, p0, grads, losses, lrs)
    for a, b in zip(got, again, strict=True):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a[1:], b[1:], strict=True))

    p, m, v = p0.astype(np.float64), np.zeros(n), np.zeros(n)
    step = 1
    clipped = 0
    for i, (g, loss, lr) in enumerate(zip(grads, losses, lrs, strict=True)):
        st, gp, gm, gv = got[i]
        skip = not (np.isfinite(loss) and np.all(np.isfinite(g)))
        assert st.skipped == skip, i
        if not skip:
            p, m, v, norm, scale = np_adamw(p, g.astype(np.float64), m, v, step, lr, cfg)
            step += 1
            clipped += scale < 1.0
            assert abs(st.grad_norm - norm) <= 1e-5 * norm
            assert abs(st.clip_scale - scale) <= 1e-5
        assert rel_err(gp, p) <= 1e-5
        assert rel_err(gm, m) <= 1e-4
        assert rel_err(gv, v) <= 1e-4
        if skip:  # untouched, bit for bit
            assert gp.tobytes() == got[i - 1][1].tobytes()
            assert gm.tobytes() == got[i - 1][2].tobytes()
    assert clipped >= 2  # clipping was active
    assert step == 4  # two of the five steps were skipped


def test_adamw_without_clipping_or_loss(dev: Device) -> None:
    rng = np.random.default_rng(1)
    n = 5
    cfg = AdamWConfig(lr=0.1, max_grad_norm=0.0)
    p0, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    opt = AdamW(dev, n, cfg)
    p = up(dev, p0)
    opt.step(p, up(dev, g), 1)
    st = opt.read_stats()
    want, *_ = np_adamw(p0.astype(np.float64), g.astype(np.float64), np.zeros(n), np.zeros(n), 1, 0.1, cfg)
    assert not st.skipped and st.clip_scale == 1.0
    assert rel_err(dev.read(p, np.float32, (n,)), want) <= 1e-5
