"""The KD head's one-pass backward on the integer GEMM from stochastically rounded probabilities (gpu/ops/head.py
Int8Head probs, gpu/kernels/kd_probs_i8.wgsl; model/int8.py stochastic_probs_i8 is the twin).

Tolerances: the kernel's codes are the twin's where exp rounds alike (|diff| <= 1 on under 1 % of them: the GPU's
exp and numpy's differ by an ulp, and floor(y + u) flips where y + u lands on an integer), its scales within 1e-6
of the twin's. The backward's U = sum_v P_v W_v from 8-bit codes carries their noise: dh within 5 % of its max of
the exact one-pass backward's on these shapes (~1 % here; at 320 ids the rounding to nearest is as close, its
bias shows on long vocabularies: the twin's test holds the stochastic codes unbiased, and the kernel's codes are the
twin's); the loss is the logits' and so bitwise the same.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gpu.device import Device
from gpu.ops import kd as kd_ops
from gpu.ops.common import grid, pack
from gpu.ops.kd import KdScratch, kd_head_forward_backward
from gpu.ops.matmul_i8 import int8_emulation
from gpu.registry import pipeline
from gpu.weights import random_blocks, upload_quant
from model.int8 import dither, stochastic_probs_i8
from model.kd import LossConfig, log_softmax
from tests.gpu_fixtures import tensor_core_device_or_skip
from tests.gpu_helpers import make_device, rel_err, up


@pytest.fixture(params=[pytest.param("any", marks=pytest.mark.gpu), pytest.param("dawn", marks=pytest.mark.tensorcore)])
def dev(request: pytest.FixtureRequest) -> Device:
    """lavapipe in CI (the integer GEMMs emulated), and Dawn with subgroup matrices (the GEMMs on tensor cores)."""
    return make_device() if request.param == "any" else tensor_core_device_or_skip()


def _integer_gemms(dev: Device):
    """Where the integer GEMMs run: emulated where the device has no subgroup matrices."""
    return nullcontext() if dev.subgroup_matrix else int8_emulation(dev)


def test_twin_codes_are_unbiased_and_bounded() -> None:
    """E[code * scale] = p over seeds (the mean of 2,000 within 4 standard errors), codes in [0, 127], the row max
    at 127; rounding to nearest instead zeroes the entries below half a step (the bias this rounding removes)."""
    rng = np.random.default_rng(0)
    p = (rng.random((3, 96)) ** 6).astype(np.float32)
    p[:, 5] = 1.0
    draws = np.stack([(lambda c, s: c * s[:, None])(*stochastic_probs_i8(p, seed)) for seed in range(2000)])
    codes, scale = stochastic_probs_i8(p, 7)
    assert codes.max() <= 127 and codes[:, 5].min() == 127
    step = scale[:, None]
    frac = p / step - np.floor(p / step)  # a code is floor or ceil of p / step: variance frac (1 - frac) step^2
    sem = np.sqrt(frac * (1 - frac) / 2000) * step
    assert np.all(np.abs(draws.mean(axis=0) - p) <= 4 * sem + 1e-7)
    small = p < step / 2
    assert small.any() and draws.mean(axis=0)[small].sum() > 0.5 * p[small].sum()


def test_dither_is_uniform_and_keyed() -> None:
    u = dither(3, np.arange(64)[:, None], np.arange(1000)[None, :])
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01
    assert not np.array_equal(u, dither(4, np.arange(64)[:, None], np.arange(1000)[None, :]))


def test_stats_kernel_codes_match_the_twin(dev: Device) -> None:
    """kd_stats_probs8 on a first chunk: the codes and scales of exp(z / tau - m) * SW (m the row max), F zero."""
    rng = np.random.default_rng(1)
    t, nv, k, tau, seed, c0 = 5, 96, 4, 2.0, 12345, 640
    z = (rng.standard_normal((t, nv)) * 4).astype(np.float32)
    sw = (rng.random(nv) * 0.02 + 0.001).astype(np.float32)
    ids = rng.integers(c0, c0 + nv, (t, k)).astype(np.uint32)
    targets = rng.integers(c0, c0 + nv, t).astype(np.uint32)
    off = -(-t * nv // dev.offset_alignment) * dev.offset_alignment
    pq = dev.buffer(off + 4 * t)
    usage = dev.wgpu.BufferUsage.UNIFORM | dev.wgpu.BufferUsage.COPY_DST
    dith = dev.buffer(16, usage=usage)
    dev.write(dith, np.array([seed, off // 4, 0, 0], np.uint32))
    f = dev.buffer(4 * t)
    bind = [pack(t, nv, nv, c0, k, 1.0 / tau, 1, 0), up(dev, z), up(dev, ids, np.uint32), up(dev, targets, np.uint32),
            dev.buffer(16 * t), dev.buffer(4 * t * (k + 1)), pq, f, up(dev, sw), dith]  # fmt: skip
    dev.dispatch(pipeline(dev, "kd_stats_probs8"), bind, grid(t, 1))
    words = dev.read(pq, np.uint32, (off // 4 + t,))
    codes = words[: t * nv // 4].view(np.uint8).reshape(t, nv)
    scales = words[off // 4 :].view(np.float32)
    zt = z * np.float32(1.0 / tau)
    p = np.exp(zt - zt.max(axis=1, keepdims=True)) * sw
    want_codes, want_scales = stochastic_probs_i8(p.astype(np.float32), seed, c0)
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
    diff = np.abs(codes.astype(int) - want_codes)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert codes.max() == 127 and np.all(dev.read(f, np.float32, (t,)) == 0)


def _head_problem(dev: Device, seed: int):
    rng = np.random.default_rng(seed)
    t, h_dim, v, k = 32, 64, 320, 8
    raw = random_blocks(GGMLQuantizationType.Q8_0, (v, h_dim), rng)
    w = upload_quant(dev, raw, GGMLQuantizationType.Q8_0, (v, h_dim), "head")
    h = (rng.standard_normal((t, h_dim)) * 2).astype(np.float32)
    lp = log_softmax(rng.standard_normal((t, v)) * 3.0)
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k].astype(np.uint32)
    lt = np.take_along_axis(lp, ids, axis=1).astype(np.float32)
    targets = rng.integers(0, v, t).astype(np.uint32)
    mask = np.ones(t, np.uint32)
    mask[3] = 0
    return t, h_dim, v, k, w, [up(dev, a, a.dtype) for a in (h, ids, lt, targets, mask)]


@pytest.mark.parametrize("rot", [0, 64])
def test_int8_probs_backward_within_its_noise_of_the_exact_one(
    dev: Device, monkeypatch: pytest.MonkeyPatch, rot: int
) -> None:
    """The integer head with probs: the one-pass backward ran kd_stats_probs8 and no f32 or f16
    probabilities, the loss bitwise that of the logits-only integer head, dh within 5 % of its max of that head's
    exact P_c W_c, masked rows zero; reseeding changes dh."""
    t, h_dim, v, k, w, (hb, idb, ltb, tgb, mb) = _head_problem(dev, 2)
    cfg = LossConfig(kind="forward_kl", tau=1.0, use_tail=True)
    ran: list[str] = []
    real = kd_ops.pipeline
    monkeypatch.setattr(kd_ops, "pipeline", lambda d, name, **kw: ran.append(name) or real(d, name, **kw))

    def run(probs: bool, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
        sc = KdScratch.build(dev, t, k, 64, hidden=h_dim, half=False, int8_hidden=h_dim, int8_backward=False,
                             int8_rot=rot, int8_probs=probs)  # fmt: skip
        assert (sc.int8.probs is not None) == probs
        sc.int8.keep_row_scales(dev, w, v)
        sc.int8.reseed(dev, seed)
        dh, loss = dev.buffer(4 * t * h_dim), dev.buffer(4)
        kd_head_forward_backward(dev, hb, w, idb, ltb, None, tgb, mb, cfg, dh, loss, t, h_dim, v, k, scratch=sc)
        return dev.read(loss, np.float32, (1,)), dev.read(dh, np.float32, (t, h_dim))

    with _integer_gemms(dev):
        loss_exact, dh_exact = run(False)
        ran.clear()
        loss, dh = run(True)
        assert "kd_stats_probs8" in ran and "kd_stats_probs" not in ran and "kd_stats_probs16" not in ran
        _, dh_other = run(True, seed=2)
    assert loss[0] == loss_exact[0]
    err = rel_err(dh, dh_exact)
    print(f"rot {rot}: dh rel err {err:.3e}")
    assert err < 5e-2
    assert np.all(dh[3] == 0)
    assert not np.array_equal(dh, dh_other)


@pytest.mark.parametrize("rot", [0, 64])
def test_probs_product_on_the_transposed_codes(dev: Device, monkeypatch: pytest.MonkeyPatch, rot: int) -> None:
    """head.PROBS_NT: P_c . W on the "nt" GEMM over the chunk's codes transposed (once a chunk) gives dh within 1e-6
    of the "nn" GEMM's (the same i32 sums and scales), the same rounding seed."""
    from gpu.ops import head

    t, h_dim, v, k, w, (hb, idb, ltb, tgb, mb) = _head_problem(dev, 3)
    cfg = LossConfig(kind="forward_kl", tau=1.0, use_tail=True)
    transposed: list[int] = []
    real = head.transpose_i8
    monkeypatch.setattr(head, "transpose_i8", lambda *a, **kw: transposed.append(1) or real(*a, **kw))
    out = {}
    with _integer_gemms(dev):
        for nt in (True, False):
            monkeypatch.setattr(head, "PROBS_NT", nt)
            sc = KdScratch.build(dev, t, k, 64, hidden=h_dim, half=False, int8_hidden=h_dim, int8_backward=False,
                                 int8_rot=rot, int8_probs=True)  # fmt: skip
            assert (sc.int8.rows_t is not None) == nt
            sc.int8.keep_row_scales(dev, w, v)
            sc.int8.reseed(dev, 1)
            dh, loss = dev.buffer(4 * t * h_dim), dev.buffer(4)
            transposed.clear()
            kd_head_forward_backward(dev, hb, w, idb, ltb, None, tgb, mb, cfg, dh, loss, t, h_dim, v, k, scratch=sc)
            out[nt] = dev.read(dh, np.float32, (t, h_dim))
            assert (len(transposed) == -(-v // 64)) == nt, transposed
    assert rel_err(out[True], out[False]) < 1e-6


def test_student_step_with_int8_probabilities(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole int8 step (a vocabulary of 5 chunks of 64) with INT8_STUDENT_PROBS: the loss bitwise
    the logits-only step's, every LoRA gradient within 5 % of its max of it, and each batch written reseeds the
    rounding (the same batch twice: other gradients)."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType as Q

    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd
    from gpu.ops import head
    from gpu.student import GPUStudent
    from model.config import LORA_TARGETS
    from model.engine_spec import EngineSpec, KdBatch
    from tests.gpu_helpers import random_student_problem
    from tests.test_gpu_student import CFG, B, K, R, T

    cfg = replace(CFG, vocab=320)
    w, lora, ids, targets, mask, rng = random_student_problem(cfg, 3, Q.Q4_0, R, B, T)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, cfg.vocab)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    tlp = np.take_along_axis(lp, tids, -1).astype(np.float32)
    batch = KdBatch(ids, targets, mask, tids, tlp, np.clip(1 - np.exp(tlp).sum(-1), 0, None).astype(np.float32))
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    spec = EngineSpec(cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, precision="int8",
                      vocab_chunk=64)  # fmt: skip
    runs = []
    with _integer_gemms(dev):
        weights = ModelWeights.from_arrays(dev, cfg, w, Q.Q4_0)
        for probs in (False, True):
            monkeypatch.setattr(head, "INT8_STUDENT_PROBS", probs)
            st = GPUStudent(dev, weights, spec, GpuKd(loss_cfg, K))
            sc = st.objective.scratch
            assert (sc.int8.probs is not None) == probs
            assert probs is (sc.dz16 is None and sc.w16 is None) or not dev.subgroup_matrix  # no f16 buffers with it
            st.set_adapter(lora)
            for _ in range(2 if probs else 1):
                st.write_batch(batch)
                runs.append((st.loss_and_grads(), st.layout.pack(st.get_grads())))
    (loss0, g0), (loss1, g1), (loss2, g2) = runs
    assert loss1 == loss0 and loss2 == loss0
    err = float(np.abs(g1 - g0).max() / np.abs(g0).max())
    print(f"int8 probabilities: gradients within {err:.2e} of the exact P_c W_c")
    assert 0 < err < 5e-2
    assert not np.array_equal(g1, g2)
