"""Shared GPU test helpers: one Device per test process (creating one costs ~0.5 s on lavapipe).

In a test module::

    from tests.gpu_fixtures import device_or_skip

    @pytest.fixture
    def dev() -> Device:
        return device_or_skip()
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from typing import Any

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")


@cache
def _device() -> Any:
    from gpu.device import Device, DeviceError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the "CPU adapter" warning
            return Device()
    except (DeviceError, ImportError, RuntimeError) as e:
        return e


def device_or_skip() -> Any:
    """The process's shared Device; skips the calling test when no wgpu adapter exists, except under
    DISTILLERY_REQUIRE_GPU=1 (`make test` sets it: CI must run the GPU path on lavapipe, not skip it)."""
    dev = _device()
    if isinstance(dev, Exception):
        if os.environ.get("DISTILLERY_REQUIRE_GPU") == "1":
            pytest.fail(f"no GPU adapter (DISTILLERY_REQUIRE_GPU=1): {dev}")
        pytest.skip(f"no GPU adapter: {dev}")
    return dev


@cache
def _tensor_core_device() -> Any:
    from gpu.device import Device, DeviceError
    from gpu.ops.matmul_tc import tensor_core_problem

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dev = Device(backend="dawn")
    except (DeviceError, ImportError, RuntimeError) as e:
        return f"no Dawn adapter: {e}"
    return tensor_core_problem(dev) or dev


def tensor_core_device_or_skip() -> Any:
    """The process's Dawn Device with usable subgroup matrices (e.g. an NVIDIA H200 with Vulkan); skips the
    calling test elsewhere (the `tensorcore` tests, deselected by `make test`)."""
    dev = _tensor_core_device()
    if isinstance(dev, str):
        pytest.skip(dev)
    return dev
