"""Whole-GPU memory measured the same way for every side of a benchmark: NVML (ctypes to libnvidia-ml.so.1,
else `nvidia-smi` polling) sampled in a background thread while one child process runs alone on the GPU.

The peak of (device memory used - memory used before the child started) is that process's footprint as the
driver sees it: CUDA or Vulkan context, allocator caches and every buffer, whatever the framework's own
accounting says. Used by bench/train_step.py, which runs each side in its own process.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time
from collections.abc import Callable


class _Nvml:
    """nvmlDeviceGetMemoryInfo of GPU 0 through ctypes (no pynvml needed)."""

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != 0:
            raise OSError("nvmlDeviceGetHandleByIndex_v2(0) failed")

    def used(self) -> int:
        mem = self._Memory()
        if self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(mem)) != 0:
            raise OSError("nvmlDeviceGetMemoryInfo failed")
        return int(mem.used)


def _nvidia_smi_used() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    return int(float(out.split()[0]) * 2**20)


def memory_reader() -> tuple[Callable[[], int], str] | None:
    """(read used bytes of GPU 0, how) or None when neither NVML nor nvidia-smi answers."""
    try:
        nvml = _Nvml()
        nvml.used()
        return nvml.used, "nvml"
    except (OSError, AttributeError):
        pass
    try:
        _nvidia_smi_used()
        return _nvidia_smi_used, "nvidia-smi"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class MemoryPoller:
    """Samples GPU 0's used memory every `period` seconds; peak_since(mark) gives the peak above the baseline."""

    def __init__(self, period: float = 0.02) -> None:
        found = memory_reader()
        self.how = found[1] if found else "unavailable"
        self._read = found[0] if found else None
        self.period = period if self.how == "nvml" else max(period, 0.2)
        self.baseline = self._read() if self._read else 0
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory-poller", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> None:
        if self._read is not None:
            self.peak = max(self.peak, self._read())

    def __enter__(self) -> MemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def peak_bytes(self) -> int | None:
        """Peak used minus the baseline so far (None without NVML / nvidia-smi)."""
        if self._read is None:
            return None
        self.sample()
        return self.peak - self.baseline


def run_child(cmd: list[str], on_line: Callable[[str, MemoryPoller], None], settle_s: float = 0.5) -> int:
    """Run cmd (alone on the GPU) under a MemoryPoller; on_line(line, poller) for each stdout line as it comes."""
    time.sleep(settle_s)  # let the previous child's memory return to the driver before the baseline
    with MemoryPoller() as poller:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip("\n"), poller)
        return proc.wait()
