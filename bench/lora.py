"""LoRA adapter products on the GPU, as JSON lines: gpu/ops/lora.py's two paths, ours_fused (the t/y and dt/dx
pairs in one dispatch each, gpu/ops/lora_fused.py; dB, dA^T on lora_matmul) and ours_split (every product on
gpu/ops/lora_matmul.py), the generic strided_matmul before them (ours_old), and torch's matmuls on the same six
products.

    python bench/lora.py                       # T = 4096 (B4 x T1024), r = 16, the TinyLlama and SmolLM2 shapes
    python bench/lora.py --tokens 256 --shapes 576x192,64x40 --no-torch     # small, e.g. on lavapipe

ours_split_fast / ours_split_gemm: the split path with the bandwidth kernels (lora_stream, lora_rows) where the
operands allow, or on lora_gemm alone (`--paths`).

One rep = lora_forward + lora_backward (t = x A^T, y += s t B^T; dB = s dy^T t, dt = s dy B, dA = dt^T x,
dx += dt A). ms: wall time per rep, median of 3 windows after a warm-up (reps recorded in one step, then
dev.sync()). dispatches: per rep, [forward, backward]. gpu_ms: GPU time of one rep by timestamp queries (each
dispatch in its own pass), forward and backward, and per dispatch in order. max_rel_err: |got - ref| / max |ref|
of y, dx, dA, dB against float64 numpy. torch: the same six products with torch.matmul (fp32 with TF32 off, and
bf16), CUDA events.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import timed  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops import lora_matmul  # noqa: E402
from gpu.ops.lora import lora_backward, lora_forward  # noqa: E402
from gpu.ops.strided_matmul import row_major, strided_matmul, transposed  # noqa: E402
from gpu.profile import Profiler  # noqa: E402
from model import reference  # noqa: E402

FAST_TARGETS = (lora_matmul.STREAM_WORKGROUPS, lora_matmul.ROWS_WORKGROUPS, lora_matmul.STREAM_UNROLL)
SHAPES = "2048x2048,2048x256,2048x5632,5632x2048,576x576,576x192,576x1536,1536x576"  # (d_in, d_out)


def old_forward(dev: Device, x, a, b, t_out, y, n: int, d_in: int, d_out: int, r: int, scale: float) -> None:
    """The previous lora_forward: both products on strided_matmul (16 x 16 tiles, serial reductions)."""
    strided_matmul(dev, row_major(x, d_in), transposed(a, d_in), t_out, n, r, d_in)
    strided_matmul(dev, row_major(t_out, r), transposed(b, r), y, n, d_out, r, alpha=scale, accumulate=True)


def old_backward(dev: Device, dy, x, a, b, t, da, db, dx, dt, n: int, d_in: int, d_out: int, r: int, scale: float):
    """The previous lora_backward on strided_matmul."""
    strided_matmul(dev, transposed(dy, d_out), row_major(t, r), db, d_out, r, n, alpha=scale)
    strided_matmul(dev, row_major(dy, d_out), row_major(b, r), dt, n, r, d_out, alpha=scale)
    strided_matmul(dev, transposed(dt, r), row_major(x, d_in), da, r, d_in, n)
    strided_matmul(dev, row_major(dt, r), row_major(a, d_in), dx, n, d_in, r, accumulate=True)


IMPLS = {
    "fused": (partial(lora_forward, fused=True), partial(lora_backward, fused=True)),
    "split": (partial(lora_forward, fused=False), partial(lora_backward, fused=False)),
    "old": (old_forward, old_backward),
}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def dispatch_count(dev: Device, fn: Callable[[], None]) -> int:
    """How many dispatches fn records."""
    count, record = 0, dev.dispatch

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return record(*args, **kwargs)

    dev.dispatch = counting  # type: ignore[method-assign]
    try:
        with dev.step():
            fn()
    finally:
        del dev.dispatch
    return count


def ours(dev: Device, impl: str, n: int, d_in: int, d_out: int, r: int, seconds: float) -> dict[str, Any]:
    """One shape with our `impl` ("fused", "split" or "old"): wall and GPU time of forward + backward, errors."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d_in), dtype=np.float32)
    a = (rng.standard_normal((r, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = (rng.standard_normal((d_out, r)) / np.sqrt(r)).astype(np.float32)
    dy = rng.standard_normal((n, d_out), dtype=np.float32)
    scale = 2.0
    xb, ab, bb, dyb = (dev.upload(v) for v in (x, a, b, dy))
    y, dx = dev.buffer(4 * n * d_out), dev.buffer(4 * n * d_in)
    tb, dt = dev.buffer(4 * n * r), dev.buffer(4 * n * r)
    da, db = dev.buffer(a.nbytes), dev.buffer(b.nbytes)
    fwd, bwd = IMPLS[impl]

    def forward() -> None:
        fwd(dev, xb, ab, bb, tb, y, n, d_in, d_out, r, scale)

    def backward() -> None:
        bwd(dev, dyb, xb, ab, bb, tb, da, db, dx, dt, n, d_in, d_out, r, scale)

    def go(reps: int) -> float:
        t0 = time.perf_counter()
        with dev.step():
            for _ in range(reps):
                forward()
                backward()
        dev.sync()
        return time.perf_counter() - t0

    sec, reps, spread = timed(go, seconds)
    res: dict[str, Any] = {"impl": f"ours_{impl}", "tokens": n, "d_in": d_in, "d_out": d_out, "r": r}
    res.update(ms=round(sec * 1e3, 4), reps=reps, spread=round(spread, 3))
    res["dispatches"] = [dispatch_count(dev, forward), dispatch_count(dev, backward)]
    dev.clear(y)
    dev.clear(dx)
    forward()
    backward()
    x64, a64, b64, dy64 = (v.astype(np.float64) for v in (x, a, b, dy))
    dx_ref, da_ref, db_ref = reference.lora_backward(dy64, x64, a64, b64, scale)
    got = {name: dev.read(buf, np.float32, shape) for name, buf, shape in
           (("y", y, (n, d_out)), ("dx", dx, (n, d_in)), ("dA", da, a.shape), ("dB", db, b.shape))}  # fmt: skip
    want = {"y": reference.lora_forward(x64, a64, b64, scale), "dx": dx_ref, "dA": da_ref, "dB": db_ref}
    res["max_rel_err"] = {k: float(f"{_rel(got[k], want[k]):.3g}") for k in want}
    res.update(_gpu_time(dev, forward, backward))
    return res


class DispatchProfiler(Profiler):
    """A Profiler that keeps every dispatch apart (its label prefixed by its order), for per-product times."""

    def __init__(self, dev: Device) -> None:
        super().__init__(dev)
        self.count = 0

    def timestamp_writes(self, label: str, grid: tuple[int, ...] = ()) -> dict[str, Any]:
        self.count += 1
        return super().timestamp_writes(f"{self.count:02d} {label}", grid)


def _gpu_time(dev: Device, forward: Callable[[], None], backward: Callable[[], None]) -> dict[str, Any]:
    """GPU ms of one forward and one backward by timestamp queries, and microseconds per dispatch in order."""
    if "timestamp-query" not in dev.features:
        return {}
    out: dict[str, Any] = {}
    for name, fn in (("fwd", forward), ("bwd", backward)):
        with DispatchProfiler(dev) as prof:
            with dev.step():
                fn()
        out[f"gpu_ms_{name}"] = round(sum(prof.ns.values()) / 1e6, 4)
        per = sorted((label, ns) for (_, label), ns in prof.ns.items())
        out[f"gpu_us_{name}_by_dispatch"] = [[label[:48], round(ns / 1e3, 1)] for label, ns in per]
    out["gpu_ms"] = round(out["gpu_ms_fwd"] + out["gpu_ms_bwd"], 4)
    return out


def _torch_one(torch: Any, dtype: Any, n: int, d_in: int, d_out: int, r: int, seconds: float) -> dict[str, Any]:
    """The six products in one torch dtype, timed with CUDA events."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, a, b, dy, y, dx = (
        torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
        for shape in ((n, d_in), (r, d_in), (d_out, r), (n, d_out), (n, d_out), (n, d_in))
    )

    def go(reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            t = x @ a.T
            y.add_(t @ b.T, alpha=2.0)
            _db = 2.0 * (dy.T @ t)
            dt = 2.0 * (dy @ b)
            _da = dt.T @ x
            dx.add_(dt @ a)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    sec, reps, spread = timed(go, seconds)
    name = "torch_fp32" if dtype == torch.float32 else "torch_bf16"
    return {"impl": name, "tokens": n, "d_in": d_in, "d_out": d_out, "r": r, "ms": round(sec * 1e3, 4),
            "reps": reps, "spread": round(spread, 3), "torch": torch.__version__}  # fmt: skip


def torch_products(n: int, d_in: int, d_out: int, r: int, seconds: float) -> list[dict[str, Any]]:
    """The same six products with torch.matmul in fp32 (TF32 off) and bf16."""
    try:
        import torch
    except ImportError as e:
        return [{"impl": "torch", "error": f"torch not importable: {e}"}]
    if not torch.cuda.is_available():
        return [{"impl": "torch", "error": "torch has no CUDA device"}]
    torch.backends.cuda.matmul.allow_tf32 = False
    return [_torch_one(torch, dt, n, d_in, d_out, r, seconds) for dt in (torch.float32, torch.bfloat16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="token rows T (batch x sequence)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated d_in x d_out")
    ap.add_argument("--seconds", type=float, default=0.3, help="target length of one timing window")
    ap.add_argument("--no-old", action="store_true", help="skip the strided_matmul baseline")
    ap.add_argument("--no-split", action="store_true", help="skip the two-product lora_matmul path")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--splits", default="", help="sweep lora_gemm's split: TARGET_WORKGROUPS:MIN_CHUNK,...")
    ap.add_argument(
        "--paths", default="fast,gemm",
        help="kernels of the split impl: fast (lora_stream / lora_rows where the operands read as vec4s), gemm "
        "(lora_gemm only); each is one ours_split_<path> row",
    )  # fmt: skip
    ap.add_argument(
        "--fast-targets", default="",
        help="sweep the fast kernels' workgroup targets and lora_stream's rows a load: STREAM:ROWS[:UNROLL],...",
    )  # fmt: skip
    args = ap.parse_args()
    dev = Device()
    print(json.dumps({"adapter": dev.adapter.summary, "backend": dev.backend}), flush=True)
    splits = [tuple(int(v) for v in c.split(":")) for c in args.splits.split(",") if c]
    for shape in args.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.lower().split("x"))
        for target, min_chunk in splits:
            lora_matmul.TARGET_WORKGROUPS, lora_matmul.MIN_CHUNK = target, min_chunk
            res = ours(dev, "split", args.tokens, d_in, d_out, args.rank, args.seconds)
            print(json.dumps({**res, "target_workgroups": target, "min_chunk": min_chunk}), flush=True)
        for target in [[int(v) for v in c.split(":")] for c in args.fast_targets.split(",") if c]:
            lora_matmul.FAST_PATHS = True
            lora_matmul.STREAM_WORKGROUPS, lora_matmul.ROWS_WORKGROUPS, lora_matmul.STREAM_UNROLL = (
                *target[:2],
                target[2] if len(target) > 2 else FAST_TARGETS[2],
            )
            res = ours(dev, "split", args.tokens, d_in, d_out, args.rank, args.seconds)
            print(json.dumps({**res, "fast_targets": target}), flush=True)
        lora_matmul.STREAM_WORKGROUPS, lora_matmul.ROWS_WORKGROUPS, lora_matmul.STREAM_UNROLL = FAST_TARGETS
        if not (args.no_split or splits or args.fast_targets):
            for path in (p for p in args.paths.split(",") if p):
                lora_matmul.FAST_PATHS = path == "fast"
                res = ours(dev, "split", args.tokens, d_in, d_out, args.rank, args.seconds)
                print(json.dumps({**res, "impl": f"ours_split_{path}"}), flush=True)
            lora_matmul.FAST_PATHS = True
        for impl in ([] if splits or args.fast_targets else ["fused"]) + ([] if args.no_old else ["old"]):
            print(json.dumps(ours(dev, impl, args.tokens, d_in, d_out, args.rank, args.seconds)), flush=True)
        if not args.no_torch:
            for res in torch_products(args.tokens, d_in, d_out, args.rank, args.seconds):
                print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
