"""Fused lm_head + KD loss (gpu/ops/kd.py) vs model/kd.py in float64: every loss kind, tail on/off (given or
derived), temperature, CE weight, masked rows, several vocab chunks with a partial last one; bitwise repeatable.
Both backwards: two passes over the logits (an f32 head, or a scratch without `hidden`) and one (a quantized head
and a scratch with `hidden`; CE only at tau = 1)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gpu.device import Device
from gpu.ops.half import to_f16
from gpu.ops.kd import KdScratch, kd_head_forward_backward
from gpu.ops.topk import TopKState, hidden_topk, topk_chunk, topk_finish
from gpu.weights import quantize_upload
from model.kd import LossConfig, kd_loss_backward, kd_loss_forward, log_softmax
from model.quant import dequantize, quantize
from tests.gpu_fixtures import tensor_core_device_or_skip
from tests.gpu_helpers import make_device, rel_err, twice, up

pytestmark = pytest.mark.gpu
TOL = 1e-4
TC_TOL = 1e-2  # tensor-core head: f16 operands (h, W, the scaled dlogits), f32 accumulation


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _teacher(rng: np.random.Generator, t: int, v: int, k: int, tau: float) -> tuple[np.ndarray, ...]:
    """Top-k ids, log-probs at tau and tail of a random teacher."""
    z = rng.standard_normal((t, v)) * 3.0
    lp = log_softmax(z / tau)
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    lt = np.take_along_axis(lp, ids, axis=1)
    tail = np.maximum(0.0, 1.0 - np.exp(lt).sum(axis=1))
    return ids.astype(np.uint32), lt.astype(np.float32), tail.astype(np.float32)


CASES = [
    # kind, use_tail, tau, ce_weight, tail given, beta, T
    ("forward_kl", False, 1.0, 0.0, True, 0.5, 6),
    ("forward_kl", True, 2.0, 0.3, True, 0.5, 6),
    ("forward_kl", True, 1.0, 0.0, False, 0.5, 1),
    ("reverse_kl", False, 2.0, 0.3, True, 0.5, 6),
    ("reverse_kl", True, 1.0, 0.0, True, 0.5, 6),
    ("jsd", False, 1.0, 0.5, True, 0.3, 6),
    ("jsd", True, 2.0, 0.0, False, 0.7, 6),
]


@pytest.mark.parametrize("kind,use_tail,tau,ce,tail_given,beta,t", CASES)
def test_kd_head(dev: Device, kind: str, use_tail: bool, tau: float, ce: float, tail_given: bool, beta: float, t: int):
    rng = np.random.default_rng(CASES.index((kind, use_tail, tau, ce, tail_given, beta, t)))
    h_dim, v, k, chunk = 32, 300, 8, 128
    cfg = LossConfig(kind=kind, tau=tau, beta=beta, ce_weight=ce, use_tail=use_tail)
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    w = (rng.standard_normal((v, h_dim)) * 3.0 / np.sqrt(h_dim)).astype(np.float32)
    ids, lt, tail = _teacher(rng, t, v, k, tau)
    targets = rng.integers(0, v, t).astype(np.uint32)
    mask = np.ones(t, np.uint32) if t == 1 else np.array([1, 1, 0, 1, 1, 0] * t, np.uint32)[:t]
    bufs = [up(dev, a, a.dtype) for a in (h, w, ids, lt, tail, targets, mask)]
    hb, wb, idb, ltb, tailb, tgb, mb = bufs
    scratch = KdScratch.build(dev, t, k, chunk)

    def run() -> list[np.ndarray]:
        dh, loss = dev.buffer(h.nbytes), dev.buffer(8)
        tail_arg = tailb if tail_given else None
        kd_head_forward_backward(
            dev, hb, wb, idb, ltb, tail_arg, tgb, mb, cfg, dh, loss, t, h_dim, v, k, scratch=scratch, loss_index=1
        )
        return [dev.read(loss, np.float32, (2,)), dev.read(dh, np.float32, h.shape)]

    loss, dh = twice(run)
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    args = (ids, lt.astype(np.float64), tail.astype(np.float64) if tail_given else None, targets, mask, cfg)
    want_loss = kd_loss_forward(logits, *args)
    want_dh = kd_loss_backward(logits, *args) @ w.astype(np.float64)
    assert abs(loss[1] - want_loss) <= TOL * abs(want_loss), (loss[1], want_loss)
    assert rel_err(dh, want_dh) <= TOL
    assert np.all(dh[mask == 0] == 0)
    row_loss = dev.read(scratch.row_loss, np.float32, (t,))
    assert abs(row_loss.astype(np.float64).sum() - want_loss) <= TOL * abs(want_loss)


def _ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels gpu/ops/kd.py (and gpu/ops/half.py, which it calls) ask for from now on."""
    from gpu.ops import half, kd

    names: list[str] = []
    real = kd.pipeline

    def spy(dev: Device, name: str, **variant: object) -> object:
        names.append(name)
        return real(dev, name, **variant)

    monkeypatch.setattr(kd, "pipeline", spy)
    monkeypatch.setattr(half, "pipeline", spy)
    return names


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("kind,use_tail,tau,ce,tail_given,beta,t", CASES)
def test_kd_head_one_pass(
    dev: Device,
    monkeypatch: pytest.MonkeyPatch,
    qtype: str,
    kind: str,
    use_tail: bool,
    tau: float,
    ce: float,
    tail_given: bool,
    beta: float,
    t: int,
) -> None:
    """A quantized head (Q8_0; Q6_K as the Llama 3 GGUFs store it) with a scratch built with `hidden`: the loss
    and dh = c U + the rows at the ids within TOL of float64 on the dequantized head, masked rows zero, bitwise
    repeatable, one logits pass (kd_finish ran); CE at tau != 1 keeps the two passes, as accurate."""
    from gpu.weights import random_blocks, upload_quant

    rng = np.random.default_rng(100 + CASES.index((kind, use_tail, tau, ce, tail_given, beta, t)))
    h_dim, v, k, chunk = 256, 300, 8, 128
    wtype = GGMLQuantizationType[qtype]
    cfg = LossConfig(kind=kind, tau=tau, beta=beta, ce_weight=ce, use_tail=use_tail)
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    if wtype == GGMLQuantizationType.Q6_K:
        raw = random_blocks(wtype, (v, h_dim), rng)
        wq = upload_quant(dev, raw, wtype, (v, h_dim), "head_q6_k")
        w_deq = dequantize(raw, wtype, (v, h_dim))
        h = (h * 3.0 / (h @ w_deq.T).std()).astype(np.float32)  # logits of std 3, as the Q8_0 head's
    else:
        w = (rng.standard_normal((v, h_dim)) * 3.0 / np.sqrt(h_dim)).astype(np.float32)
        wq = quantize_upload(dev, w, wtype, name="head_q8_0")
        w_deq = dequantize(quantize(w, wtype), wtype, (v, h_dim))
    ids, lt, tail = _teacher(rng, t, v, k, tau)
    targets = rng.integers(0, v, t).astype(np.uint32)
    mask = np.ones(t, np.uint32) if t == 1 else np.array([1, 1, 0, 1, 1, 0] * t, np.uint32)[:t]
    hb, idb, ltb, tailb, tgb, mb = (up(dev, a, a.dtype) for a in (h, ids, lt, tail, targets, mask))
    scratch = KdScratch.build(dev, t, k, chunk, hidden=h_dim, half=False)
    ran = _ran(monkeypatch)

    def run() -> list[np.ndarray]:
        dh, loss = dev.buffer(h.nbytes), dev.buffer(4)
        kd_head_forward_backward(
            dev, hb, wq, idb, ltb, tailb if tail_given else None, tgb, mb, cfg, dh, loss, t, h_dim, v, k,
            scratch=scratch,
        )  # fmt: skip
        return [dev.read(loss, np.float32, (1,)), dev.read(dh, np.float32, h.shape)]

    loss, dh = twice(run)
    one_pass = ce == 0 or tau == 1.0
    assert ("kd_finish" in ran) == one_pass and ("kd_grad" in ran) != one_pass
    logits = h.astype(np.float64) @ w_deq.astype(np.float64).T
    args = (ids, lt.astype(np.float64), tail.astype(np.float64) if tail_given else None, targets, mask, cfg)
    want_loss = kd_loss_forward(logits, *args)
    want_dh = kd_loss_backward(logits, *args) @ w_deq.astype(np.float64)
    assert abs(loss[0] - want_loss) <= TOL * abs(want_loss), (loss[0], want_loss)
    assert rel_err(dh, want_dh) <= TOL, rel_err(dh, want_dh)
    assert np.all(dh[mask == 0] == 0)


@pytest.mark.tensorcore
@pytest.mark.parametrize("decoded", [False, True], ids=["staged", "decoded"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_kd_head_backward_on_tensor_cores(monkeypatch: pytest.MonkeyPatch, tau: float, decoded: bool) -> None:
    """With h16, a quantized head and a scratch built with `hidden`, the backward's products run on tensor cores:
    at tau 1 in one pass (the chunks' probabilities against the running max, f16 times 2^15), at tau 2 with CE in
    two (dlogits scaled into f16's range). Loss and dh within TC_TOL of float64 (logits from the f16-rounded h and
    the dequantized head, relative to dh's max), masked rows exactly zero, several chunks (a partial last one);
    decoded: each chunk's rows decoded to f16 once (KdScratch w16) for both products, as accurate."""
    tc_dev = tensor_core_device_or_skip()
    rng = np.random.default_rng(9)
    t, h_dim, v, k, chunk = 64, 256, 1000, 16, 384
    cfg = LossConfig(kind="forward_kl", tau=tau, ce_weight=0.2, use_tail=True)
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    w = (rng.standard_normal((v, h_dim)) * 2.0 / np.sqrt(h_dim)).astype(np.float32)
    wq = quantize_upload(tc_dev, w, GGMLQuantizationType.Q8_0, name="kd_head_q8")
    w_deq = dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, (v, h_dim))
    ids, lt, tail = _teacher(rng, t, v, k, tau)
    targets = rng.integers(0, v, t).astype(np.uint32)
    mask = (np.arange(t) % 7 != 3).astype(np.uint32)
    hb, idb, ltb, tailb, tgb, mb = (up(tc_dev, a, a.dtype) for a in (h, ids, lt, tail, targets, mask))
    h16 = tc_dev.buffer(2 * h.size)
    assert to_f16(tc_dev, hb, h16, h.size)
    scratch = KdScratch.build(tc_dev, t, k, chunk, hidden=h_dim, decoded_chunk=decoded)
    assert scratch.dz16 is not None and (scratch.w16 is not None) == decoded
    ran = _ran(monkeypatch)
    dh, loss = tc_dev.buffer(h.nbytes), tc_dev.buffer(4)
    kd_head_forward_backward(
        tc_dev, hb, wq, idb, ltb, tailb, tgb, mb, cfg, dh, loss, t, h_dim, v, k, scratch=scratch, h16=h16
    )
    got_dh = tc_dev.read(dh, np.float32, h.shape)
    w64 = w_deq.astype(np.float16).astype(np.float64)
    logits = h.astype(np.float16).astype(np.float64) @ w64.T
    args = (ids, lt.astype(np.float64), tail.astype(np.float64), targets, mask, cfg)
    want_loss, want_dh = kd_loss_forward(logits, *args), kd_loss_backward(logits, *args) @ w64
    got_loss = float(tc_dev.read(loss, np.float32, (1,))[0])
    err = rel_err(got_dh, want_dh)
    loss_err = abs(got_loss - want_loss) / abs(want_loss)
    print(f"kd head on tensor cores, tau {tau}, decoded {decoded}: loss rel err {loss_err:.1e}, dh {err:.1e}")
    assert ("kd_stats_probs16" in ran) == (tau == 1.0)
    assert ("weight_f16" in ran) == decoded
    assert abs(got_loss - want_loss) <= TC_TOL * abs(want_loss)
    assert err <= TC_TOL
    assert np.all(got_dh[mask == 0] == 0)


def test_kd_head_accumulates_dh(dev: Device) -> None:
    rng = np.random.default_rng(5)
    t, h_dim, v, k = 3, 16, 40, 4
    cfg = LossConfig()
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    w = rng.standard_normal((v, h_dim)).astype(np.float32)
    ids, lt, tail = _teacher(rng, t, v, k, 1.0)
    targets, mask = np.zeros(t, np.uint32), np.ones(t, np.uint32)
    prev = rng.standard_normal((t, h_dim)).astype(np.float32)
    dh, loss = up(dev, prev), dev.buffer(4)
    bufs = [up(dev, a, a.dtype) for a in (h, w, ids, lt, tail, targets, mask)]
    kd_head_forward_backward(dev, *bufs, cfg, dh, loss, t, h_dim, v, k, chunk=16, accumulate_dh=True)
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    want = prev + kd_loss_backward(logits, ids, lt.astype(np.float64), tail, targets, mask, cfg) @ w
    assert rel_err(dev.read(dh, np.float32, h.shape), want) <= TOL


def _topk_ref(z: np.ndarray, k: int, tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best k by (logit desc, id asc), their log-probs at tau and the tail mass, in float64."""
    z = z.astype(np.float64)
    ids = np.stack([np.lexsort((np.arange(z.shape[1]), -row))[:k] for row in z])
    lp = np.take_along_axis(log_softmax(z / tau), ids, axis=1)
    return ids, lp, np.maximum(0.0, 1.0 - np.exp(lp).sum(axis=1))


@pytest.mark.parametrize(
    "t,v,k,chunk,tau,order",
    [
        (4, 700, 16, 300, 2.0, "random"),
        (2, 700, 256, 700, 1.0, "random"),
        (3, 2500, 64, 2500, 1.0, "random"),
        (2, 6000, 200, 6000, 1.0, "random"),  # one chunk, several sorts of its candidates
        (2, 5000, 256, 2600, 1.0, "rising"),  # every logit beats the k-th: a sort every few steps
        (3, 100, 64, 40, 1.0, "random"),  # chunks narrower than one step, the list not full after the first
    ],
)
def test_topk_chunks(dev: Device, t: int, v: int, k: int, chunk: int, tau: float, order: str) -> None:
    rng = np.random.default_rng(v + k)
    z = (np.round(rng.standard_normal((t, v)) * 12.0) / 4.0).astype(np.float32)  # many ties
    if order == "rising":
        z = np.sort(z, axis=1)
    zb = up(dev, z)
    st = TopKState.build(dev, t, k)

    def run() -> list[np.ndarray]:
        lp, tail = dev.buffer(4 * t * k), dev.buffer(4 * t)
        for c0 in range(0, v, chunk):
            topk_chunk(dev, st, zb, min(chunk, v - c0), c0, tau, first=c0 == 0, ld=v, col_offset=c0)
        topk_finish(dev, st, lp, tail, tau)
        return [dev.read(st.ids, np.uint32, (t, k)), dev.read(lp, np.float32, (t, k)), dev.read(tail, np.float32, (t,))]

    ids, lp, tail = twice(run)
    want_ids, want_lp, want_tail = _topk_ref(z, k, tau)
    np.testing.assert_array_equal(ids, want_ids)
    assert rel_err(lp, want_lp) <= TOL
    assert np.max(np.abs(tail - want_tail)) <= 1e-5


def test_hidden_topk_matches_numpy(dev: Device) -> None:
    rng = np.random.default_rng(11)
    t, h_dim, v, k, tau = 1, 24, 333, 10, 1.5
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    w = rng.standard_normal((v, h_dim)).astype(np.float32)
    st = TopKState.build(dev, t, k)
    lp, tail = dev.buffer(4 * t * k), dev.buffer(4 * t)
    hidden_topk(dev, up(dev, h), up(dev, w), st, lp, tail, h_dim, v, tau, chunk=100)
    want_ids, want_lp, want_tail = _topk_ref(h.astype(np.float64) @ w.T.astype(np.float64), k, tau)
    np.testing.assert_array_equal(dev.read(st.ids, np.uint32, (t, k)), want_ids)
    assert rel_err(dev.read(lp, np.float32, (t, k)), want_lp) <= TOL
    assert np.max(np.abs(dev.read(tail, np.float32, (t,)) - want_tail)) <= 1e-5
