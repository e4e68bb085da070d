"""Checks of the numpy reference: each backward against central finite differences in float64, each forward
against an independent formulation where one is cheap, and the whole model's LoRA gradients by finite
differences.

Error measure (per tensor): max |fd - analytic| / max |fd| over a random sample of entries; bound 1e-6.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.kd import LossConfig

TOL = 1e-6
STEP = 1e-5  # central-difference step in float64
N_SAMPLES = 20


def fd_rel_error(
    f: Callable[[], float], x: np.ndarray, analytic: np.ndarray, rng: np.random.Generator, n: int = N_SAMPLES
) -> float:
    """max |fd - analytic| / max |fd| over n random entries of x (x is perturbed in place and restored)."""
    assert analytic.shape == x.shape
    idx = rng.choice(x.size, size=min(n, x.size), replace=False)
    fd, an = [], []
    for i in idx:
        old = x.flat[i]
        x.flat[i] = old + STEP
        fp = f()
        x.flat[i] = old - STEP
        fm = f()
        x.flat[i] = old
        fd.append((fp - fm) / (2 * STEP))
        an.append(analytic.flat[i])
    fd, an = np.array(fd), np.array(an)
    scale = np.max(np.abs(fd))
    assert scale > 1e-8, "finite differences are ~0: the check would be vacuous"
    return float(np.max(np.abs(fd - an)) / scale)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------- per-op checks


def test_rmsnorm(rng: np.random.Generator) -> None:
    x, w, eps = rng.standard_normal((5, 12)), 1 + 0.2 * rng.standard_normal(12), 1e-5
    y = R.rmsnorm_forward(x, w, eps)
    # independent: y / w has unit mean square (up to eps), and is parallel to x row by row
    np.testing.assert_allclose(np.mean((y / w) ** 2, axis=-1), 1 / (1 + eps / np.mean(x**2, axis=-1)), rtol=1e-12)
    np.testing.assert_allclose((y / w) / x, np.broadcast_to(((y / w) / x)[:, :1], x.shape), rtol=1e-12)
    r = rng.standard_normal(y.shape)
    dx = R.rmsnorm_backward(r, x, w, eps)
    assert fd_rel_error(lambda: float(np.sum(R.rmsnorm_forward(x, w, eps) * r)), x, dx, rng) < TOL


def _hf_rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """HF transformers' llama RoPE (rotate_half: pairs (i, i + D/2)), written independently."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([positions[:, None] * inv] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _gguf_permute(x: np.ndarray) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation within each head: HF index s*D/2 + i -> GGUF index 2i + s."""
    t, h, d = x.shape
    return x.reshape(t, h, 2, d // 2).swapaxes(2, 3).reshape(t, h, d)


def test_rope(rng: np.random.Generator) -> None:
    t, h, d, base = 6, 3, 8, 10000.0
    x, pos = rng.standard_normal((t, h, d)), np.arange(t) + 3
    y = R.rope_forward(x, pos, base)
    # independent: complex multiplication of adjacent pairs
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * base ** (-np.arange(0, d, 2) / d))
    np.testing.assert_allclose(y[..., 0::2], z.real, atol=1e-12)
    np.testing.assert_allclose(y[..., 1::2], z.imag, atol=1e-12)
    # the GGUF (NORM, adjacent pairs) variant on GGUF-permuted rows == HF's rotate_half RoPE on HF rows
    np.testing.assert_allclose(R.rope_forward(_gguf_permute(x), pos, base), _gguf_permute(_hf_rope(x, pos, base)))
    r = rng.standard_normal(y.shape)
    dx = R.rope_backward(r, pos, base)
    np.testing.assert_allclose(dx, R.rope_forward(r, -pos, base), atol=1e-12)  # inverse rotation
    assert fd_rel_error(lambda: float(np.sum(R.rope_forward(x, pos, base) * r)), x, dx, rng) < TOL


def _attention_loop(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    t, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q)
    for h in range(hq):
        for i in range(t):
            s = np.array([q[i, h] @ k[j, h // group] for j in range(i + 1)]) / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(p[j] * v[j, h // group] for j in range(i + 1))
    return out


@pytest.mark.parametrize(("t", "hq", "hkv"), [(5, 4, 4), (6, 6, 2), (4, 4, 2), (1, 3, 1)])
def test_attention(rng: np.random.Generator, t: int, hq: int, hkv: int) -> None:
    d = 4
    q, k, v = (
        rng.standard_normal((t, hq, d)),
        rng.standard_normal((t, hkv, d)),
        rng.standard_normal((t, hkv, d)),
    )
    out = R.attention_forward(q, k, v)
    np.testing.assert_allclose(out, _attention_loop(q, k, v), atol=1e-12)
    r = rng.standard_normal(out.shape)
    grads = R.attention_backward(r, q, k, v)
    pairs = list(zip((q, k, v), grads, strict=True))
    if t == 1:  # one key: the probabilities are constant, so only v gets a gradient
        assert not np.any(grads[0]) and not np.any(grads[1])
        pairs = pairs[2:]
    for x, g in pairs:
        assert fd_rel_error(lambda: float(np.sum(R.attention_forward(q, k, v) * r)), x, g, rng) < TOL


def test_swiglu(rng: np.random.Generator) -> None:
    g, u = 3 * rng.standard_normal((4, 10)), rng.standard_normal((4, 10))
    g[0, :2] = [-800.0, 800.0]  # the sigmoid must not overflow
    y = R.swiglu_forward(g, u)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, atol=1e-12)
    g[0, :2] = [-1.0, 1.0]
    r = rng.standard_normal(y.shape)
    dg, du = R.swiglu_backward(r, g, u)
    for x, d in ((g, dg), (u, du)):
        assert fd_rel_error(lambda: float(np.sum(R.swiglu_forward(g, u) * r)), x, d, rng) < TOL


def test_linear_and_lora(rng: np.random.Generator) -> None:
    x, w = rng.standard_normal((5, 7)), rng.standard_normal((6, 7))
    a, b, s = rng.standard_normal((3, 7)), rng.standard_normal((6, 3)), 0.7
    # independent: the LoRA update is a rank-r weight delta (merged weight)
    y = R.linear_forward(x, w) + R.lora_forward(x, a, b, s)
    np.testing.assert_allclose(y, np.einsum("ti,oi->to", x, w + s * b @ a), atol=1e-12)
    r = rng.standard_normal(y.shape)
    dx_lin = R.linear_backward_input(r, w)
    assert fd_rel_error(lambda: float(np.sum(R.linear_forward(x, w) * r)), x, dx_lin, rng) < TOL
    grads = R.lora_backward(r, x, a, b, s)
    for t, g in zip((x, a, b), grads, strict=True):
        assert fd_rel_error(lambda: float(np.sum(R.lora_forward(x, a, b, s) * r)), t, g, rng) < TOL


def test_embedding_and_init_lora() -> None:
    table = np.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(R.embedding_forward(table, np.array([2, 0, 2])), table[[2, 0, 2]])
    cfg = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=50)
    lora = R.init_lora(cfg, ["q", "down"], r=4, seed=0)
    assert set(lora) == {(0, "q"), (1, "q"), (0, "down"), (1, "down")}
    pair = lora[(0, "down")]
    assert pair.A.shape == (4, 64) and pair.B.shape == (32, 4) and pair.A.dtype == np.float32
    assert np.all(pair.B == 0) and np.abs(pair.A).max() <= 1 / 8 and np.abs(pair.A).max() > 0.1
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        R.init_lora(cfg, ["q_proj"], r=4, seed=0)


# ---------------------------------------------------------------- KD loss


def _teacher(rng: np.random.Generator, t: int, v: int, k: int, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids and log-probs at temperature tau of a random teacher."""
    zt = 2 * rng.standard_normal((t, v))
    ids = np.argsort(-zt, axis=1)[:, :k]
    return ids, np.take_along_axis(R.log_softmax(zt / tau), ids, axis=1)


def _kd_naive(z: np.ndarray, ids: np.ndarray, lt: np.ndarray, target: np.ndarray, mask: np.ndarray, cfg: LossConfig):
    """Independent per-position formulation in the probability domain."""
    total, count = 0.0, 0
    for t in range(len(z)):
        if not mask[t]:
            continue
        count += 1
        q = np.exp(z[t] / cfg.tau - np.max(z[t] / cfg.tau))
        q /= q.sum()
        pk, qk = np.exp(lt[t]), q[ids[t]]
        if cfg.use_tail:
            p = np.append(pk, max(1 - pk.sum(), 0.0))
            qs = qhat = np.append(qk, 1 - qk.sum())
        else:
            p = pk / pk.sum()
            qs, qhat = qk, qk / qk.sum()
        if cfg.kind == "forward_kl":
            kd = np.sum(p * np.log(p / qs))
        elif cfg.kind == "reverse_kl":
            kd = np.sum(qhat * np.log(qhat / p))
        else:
            m = cfg.beta * p + (1 - cfg.beta) * qhat
            kd = cfg.beta * np.sum(p * np.log(p / m)) + (1 - cfg.beta) * np.sum(qhat * np.log(qhat / m))
        pz = np.exp(z[t] - z[t].max())
        ce = -np.log(pz[target[t]] / pz.sum())
        total += cfg.tau**2 * kd + cfg.ce_weight * ce
    return total / max(1, count)


LOSS_CASES = [
    LossConfig(kind, tau=tau, beta=0.5 if kind == "jsd" else 0.3, ce_weight=ce, use_tail=tail)
    for kind in ("forward_kl", "reverse_kl", "jsd")
    for tail in (False, True)
    for tau, ce in ((1.0, 0.0), (2.0, 0.5))
]


@pytest.mark.parametrize("cfg", LOSS_CASES, ids=str)
def test_kd_loss(rng: np.random.Generator, cfg: LossConfig) -> None:
    t, v, k = 6, 40, 5
    z = 2 * rng.standard_normal((t, v))
    ids, lt = _teacher(rng, t, v, k, cfg.tau)
    targets, mask = rng.integers(0, v, t), np.array([1, 0, 1, 1, 0, 1])
    tail = -np.expm1(R.logsumexp(lt)[:, 0])
    args = (ids, lt, tail if cfg.use_tail else None, targets, mask, cfg)
    loss = R.kd_loss_forward(z, *args)
    np.testing.assert_allclose(loss, _kd_naive(z, ids, lt, targets, mask, cfg), rtol=1e-10)
    assert R.kd_loss_forward(z, ids, lt, None, targets, mask, cfg) == pytest.approx(loss, rel=1e-12)
    dz = R.kd_loss_backward(z, *args)
    assert np.all(dz[mask == 0] == 0)
    assert fd_rel_error(lambda: R.kd_loss_forward(z, *args), z, dz, rng, n=40) < TOL
    # the gradient concentrates on the teacher's ids: sample those too
    hot = np.zeros(z.shape, dtype=bool)
    np.put_along_axis(hot, ids, True, axis=1)
    sub = z[hot].copy()

    def f_hot() -> float:
        zz = z.copy()
        zz[hot] = sub
        return R.kd_loss_forward(zz, *args)

    assert fd_rel_error(f_hot, sub, dz[hot], rng, n=20) < TOL


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_kd_zero_when_student_matches(rng: np.random.Generator, kind: str) -> None:
    """With the tail bucket, a teacher equal to the student gives KD = 0 and zero gradient, for every kind."""
    cfg = LossConfig(kind, tau=1.5, use_tail=True)
    z = rng.standard_normal((4, 30))
    ids = np.argsort(-z, axis=1)[:, :6]
    lt = np.take_along_axis(R.log_softmax(z / cfg.tau), ids, axis=1)
    mask = np.ones(4)
    assert abs(R.kd_loss_forward(z, ids, lt, None, ids[:, 0], mask, cfg)) < 1e-12
    assert np.abs(R.kd_loss_backward(z, ids, lt, None, ids[:, 0], mask, cfg)).max() < 1e-12
    # without the tail, forward KL against the un-renormalised q[ids] is -log(sum q[ids]) > 0
    cfg_nt = LossConfig("forward_kl", tau=1.5)
    mass = np.exp(R.logsumexp(lt))[:, 0]
    np.testing.assert_allclose(
        R.kd_loss_forward(z, ids, lt, None, ids[:, 0], mask, cfg_nt), 1.5**2 * np.mean(-np.log(mass))
    )


def test_kd_guards(rng: np.random.Generator) -> None:
    """Zero teacher tail, student with ~all mass on the ids, float32 logits, all-zero mask: all finite."""
    z = rng.standard_normal((3, 20))
    ids = np.array([[0, 1], [2, 3], [4, 5]])
    np.put_along_axis(z, ids, 80.0, axis=1)  # student tail mass ~exp(-80): floored at EPS
    lt = np.log(np.array([[0.5, 0.5], [0.9, 0.1], [1.0, 1e-30]]))  # teacher tail exactly 0
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        for use_tail in (False, True):
            cfg = LossConfig(kind, use_tail=use_tail, ce_weight=0.1)
            for zz in (z, z.astype(np.float32)):
                args = (ids, lt, None, np.zeros(3, int), np.ones(3), cfg)
                assert np.isfinite(R.kd_loss_forward(zz, *args))
                dz = R.kd_loss_backward(zz, *args)
                assert dz.dtype == zz.dtype and np.all(np.isfinite(dz))
    cfg = LossConfig("jsd", use_tail=True)
    args = (ids, lt, None, np.zeros(3, int), np.zeros(3), cfg)
    assert R.kd_loss_forward(z, *args) == 0.0 and not np.any(R.kd_loss_backward(z, *args))
    with pytest.raises(ValueError, match="kind"):
        LossConfig("kl")
    with pytest.raises(ValueError, match="beta"):
        LossConfig("jsd", beta=1.0)


# ---------------------------------------------------------------- whole model


def _tiny(tied: bool = True) -> ModelConfig:
    return ModelConfig(
        n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, rope_base=100.0, tied_embeddings=tied
    )


def _lora_random_b(cfg: ModelConfig, rng: np.random.Generator) -> dict:
    lora = R.init_lora(cfg, list(LORA_TARGETS), r=4, seed=7, dtype=np.float64)
    for pair in lora.values():
        pair.B = 0.3 * rng.standard_normal(pair.B.shape)  # non-zero B, else dA = 0
    return lora


def test_model_lora_is_merged_weight(rng: np.random.Generator) -> None:
    """Independent check of where each LoRA enters: forward with adapters == forward on W + s B A."""
    cfg = _tiny(tied=False)
    w = R.random_weights(cfg, seed=0)
    ids = rng.integers(0, cfg.vocab, 7)
    lora, s = _lora_random_b(cfg, rng), 2.0
    merged = dict(w)
    for (layer, t), pair in lora.items():
        name = f"blk.{layer}.{LORA_TARGETS[t]}.weight"
        merged[name] = w[name] + s * pair.B @ pair.A
    logits = R.forward(w, cfg, ids, lora, s)
    np.testing.assert_allclose(logits, R.forward(merged, cfg, ids), atol=1e-10)
    assert np.abs(logits - R.forward(w, cfg, ids)).max() > 1e-2
    zero_b = R.init_lora(cfg, list(LORA_TARGETS), r=4, seed=7, dtype=np.float64)
    np.testing.assert_array_equal(R.forward(w, cfg, ids, zero_b, s), R.forward(w, cfg, ids))
    assert 0.5 < logits.std() < 5  # O(1) activations from random_weights
    # causal: logits at position t do not depend on later tokens
    np.testing.assert_allclose(R.forward(w, cfg, ids[:4], lora, s), logits[:4], atol=1e-12)
    new = R.greedy_generate(w, cfg, ids, 2, lora, s)
    assert new[0] == int(np.argmax(logits[-1])) and len(new) == 2


MODEL_CASES = [
    (LossConfig("forward_kl", tau=1.0, ce_weight=0.0, use_tail=False), True),
    (LossConfig("forward_kl", tau=2.0, ce_weight=0.5, use_tail=True), False),
    (LossConfig("reverse_kl", tau=1.0, ce_weight=0.0, use_tail=False), True),
    (LossConfig("reverse_kl", tau=0.7, ce_weight=0.3, use_tail=True), True),
    (LossConfig("jsd", tau=1.5, beta=0.5, ce_weight=0.2, use_tail=False), False),
    (LossConfig("jsd", tau=1.0, beta=0.5, ce_weight=0.0, use_tail=True), True),
]


@pytest.mark.parametrize(("loss_cfg", "tied"), MODEL_CASES, ids=lambda c: str(c))
def test_model_lora_grads(rng: np.random.Generator, loss_cfg: LossConfig, tied: bool) -> None:
    cfg = _tiny(tied)
    w = R.random_weights(cfg, seed=3)
    t, k, s = 7, 8, 2.0
    ids = rng.integers(0, cfg.vocab, t)
    lora = _lora_random_b(cfg, rng)
    teacher_ids, teacher_lp = _teacher(rng, t, cfg.vocab, k, loss_cfg.tau)
    tail = -np.expm1(R.logsumexp(teacher_lp)[:, 0]) if loss_cfg.use_tail else None
    targets = np.append(ids[1:], rng.integers(0, cfg.vocab))
    mask = np.array([1, 1, 0, 1, 1, 0, 1])
    args = (teacher_ids, teacher_lp, tail, targets, mask, loss_cfg)
    loss, grads = R.loss_and_grads(w, cfg, ids, lora, s, *args)
    assert set(grads) == set(lora)

    def f() -> float:
        return R.kd_loss_forward(R.forward(w, cfg, ids, lora, s), *args)

    assert f() == loss
    worst = 0.0
    for key, pair in lora.items():
        for x, g in zip((pair.A, pair.B), grads[key], strict=True):
            err = fd_rel_error(f, x, g, rng)
            assert err < TOL, (key, err)
            worst = max(worst, err)
    print(f"{loss_cfg}: max FD rel error {worst:.2e}")


def test_model_float32_follows_inputs(rng: np.random.Generator) -> None:
    """float32 weights and adapters (float16 teacher log-probs, as stored) keep the computation in float32."""
    cfg = _tiny()
    w64, w32 = R.random_weights(cfg, seed=3), R.random_weights(cfg, seed=3, dtype=np.float32)
    lora64 = _lora_random_b(cfg, rng)
    lora32 = {key: R.LoraPair(p.A.astype(np.float32), p.B.astype(np.float32)) for key, p in lora64.items()}
    ids = rng.integers(0, cfg.vocab, 7)
    logits32 = R.forward(w32, cfg, ids, lora32, 2.0)
    assert logits32.dtype == np.float32
    np.testing.assert_allclose(logits32, R.forward(w64, cfg, ids, lora64, 2.0), atol=1e-4)
    loss_cfg = LossConfig("jsd", tau=2.0, ce_weight=0.5, use_tail=True)
    teacher_ids, teacher_lp = _teacher(rng, 7, cfg.vocab, 8, loss_cfg.tau)
    args = (teacher_ids.astype(np.uint16), teacher_lp.astype(np.float16), None, ids, np.ones(7), loss_cfg)
    loss32, g32 = R.loss_and_grads(w32, cfg, ids, lora32, 2.0, *args)
    loss64, g64 = R.loss_and_grads(w64, cfg, ids, lora64, 2.0, *args)
    assert loss32 == pytest.approx(loss64, rel=1e-4)
    for key in g64:
        for a32, a64 in zip(g32[key], g64[key], strict=True):
            assert a32.dtype == np.float32
            np.testing.assert_allclose(a32, a64, atol=1e-4 * np.abs(a64).max())


# ---------------------------------------------------------------- model families (qwen2, qwen3, Llama 3 RoPE)


def _llama3_factors(d: int, base: float) -> np.ndarray:
    """Llama 3 scaling factors of a tiny head (original context 32): some kept, some blended, some divided."""
    from model.gguf import llama3_rope_factors

    f = llama3_rope_factors(d, base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=32)
    assert f.min() == 1.0 and f.max() == 8.0 and np.any((f > 1) & (f < 8))
    return f.astype(np.float64)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_variants(rng: np.random.Generator, neox: bool, scaled: bool) -> None:
    """NEOX pairs (x[i], x[i + D/2]) and Llama 3 frequency factors: forward against complex multiplication with
    HF's llama3 inverse frequencies (written independently), backward by finite differences and inversion."""
    t, h, d, base = 6, 3, 8, 10.0
    x, pos = rng.standard_normal((2, t, h, d)), np.arange(t) + 3
    factors = _llama3_factors(d, base) if scaled else None
    y = R.rope_forward(x, pos, base, factors, neox)
    inv = base ** (-np.arange(0, d, 2) / d)
    if scaled:  # transformers' _compute_llama3_parameters (original context 32, factor 8, low 1, high 4)
        wavelen = 2 * np.pi / inv
        llama = np.where(wavelen > 32.0, inv / 8.0, inv)
        smooth = (32.0 / wavelen - 1.0) / 3.0
        medium = (wavelen >= 8.0) & (wavelen <= 32.0)
        inv = np.where(medium, (1 - smooth) * llama / 8.0 + smooth * llama, llama)
    first, second = (slice(0, d // 2), slice(d // 2, d)) if neox else (slice(0, d, 2), slice(1, d, 2))
    z = (x[..., first] + 1j * x[..., second]) * np.exp(1j * pos[:, None, None] * inv)
    atol = 1e-6 if scaled else 1e-12  # the factors are stored f32 (rope_freqs.weight), HF's formula is exact
    np.testing.assert_allclose(y[..., first], z.real, atol=atol)
    np.testing.assert_allclose(y[..., second], z.imag, atol=atol)
    r = rng.standard_normal(y.shape)
    dx = R.rope_backward(r, pos, base, factors, neox)
    np.testing.assert_allclose(dx, R.rope_forward(r, -pos, base, factors, neox), atol=1e-12)
    assert fd_rel_error(lambda: float(np.sum(R.rope_forward(x, pos, base, factors, neox) * r)), x, dx, rng) < TOL


def test_qk_norm_is_rmsnorm_per_head(rng: np.random.Generator) -> None:
    """qwen3's q/k norm: RMSNorm over each head's D entries with one weight [D] shared by the heads."""
    x, w, eps = rng.standard_normal((2, 5, 3, 8)), 1 + 0.2 * rng.standard_normal(8), 1e-6
    y = R.rmsnorm_forward(x, w, eps)
    for head in range(3):
        xh = x[:, :, head]
        np.testing.assert_allclose(y[:, :, head], xh / np.sqrt(np.mean(xh**2, -1, keepdims=True) + eps) * w)
    r = rng.standard_normal(y.shape)
    dx = R.rmsnorm_backward(r, x, w, eps)
    assert fd_rel_error(lambda: float(np.sum(R.rmsnorm_forward(x, w, eps) * r)), x, dx, rng) < TOL


def test_projection_bias(rng: np.random.Generator) -> None:
    """qwen2's q/k/v bias: added after the projection; dX is the unbiased one (the bias is frozen)."""
    x, w, b = rng.standard_normal((2, 5, 7)), rng.standard_normal((6, 7)), rng.standard_normal(6)
    pair = R.LoraPair(rng.standard_normal((3, 7)), rng.standard_normal((6, 3)))
    y = R.project_forward(x, w, pair, 0.5, b)
    np.testing.assert_allclose(y - R.project_forward(x, w, pair, 0.5), np.broadcast_to(b, y.shape), atol=1e-12)
    r = rng.standard_normal(y.shape)
    dx, (da, db) = R.project_backward(r, x, w, pair, 0.5)
    for t, g in ((x, dx), (pair.A, da), (pair.B, db)):
        assert fd_rel_error(lambda: float(np.sum(R.project_forward(x, w, pair, 0.5, b) * r)), t, g, rng) < TOL


# gemma3's pieces: post-norms, GeGLU, sqrt(hidden) embedding scale, q/k norms, head_dim 16 != 32 / 4, its own
# attention scale, block 0 sliding (window 3 of 7 positions, RoPE base 10) and block 1 global (base 100)
GEMMA3_CASE = {
    "arch": "gemma3",
    "rope_type": "neox",
    "qk_norm": True,
    "head_dim": 16,
    "post_norms": True,
    "activation": "gelu_tanh",
    "embedding_scale": float(np.sqrt(32)),
    "query_pre_attn_scalar": 24.0,
    "attention_windows": (3, 0),
    "rope_local_base": 10.0,
    "rope_linear_factor": 4.0,  # the global block's angles / 4 (the 4B+ models' linear scaling)
}
FAMILY_CASES = {
    "qwen2": {"arch": "qwen2", "rope_type": "neox", "qkv_bias": True},
    "qwen3": {"arch": "qwen3", "rope_type": "neox", "qk_norm": True, "head_dim": 16},
    "llama3": {"rope_freq_factors": tuple(_llama3_factors(8, 100.0))},
    "gemma3": GEMMA3_CASE,
}


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_family_model_lora_grads(rng: np.random.Generator, family: str) -> None:
    """Whole-model LoRA gradients by finite differences for each family's pieces, on one sequence and on a
    batch of two (the batched reference ops)."""
    cfg = ModelConfig(
        n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, rope_base=100.0, **FAMILY_CASES[family]
    )
    w = R.random_weights(cfg, seed=3)
    assert ("blk.0.attn_q.bias" in w) == cfg.qkv_bias and ("blk.1.attn_k_norm.weight" in w) == cfg.qk_norm
    assert ("blk.1.post_ffw_norm.weight" in w) == ("blk.0.post_attention_norm.weight" in w) == cfg.post_norms
    s, k = 2.0, 8
    ids = rng.integers(0, cfg.vocab, (2, 7))
    lora = _lora_random_b(cfg, rng)
    loss_cfg = LossConfig("jsd", tau=1.5, beta=0.5, ce_weight=0.2, use_tail=True)
    t_ids, t_lp = _teacher(rng, 14, cfg.vocab, k, loss_cfg.tau)
    t_ids, t_lp = t_ids.reshape(2, 7, k), t_lp.reshape(2, 7, k)
    targets, mask = rng.integers(0, cfg.vocab, (2, 7)), (rng.random((2, 7)) < 0.8).astype(float)
    args = (t_ids, t_lp, None, targets, mask, loss_cfg)
    loss, grads = R.loss_and_grads(w, cfg, ids, lora, s, *args)

    flat = (t_ids.reshape(-1, k), t_lp.reshape(-1, k), None, targets.reshape(-1), mask.reshape(-1), loss_cfg)

    def f() -> float:
        return R.kd_loss_forward(R.forward(w, cfg, ids, lora, s).reshape(-1, cfg.vocab), *flat)

    assert f() == pytest.approx(loss, rel=1e-12)
    worst = 0.0
    for key in [(0, "q"), (0, "k"), (1, "q"), (1, "k"), (1, "v"), (0, "down")]:
        for x, g in zip((lora[key].A, lora[key].B), grads[key], strict=True):
            err = fd_rel_error(f, x, g, rng, n=10)
            assert err < TOL, (key, err)
            worst = max(worst, err)
    # the batch is two independent sequences
    np.testing.assert_allclose(R.forward(w, cfg, ids, lora, s)[1], R.forward(w, cfg, ids[1], lora, s), atol=1e-12)
    print(f"{family}: max FD rel error {worst:.2e}")


# ---------------------------------------------------------------- gemma3's pieces, one by one


def test_geglu(rng: np.random.Generator) -> None:
    """GELU's tanh form times u: forward within the approximation's 1e-3 of the exact GELU g * Phi(g) (erf) and
    exactly HF's gelu_pytorch_tanh formula at points where tanh saturates; backward by finite differences."""
    from math import erf

    g, u = 3 * rng.standard_normal((4, 10)), rng.standard_normal((4, 10))
    g[0, :2] = [-30.0, 30.0]
    y = R.geglu_forward(g, u)
    exact = g * 0.5 * (1 + np.vectorize(erf)(g / np.sqrt(2)))
    assert np.abs(y - exact * u).max() < 1e-3 * np.abs(u).max()
    np.testing.assert_allclose(y[0, :2], [0.0, 30.0 * u[0, 1]], atol=1e-12)
    r = rng.standard_normal(y.shape)
    dg, du = R.geglu_backward(r, g, u)
    for x, d in ((g, dg), (u, du)):
        assert fd_rel_error(lambda: float(np.sum(R.geglu_forward(g, u) * r)), x, d, rng) < TOL
    assert R.gate_forward("gelu_tanh", g, u) is not None and np.array_equal(
        R.gate_forward("silu", g, u), R.swiglu_forward(g, u)
    )


def _window_attention_loop(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float) -> np.ndarray:
    """Query i attends keys max(0, i - window + 1)..i (window 0: all of 0..i), scores times `scale`."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q)
    for h in range(hq):
        for i in range(t):
            keys = range(max(0, i - window + 1) if window else 0, i + 1)
            s = np.array([q[i, h] @ k[j, h // group] for j in keys]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[j, h // group] for pj, j in zip(p, keys, strict=True))
    return out


@pytest.mark.parametrize("window", [1, 3, 0])
def test_attention_window_and_scale(rng: np.random.Generator, window: int) -> None:
    t, hq, hkv, d, scale = 7, 4, 2, 4, 0.3
    q, k, v = rng.standard_normal((t, hq, d)), rng.standard_normal((t, hkv, d)), rng.standard_normal((t, hkv, d))
    out = R.attention_forward(q, k, v, window, scale)
    np.testing.assert_allclose(out, _window_attention_loop(q, k, v, window, scale), atol=1e-12)
    if window == 1:  # each query sees only itself
        np.testing.assert_allclose(out, np.repeat(v, hq // hkv, axis=1), atol=1e-12)
    r = rng.standard_normal(out.shape)
    grads = R.attention_backward(r, q, k, v, window, scale)
    pairs = list(zip((q, k, v), grads, strict=True))[2 if window == 1 else 0 :]
    for x, g in pairs:
        assert fd_rel_error(lambda: float(np.sum(R.attention_forward(q, k, v, window, scale) * r)), x, g, rng) < TOL


def test_gemma3_embedding_scale_rope_bases_and_post_norms(rng: np.random.Generator) -> None:
    """embed multiplies by sqrt(hidden) in the table's dtype (float32: the float32-rounded constant, as HF); a
    sliding-window block takes rope_local_base, a global one rope_base; each post-norm is in the block."""
    cfg = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, rope_base=100.0, **GEMMA3_CASE)
    table = rng.standard_normal((300, 32)).astype(np.float32)
    ids = np.array([3, 299, 0])
    got = R.embed({"token_embd.weight": table}, cfg, ids)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, table[ids] * np.float32(np.sqrt(32)))
    assert cfg.window(0) == 3 and cfg.window(1) == 0 and cfg.attention_scale == pytest.approx(24.0**-0.5, rel=1e-15)
    assert (R.rope_args(cfg, 0)["base"], R.rope_args(cfg, 0)["factors"]) == (10.0, None)
    assert (R.rope_args(cfg, 1)["base"], R.rope_args(cfg, 1)["factors"]) == (100.0, (4.0,) * 8)
    assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(cfg.block_tensors(1))
    w = R.random_weights(cfg, seed=1)
    x = rng.standard_normal((7, 32))
    base = R.block_forward(x, w, cfg, 0, {}, 1.0)[0]
    for name in ("post_attention_norm", "post_ffw_norm"):
        changed = dict(w)
        changed[f"blk.0.{name}.weight"] = 2 * w[f"blk.0.{name}.weight"]
        assert np.abs(R.block_forward(x, changed, cfg, 0, {}, 1.0)[0] - base).max() > 0.1, name
