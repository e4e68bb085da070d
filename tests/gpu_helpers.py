"""Shared helpers for the GPU op tests: a module-scoped Device fixture factory, uploads, error metric."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu.device import Device
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
