"""One device and one uploaded student per process (GPU memory does not outlive a process)."""

from __future__ import annotations

import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu.device import Device
from gpu.student import StudentWeights

# ---- one device, one uploaded student per process ---------------------------------------------------------
_DEVICES: dict[str, Device] = {}
_STUDENTS: dict[tuple, StudentWeights] = {}
_UPLOAD_STATS: dict[str, float] = {}


def get_device(backend: str = "auto") -> Device:
    """The process's Device for `backend` (auto, wgpu, dawn), created once."""
    if backend not in _DEVICES:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            _DEVICES[backend] = Device(None if backend == "auto" else backend)
    return _DEVICES[backend]


def load_student(path: Path, backend: str = "auto", progress: Callable[[Any], None] | None = None) -> StudentWeights:
    """Stream the GGUF at `path` into GPU memory once per process (keyed by path, size, mtime, backend)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, backend)
    if key not in _STUDENTS:
        dev = get_device(backend)
        t0 = time.perf_counter()
        weights = StudentWeights.from_gguf(dev, path, progress=progress)
        dev.sync()
        dt = time.perf_counter() - t0
        _UPLOAD_STATS.clear()
        _UPLOAD_STATS.update(
            seconds=dt,
            bytes=float(weights.nbytes),
            gib_per_s=weights.nbytes / dt / 2**30 if dt > 0 else 0.0,
            host_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
        _STUDENTS.clear()  # one student resident at a time
        _STUDENTS[key] = weights
    return _STUDENTS[key]


def upload_stats() -> dict[str, float]:
    """Timing of the last student upload: seconds, bytes, GiB/s, host peak RSS (MiB)."""
    return dict(_UPLOAD_STATS)
