"""Exit 0 when wgpu finds a Vulkan adapter (used by the Makefile to decide whether to install lavapipe)."""

from __future__ import annotations

import os
import sys


def vulkan_adapters() -> list[str]:
    """Names of the Vulkan adapters wgpu-native can see (empty when none or when the loader is missing)."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu

        adapters = wgpu.gpu.enumerate_adapters_sync()
    except Exception:  # a missing libvulkan surfaces as various loader errors
        return []
    return [a.summary for a in adapters if "vulkan" in a.summary.lower()]


if __name__ == "__main__":
    names = vulkan_adapters()
    for name in names:
        print(name)
    sys.exit(0 if names else 1)


def gemm_probe(backend: str = "auto", seconds: float = 1.0) -> dict:
    """Device description plus the f32 GEMM rate measured for about `seconds` (N=512 on a CPU, 4096 on a GPU)."""
    import time
    import warnings

    import numpy as np

    from gpu.device import Device
    from gpu.ops.matmul import linear
    from gpu.weights import upload_quant

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dev = Device(None if backend == "auto" else backend)
    info = dev.describe()
    info["warnings"] = [str(w.message) for w in caught]
    n = 512 if dev.is_cpu else 4096
    rng = np.random.default_rng(0)
    x = dev.upload(rng.standard_normal((n, n), dtype=np.float32))
    w = upload_quant(dev, rng.standard_normal((n, n), dtype=np.float32), 0, (n, n), "probe")
    y = dev.buffer(4 * n * n)
    linear(dev, x, w, y, n)  # compile + warm up
    dev.sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        with dev.step():
            for _ in range(4):
                linear(dev, x, w, y, n)
        dev.sync()
        reps += 4
    elapsed = time.perf_counter() - t0
    info["gemm_probe"] = f"{2 * n**3 * reps / elapsed / 1e9:.1f} GFLOP/s (f32, N={n}, {reps} GEMMs in {elapsed:.2f} s)"
    return info
