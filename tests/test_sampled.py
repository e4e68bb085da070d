"""The sampled teacher store's draw (model/sampled.py) and loss (model/kd.py, samples > 0): the generator against
Random123's vectors and our own, the draw's law, and the estimator's unbiasedness for the full forward-KL gradient."""

from __future__ import annotations

import numpy as np
import pytest

from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.kd import LossConfig
from model.sampled import (
    KNOWN_ANSWERS,
    draw_bits,
    draw_from_logits,
    encode,
    logp_code,
    logp_value,
    philox4x32,
    sample_positions,
)
from tests.test_reference import TOL, fd_rel_error

N = 12
# draw_bits(7, seq_ids, pos, 12) for a WGSL port to reproduce: (seq_id, pos) -> the 12 words.
DRAW_VECTORS = {
    (0, 0): (4099963437, 3221879260, 490388034, 367897730, 3601212787, 1911217778, 986277210, 721406372, 911216622,
             3377014597, 327848435, 1789060405),
    (1, 3): (669835694, 2949763986, 3279757317, 2631124735, 382666324, 1454862036, 2516805170, 2371922959,
             2215997956, 2026674511, 1942113075, 2882536988),
    (2**33 + 5, 9): (2726824478, 3929304509, 345595840, 2431898451, 1203929004, 4154248309, 3264271213,
                     2142800491, 2750781190, 1092519039, 628524993, 1167101543),
}  # fmt: skip


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(26)


def test_philox_known_answers() -> None:
    for counter, key, want in KNOWN_ANSWERS:
        got = philox4x32(tuple(np.array(c) for c in counter), tuple(np.array(k) for k in key))
        assert tuple(int(x) for x in got) == want


def test_draw_bits_known_vectors_and_batch_independence() -> None:
    keys = list(DRAW_VECTORS)
    seq, pos = np.array([s for s, _ in keys], np.uint64), np.array([p for _, p in keys])
    got = draw_bits(7, seq, pos, N)
    for row, key in zip(got, keys, strict=True):
        assert tuple(int(x) for x in row) == DRAW_VECTORS[key]
    # each position's words depend on its key alone: not on the batch, its order or its split
    rev = draw_bits(7, seq[::-1], pos[::-1], N)
    np.testing.assert_array_equal(rev[::-1], got)
    np.testing.assert_array_equal(draw_bits(7, seq[1:2], pos[1:2], N)[0], got[1])
    assert (draw_bits(8, seq, pos, N) != got).mean() > 0.99  # another seed, other words
    np.testing.assert_array_equal(draw_bits(7, seq, pos, 5), got[:, :5])  # fewer draws: a prefix


def test_draw_rows_are_independent_of_the_batch(rng: np.random.Generator) -> None:
    z = 3 * rng.standard_normal((9, 50))
    seq, pos = rng.integers(0, 1000, 9), rng.integers(0, 512, 9)
    whole = sample_positions(z, 0.8, N, 3, seq, pos)
    halves = [sample_positions(z[s], 0.8, N, 3, seq[s], pos[s]) for s in (slice(0, 4), slice(4, 9))]
    for a, b in zip(whole, (np.concatenate(h) for h in zip(*halves, strict=True)), strict=True):
        np.testing.assert_array_equal(a, b)
    ids, counts, codes = whole
    assert (counts.sum(axis=1) == N).all()
    live = counts > 0
    for r in range(9):  # distinct ids ascending first, padding (0, 0, 0) after
        k = live[r].sum()
        assert live[r, :k].all() and not live[r, k:].any()
        assert (np.diff(ids[r, :k]) > 0).all() and (ids[r, k:] == 0).all() and (codes[r, k:] == 0).all()


def test_draw_follows_the_teacher(rng: np.random.Generator) -> None:
    """Counts over many positions against n p (chi-square), per row of three teachers (peaked, flat, tau)."""
    v, positions = 40, 4000
    for scale, tau in ((4.0, 1.0), (0.5, 1.0), (3.0, 2.0)):
        z = scale * rng.standard_normal(v)
        p = np.exp(z / tau - R.logsumexp(z / tau)[0])
        draws, logp = draw_from_logits(np.tile(z, (positions, 1)), tau, draw_bits(5, np.arange(positions),
                                                                               np.zeros(positions), N))  # fmt: skip
        np.testing.assert_allclose(logp, np.log(p)[draws], atol=1e-12)
        assert (np.diff(draws, axis=1) >= 0).all()  # the thresholds ascend
        seen = np.bincount(draws.ravel(), minlength=v)
        expect = positions * N * p
        big = expect > 5
        chi2 = np.sum((seen[big] - expect[big]) ** 2 / expect[big])
        dof = big.sum() - 1
        assert chi2 < dof + 5 * np.sqrt(2 * dof), (scale, tau, chi2, dof)  # stratified: at most the iid spread
        assert seen[~big].sum() < 5 * max(1.0, expect[~big].sum()) + 10
    zero = np.array([[0.0, -np.inf, 0.0]])  # a zero-mass id is never drawn
    with pytest.raises(ValueError, match="NaN or inf"):
        draw_from_logits(zero, 1.0, draw_bits(0, [0], [0], N))
    z = np.array([[0.0, -800.0, 0.0]])
    assert 1 not in draw_from_logits(np.tile(z, (100, 1)), 1.0, draw_bits(0, np.arange(100), np.zeros(100), N))[0]


def test_logp_code() -> None:
    lp = np.array([0.0, -0.01, -1.0, -2.53, -15.9, -40.0])
    back = logp_value(logp_code(lp))
    assert np.abs(back[:5] - lp[:5]).max() <= 1 / 32 + 1e-9
    assert back[-1] == pytest.approx(-255 / 16)


def test_encode_counts() -> None:
    draws = np.array([[1, 1, 4, 4, 4, 9], [2, 2, 2, 2, 2, 2]])
    ids, counts, codes = encode(draws, -np.ones(draws.shape))
    np.testing.assert_array_equal(ids, [[1, 4, 9, 0, 0, 0], [2, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(counts, [[2, 3, 1, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(codes, [[16, 16, 16, 0, 0, 0], [16, 0, 0, 0, 0, 0]])


# ---------------------------------------------------------------- the loss


def _sampled(z_teacher: np.ndarray, tau: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = z_teacher.shape[0]
    ids, counts, codes = sample_positions(z_teacher, tau, N, seed, np.zeros(t, np.int64), np.arange(t))
    return ids, counts, logp_value(codes)


@pytest.mark.parametrize("tau,ce", [(1.0, 0.0), (2.0, 0.5)])
def test_sampled_loss_finite_differences(rng: np.random.Generator, tau: float, ce: float) -> None:
    cfg = LossConfig("forward_kl", tau=tau, ce_weight=ce, samples=N)
    t, v = 6, 40
    z, zt = 2 * rng.standard_normal((t, v)), 2 * rng.standard_normal((t, v))
    ids, counts, lt = _sampled(zt, tau, 1)
    targets, mask = rng.integers(0, v, t), np.array([1, 0, 1, 1, 0, 1])
    args = (ids, lt, None, targets, mask, cfg)
    loss = R.kd_loss_forward(z, *args, teacher_counts=counts)
    # independently: tau^2 (1/n) sum counts (lt - log q) + ce CE, over masked rows
    lq = R.log_softmax(z / tau)
    kd = np.sum(counts / N * (lt - np.take_along_axis(lq, ids, axis=1)), axis=1)
    ce_rows = -R.log_softmax(z)[np.arange(t), targets]
    assert loss == pytest.approx(np.sum((tau**2 * kd + ce * ce_rows)[mask == 1]) / 4, rel=1e-12)
    dz = R.kd_loss_backward(z, *args, teacher_counts=counts)
    assert np.all(dz[mask == 0] == 0)
    assert fd_rel_error(lambda: R.kd_loss_forward(z, *args, teacher_counts=counts), z, dz, rng, n=40) < TOL


def test_sampled_loss_refuses_other_kinds() -> None:
    for kind in ("reverse_kl", "jsd"):
        with pytest.raises(ValueError, match="forward_kl"):
            LossConfig(kind, samples=N)
    with pytest.raises(ValueError, match="use_tail"):
        LossConfig("forward_kl", samples=N, use_tail=True)
    z = np.zeros((1, 5))
    with pytest.raises(ValueError, match="counts"):
        R.kd_loss_forward(z, np.zeros((1, N), int), np.zeros((1, N)), None, [0], [1], LossConfig(samples=N))


SEEDS = 3000


def test_sampled_gradient_is_unbiased(rng: np.random.Generator) -> None:
    """The logits gradient averaged over seeds matches the full-vocabulary forward-KL gradient within its
    measured standard error, entry by entry; prints the estimator's variance at n = 12."""
    tau, t, v = 1.5, 4, 60
    cfg = LossConfig("forward_kl", tau=tau, samples=N)
    z, zt = 2 * rng.standard_normal((t, v)), 2 * rng.standard_normal((t, v))
    targets, mask = np.zeros(t, int), np.ones(t)
    full_ids = np.tile(np.arange(v), (t, 1))
    full_lp = R.log_softmax(zt / tau)
    full = R.kd_loss_backward(z, full_ids, full_lp, None, targets, mask, LossConfig("forward_kl", tau=tau))
    full_loss = R.kd_loss_forward(z, full_ids, full_lp, None, targets, mask, LossConfig("forward_kl", tau=tau))
    grads, losses = np.empty((SEEDS, t, v)), np.empty(SEEDS)
    for s in range(SEEDS):
        ids, counts, lt = _sampled(zt, tau, s)
        grads[s] = R.kd_loss_backward(z, ids, lt, None, targets, mask, cfg, teacher_counts=counts)
        losses[s] = R.kd_loss_forward(z, ids, lt, None, targets, mask, cfg, teacher_counts=counts)
    mean, se = grads.mean(axis=0), grads.std(axis=0, ddof=1) / np.sqrt(SEEDS)
    live = se > 0
    zscore = (mean[live] - full[live]) / se[live]
    assert np.abs(zscore).max() < 4.5, np.abs(zscore).max()
    assert 0.8 < np.mean(zscore**2) < 1.2, np.mean(zscore**2)
    np.testing.assert_allclose(mean[~live], full[~live], atol=1e-3)  # ids never drawn: their p is ~0
    # the value: unbiased up to the log-prob code's rounding (<= 1/32 nat per draw)
    assert abs(losses.mean() - full_loss) < 4 * losses.std() / np.sqrt(SEEDS) + tau**2 / 32
    # variance at n = 12: of p_hat = counts / n (summed over the vocabulary, per position), beside n iid draws
    p = np.exp(full_lp)
    var_p = (grads.var(axis=0, ddof=1).sum(axis=1) / (tau / t) ** 2).mean()
    iid = ((1 - np.sum(p**2, axis=1)) / N).mean()
    print(f"\nsampled KD, n={N}: sum_v Var(c_v/n) per position {var_p:.4f} (iid draws: {iid:.4f}); "
          f"std of the per-batch loss estimate {losses.std():.4f} around {full_loss:.4f}")  # fmt: skip
    assert var_p <= iid * 1.05


def _tiny() -> ModelConfig:
    return ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, rope_base=100.0)


def test_sampled_lora_gradient_is_unbiased(rng: np.random.Generator) -> None:
    """On a tiny model with the teacher's full distribution: the sampled loss's LoRA gradient averaged over seeds
    matches the full-vocabulary forward-KL LoRA gradient along random directions, within 4 standard errors."""
    cfg, tau, seeds = _tiny(), 1.0, 200
    w, wt = R.random_weights(cfg, seed=0), R.random_weights(cfg, seed=1)
    lora = R.init_lora(cfg, list(LORA_TARGETS), r=4, seed=7, dtype=np.float64)
    for pair in lora.values():
        pair.B = 0.3 * rng.standard_normal(pair.B.shape)
    ids = rng.integers(0, cfg.vocab, 6)
    targets, mask = np.roll(ids, -1), np.ones(6)
    zt = R.forward(wt, cfg, ids)
    full_ids = np.tile(np.arange(cfg.vocab), (6, 1))
    full_cfg = LossConfig("forward_kl", tau=tau, ce_weight=0.3)
    args = (w, cfg, ids, lora, 2.0)

    def flat(grads: dict) -> np.ndarray:
        return np.concatenate([np.concatenate([a.ravel(), b.ravel()]) for _, (a, b) in sorted(grads.items())])

    full = flat(R.loss_and_grads(*args, full_ids, R.log_softmax(zt / tau), None, targets, mask, full_cfg)[1])
    dirs = rng.standard_normal((8, full.size))
    dirs[0] = full  # and the full gradient's own direction
    cfg_s = LossConfig("forward_kl", tau=tau, ce_weight=0.3, samples=N)
    proj = np.empty((seeds, len(dirs)))
    for s in range(seeds):
        sid, counts, lt = _sampled(zt, tau, s)
        g = R.loss_and_grads(*args, sid, lt, None, targets, mask, cfg_s, teacher_counts=counts)[1]
        proj[s] = dirs @ flat(g)
    zscore = (proj.mean(axis=0) - dirs @ full) / (proj.std(axis=0, ddof=1) / np.sqrt(seeds))
    assert np.abs(zscore).max() < 4, zscore
