"""Shared helpers for the GPU op tests: a module-scoped Device fixture factory, uploads, error metric."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gpu.device import Device
from gpu.ops.rope import RopeTable, rope_backward, rope_forward
from gpu.weights import upload_quant
from model import reference as ref
from tests.gpu_fixtures import device_or_skip


def make_device() -> Device:
    """The shared Device (tests/gpu_fixtures.py), or skip when this machine has no wgpu adapter."""
    return device_or_skip()


def up(dev: Device, a: np.ndarray, dtype: type = np.float32):
    """Upload `a` cast to dtype (f32 by default)."""
    return dev.upload(np.ascontiguousarray(a, dtype=dtype))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| (ref in float64)."""
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return float(np.max(np.abs(got - ref))) / max(scale, 1e-30)


def twice(run: Callable[[], list[np.ndarray]]) -> list[np.ndarray]:
    """Run an op twice (fresh outputs each time) and assert the results are bitwise equal."""
    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        assert a.tobytes() == b.tobytes(), "GPU op is not bitwise reproducible"
    return first


def gemm_twice(
    dev: Device, linear: Callable[..., None], raw: Any, qtype: int, mnk: tuple[int, int, int], rng: Any
) -> None:
    """y = x W^T through `linear` (linear, linear_tc) on the quantized weight `raw` [n, k] and a random x [m, k],
    twice: the two results must be bitwise equal."""
    m, n, k = mnk
    w = upload_quant(dev, raw, qtype, (n, k))
    x = dev.upload(rng.standard_normal((m, k)).astype(np.float32))

    def run() -> list[np.ndarray]:
        y = dev.buffer(m * n * 4)
        linear(dev, x, w, y, m)
        return [dev.read(y, np.float32, (m, n))]

    twice(run)


def rope_matches_reference(
    dev: Device, rng: Any, t: int, nh: int, d: int, base: float, start: int, use_buf: bool, **variant: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rope_forward / rope_backward of t tokens x nh heads (d wide) against model/reference.py's pair, relative
    1e-4, each run twice bitwise equal; positions from a buffer when use_buf (else start + i). variant: factors,
    neox (RopeTable.build's and the reference's). Returns (GPU y, x in float64, absolute positions)."""
    table = RopeTable.build(dev, d, base, 64, **variant)
    x = rng.standard_normal((t, nh, d)).astype(np.float32)
    dy = rng.standard_normal((t, nh, d)).astype(np.float32)
    pos_rel = rng.permutation(20)[:t].astype(np.uint32) if use_buf else np.arange(t, dtype=np.uint32)
    pos_buf = up(dev, pos_rel, np.uint32) if use_buf else None
    xb, dyb = up(dev, x), up(dev, dy)

    def run() -> list[np.ndarray]:
        y, dx = dev.buffer(x.nbytes), dev.buffer(x.nbytes)
        rope_forward(dev, table, xb, y, t, nh, positions=pos_buf, start=start)
        rope_backward(dev, table, dyb, dx, t, nh, positions=pos_buf, start=start)
        return [dev.read(b, np.float32, x.shape) for b in (y, dx)]

    y, dx = twice(run)
    pos = pos_rel.astype(np.int64) + start
    factors, neox = variant.get("factors"), variant.get("neox", False)
    assert rel_err(y, ref.rope_forward(x.astype(np.float64), pos, base, factors, neox)) <= 1e-4
    assert rel_err(dx, ref.rope_backward(dy.astype(np.float64), pos, base, factors, neox)) <= 1e-4
    return y, x.astype(np.float64), pos


def random_student_problem(cfg: Any, seed: int, qtype: int, rank: int, batch: int, seq_len: int) -> tuple:
    """(weights, LoRA with random B, ids, targets, mask, rng) of a random student step: 2-D block weights
    quantized to qtype and back (the reference sees exactly what the GPU decodes), mask ~80% ones; rng continues
    the stream (the caller draws the teacher from it)."""
    from gguf import GGMLQuantizationType as Q

    from model.config import LORA_TARGETS
    from model.quant import dequantize, quantize

    rng = np.random.default_rng(seed)
    w = ref.random_weights(cfg, seed, np.float32)
    if qtype != Q.F32:
        w = {
            n: dequantize(quantize(a, qtype), qtype, a.shape) if a.ndim == 2 and n.startswith("blk.") else a
            for n, a in w.items()
        }
    lora = ref.init_lora(cfg, list(LORA_TARGETS), rank, seed)
    lora = {key: ref.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(np.float32)) for key, p in lora.items()}
    ids = rng.integers(0, cfg.vocab, (batch, seq_len))
    targets = np.concatenate([ids[:, 1:], rng.integers(0, cfg.vocab, (batch, 1))], axis=1)
    mask = (rng.random((batch, seq_len)) > 0.2).astype(np.uint8)
    return w, lora, ids, targets, mask, rng
