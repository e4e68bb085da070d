"""Per-dispatch GPU time by timestamp queries, grouped by kernel class (for bench/train_step.py --profile).

While a Profiler is attached (`with Profiler(dev) as prof:`), Device.dispatch gives every dispatch its own
compute pass with begin/end timestamp writes, and each submit resolves the timestamps and reads them back.
That serialises the step (one pass per dispatch, a read per submit), so profile separate steps from the timed
ones; detached (the default) the only cost is one `is None` check per dispatch. Copies and buffer writes are
not timed. Timestamps are nanoseconds (Dawn's timestamp quantization is disabled by gpu/device.py).

Usage::

    with Profiler(dev) as prof:
        student.train_step(lr=1e-4)
    print(prof.summary(steps=1))     # {"classes": {"tc gemm": {"ms": ..., "share": ...}, ...}, ...}
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np

from gpu.device import Device, DeviceError

QUERIES_PER_SET = 4096  # WebGPU's maximum query-set size: 2048 dispatches per set
CLASSES = (
    "tc gemm",
    "fused-quant gemm",
    "int8 gemm",
    "f32 gemm",
    "lora",
    "attention fwd",
    "attention bwd",
    "norms",
    "rope",
    "swiglu",
    "kd head",
    "adamw",
    "other",
)


def kernel_class(label: str, scope: str | None = None) -> str:
    """The class of a dispatch from its pipeline label (str of the pipeline key) and the enclosing scope."""
    if scope is not None:
        return scope
    low = label.lower()
    if "matmul_tc" in low:
        plain = "wtype='f16'" in low or "wtype='f32'" in low
        return "tc gemm" if plain else "fused-quant gemm"
    if any(s in low for s in ("matmul_i8", "quantize_i8", "weight_i8", "transpose_i8", "hadamard_rows")):
        return "int8 gemm"
    if "strided_matmul" in low:
        return "lora"
    if "matmul" in low:
        return "f32 gemm"
    if "attention" in low:
        backward = any(s in low for s in ("backward", "bwd", "_dq", "dkv", "delta"))
        return "attention bwd" if backward else "attention fwd"
    for key, cls in (
        ("rmsnorm", "norms"),
        ("rope", "rope"),
        ("swiglu", "swiglu"),
        ("glu_", "swiglu"),  # the gated unit with its output's or gradients' int8 codes (glu_i8, glu_back_i8)
        ("kd_", "kd head"),
        ("topk", "kd head"),
    ):
        if key in low:
            return cls
    if "adamw" in low or "grad_norm" in low:
        return "adamw"
    return "other"


class Profiler:
    """Timestamps around every dispatch recorded while attached to a Device; durations keyed by (class, label).
    by_grid: the label starts with the dispatch's workgroup grid, so one kernel's calls split by shape."""

    def __init__(self, dev: Device, *, by_grid: bool = False) -> None:
        if "timestamp-query" not in dev.features:
            raise DeviceError(f"profiling needs the timestamp-query feature, which {dev.adapter.summary} lacks")
        self.dev = dev
        self.by_grid = by_grid
        self._sets: list[tuple[Any, Any]] = []  # (query set, resolve buffer), reused across submits
        self._pending: list[tuple[str, str]] = []  # (class, label) of the dispatches recorded since the last submit
        self._scope: str | None = None
        self.ns: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    # ---- attach / detach ------------------------------------------------------------------------------
    def __enter__(self) -> Profiler:
        if self.dev.profiler is not None:
            raise DeviceError("a Profiler is already attached to this device")
        self.dev.flush()
        self.dev.profiler = self
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.dev.flush()
        finally:
            self.dev.profiler = None

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        outer, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = outer

    # ---- Device hooks ---------------------------------------------------------------------------------
    def timestamp_writes(self, label: str, grid: tuple[int, ...] = ()) -> dict[str, Any]:
        """The timestamp_writes of the compute pass of the next dispatch over `grid` (called by Device.dispatch)."""
        i = len(self._pending)
        s, q = divmod(2 * i, QUERIES_PER_SET)
        if s == len(self._sets):
            qs = self.dev.device.create_query_set(type="timestamp", count=QUERIES_PER_SET)
            usage = self.dev.wgpu.BufferUsage.QUERY_RESOLVE | self.dev.wgpu.BufferUsage.COPY_SRC
            self._sets.append((qs, self.dev.device.create_buffer(size=8 * QUERIES_PER_SET, usage=usage)))
        shown = f"grid={'x'.join(map(str, grid))} {label}" if self.by_grid else label
        self._pending.append((kernel_class(label, self._scope), shown))
        return {"query_set": self._sets[s][0], "beginning_of_pass_write_index": q, "end_of_pass_write_index": q + 1}

    def resolve(self, encoder: Any) -> None:
        """Record the resolves of this submit's timestamps (called by Device before it finishes the encoder)."""
        n = 2 * len(self._pending)
        for s in range(-(-n // QUERIES_PER_SET)):
            qs, buf = self._sets[s]
            encoder.resolve_query_set(qs, 0, min(QUERIES_PER_SET, n - s * QUERIES_PER_SET), buf, 0)

    def collect(self) -> None:
        """Read this submit's timestamps back and add the durations (called by Device after the submit)."""
        n = 2 * len(self._pending)
        stamps = []
        for s in range(-(-n // QUERIES_PER_SET)):
            count = min(QUERIES_PER_SET, n - s * QUERIES_PER_SET)
            raw = self.dev.queue.read_buffer(self._sets[s][1], 0, 8 * count)
            stamps.append(np.frombuffer(raw, np.uint64))
        if stamps:
            t = np.concatenate(stamps).astype(np.int64).reshape(-1, 2)
            for (cls, label), dt in zip(self._pending, np.maximum(t[:, 1] - t[:, 0], 0), strict=True):
                self.ns[(cls, label)] += float(dt)
                self.calls[(cls, label)] += 1
        self._pending.clear()

    # ---- results --------------------------------------------------------------------------------------
    def summary(self, steps: int = 1, top: int = 8) -> dict[str, Any]:
        """Per-class GPU ms per step and share of the timed total, plus the `top` slowest kernels."""
        by_class: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for (cls, _), ns in self.ns.items():
            by_class[cls] += ns
        for (cls, _), c in self.calls.items():
            calls[cls] += c
        total = sum(by_class.values()) or 1.0
        order = [c for c in CLASSES if c in by_class] + sorted(set(by_class) - set(CLASSES))
        kernels = sorted(self.ns.items(), key=lambda kv: -kv[1])[:top]
        return {
            "steps": steps,
            "timed_ms_per_step": round(total / 1e6 / steps, 3),
            "dispatches_per_step": sum(self.calls.values()) // max(steps, 1),
            "classes": {
                c: {
                    "ms": round(by_class[c] / 1e6 / steps, 3),
                    "share": round(by_class[c] / total, 4),
                    "dispatches": calls[c] // max(steps, 1),
                }
                for c in order
            },
            "top_kernels": [
                {"class": c, "kernel": label[:240], "ms": round(ns / 1e6 / steps, 3), "calls": self.calls[(c, label)]}
                for (c, label), ns in kernels
            ],
        }


@contextlib.contextmanager
def scope(dev: Device, name: str) -> Iterator[None]:
    """Attribute the dispatches inside the block to class `name` when a Profiler is attached (else a no-op)."""
    prof = dev.profiler
    if prof is None:
        yield
        return
    with prof.scope(name):
        yield
