"""The held-out calibration metric: model.metrics.Calibration's ECE by hand, batch-split invariant, and the numpy
engine's top-1 log-prob it is computed from."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from model.kd import LossConfig
from model.metrics import Calibration, log_softmax


def test_ece_by_hand_and_by_batches() -> None:
    conf = np.array([0.95, 0.95, 0.55, 0.15])
    agree = np.array([True, False, True, False])
    cal = Calibration()
    cal.add(np.log(conf), agree)
    # bins 9 (conf 1.9, agree 1), 5 (0.55, 1), 1 (0.15, 0): (0.9 + 0.45 + 0.15) / 4
    assert cal.ece() == pytest.approx(0.375)
    split = Calibration()
    split.add(np.log(conf[:1]), agree[:1])
    split.add(np.log(conf[1:]), agree[1:])
    assert split.ece() == pytest.approx(cal.ece())
    assert Calibration().ece() == 0.0
    # a calibrated student: agreement drawn with its confidence
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 1.0, 200_000)
    fair = Calibration()
    fair.add(np.log(p), rng.uniform(size=p.size) < p)
    assert fair.ece() < 0.01


def test_numpy_kd_evaluate_reports_the_top1_logprob() -> None:
    from cpu.head import VocabHead
    from cpu.objectives import NumpyKd
    from model.engine_spec import KdBatch

    rng = np.random.default_rng(1)
    v, h, t, k = 50, 16, 6, 4
    w = rng.standard_normal((v, h)).astype(np.float32)
    nf = rng.standard_normal((t, h)).astype(np.float32)

    class Trunk:
        batch, seq_len, rows, start_layer, head = 1, t, t, 0, VocabHead(w)
        cfg = SimpleNamespace(vocab=v, hidden=h)

    kd = NumpyKd(LossConfig("forward_kl", tau=2.0, use_tail=True), k)
    kd.bind(Trunk())  # type: ignore[arg-type]
    ids = np.tile(np.arange(k), (1, t, 1))
    lp = np.log(np.full((1, t, k), 0.2, np.float32))
    tail = np.full((1, t), 0.2, np.float32)
    tok, targets = rng.integers(0, v, (1, t)), rng.integers(0, v, (1, t))
    out = kd.evaluate(kd.write(KdBatch(tok, targets, np.ones((1, t)), ids, lp, tail)), nf)
    ls = log_softmax(nf.astype(np.float64) @ w.T.astype(np.float64))
    np.testing.assert_array_equal(out["top1"], ls.argmax(axis=1))
    np.testing.assert_allclose(out["top1_logp"], ls.max(axis=1), atol=1e-5)
