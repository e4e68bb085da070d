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
