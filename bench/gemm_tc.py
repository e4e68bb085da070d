"""Tensor-core GEMM throughput (Dawn subgroup matrices), printed as JSON, with torch's from the same run.

    python bench/gemm_tc.py                                    # the default sizes, shapes and fused runs
    python bench/gemm_tc.py --sizes 4096 --cfg 2,4,4,2,32,2,8  # one tile: sg_m,sg_n,tm,tn,bk,stages,vec
    python bench/gemm_tc.py --sizes 4096 --shapes "" --generic Q4_K,Q4_0  # fused staging before / after
    python bench/gemm_tc.py --sizes "" --shapes 4096x256x2048 --fused-types "" --fused-a f16 \
        --sweep "preset;nt:4,2,2,2,32,2,8"   # candidate tiles on the shapes (both orientations or one)

"plain" is the f16 GEMM C[N, N] = A[N, N] . W^T with f16 A and an F16 weight; "shapes" are the real
projection shapes of a TinyLlama-sized student (M = 4096 rows: 2048 -> 5632, 5632 -> 2048, 2048 -> 256),
plain and fused (--shape-types, both orientations, each A dtype of --fused-a); "fused" dequantizes Q4_K /
Q4_0 weights into the f16 tiles, A f32 (as in training) and f16 (--fused-a), in both orientations (forward
"nt", input gradient "nn"), next to plain F16 with the same A;
--sweep times each candidate tile ("preset": pick_config's) on every shape, fused type and A dtype of the
shapes runs (instead of the presets' shapes runs), in both orientations or the one prefixed ("nt:");
--generic also times each fused type with the generic weight staging (two decode4 calls per 8 weights, the
kernel before gpu/codegen_tc.py's W_STAGING loaders), "w_stage" tells them apart.
TFLOP/s = 2 M N K / (wall time of `reps` dispatches recorded in one step, submit + wait), the median of 3
windows after a warm-up window (spread = their range over the median). Each result
carries max_rel_err: |C - ref| / max |ref| over 8 sampled rows, ref in float64 from the f16-rounded
operands. gpu_us / gpu_tflops: GPU time of one call by timestamp queries (median of 5; each dispatch in
its own compute pass), free of the host's recording time.
torch (when importable with CUDA) times torch.matmul in bf16 and fp16 on the same shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

import gpu.ops.matmul_tc as matmul_tc  # noqa: E402
from gpu.codegen_tc import W_STAGING, TCConfig  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops.matmul_tc import gemm_tc, pick_config, tensor_core_problem  # noqa: E402
from gpu.weights import random_blocks, upload_quant  # noqa: E402

PROJECTIONS = [(4096, 5632, 2048), (4096, 2048, 5632), (4096, 256, 2048)]  # (M, N, K): 2048->5632, ...


def dawn_device(toggles_arg: str) -> tuple[Device, list[str], str | None]:
    """(Dawn device with the comma-separated toggles enabled, the toggles, why it has no tensor cores or None)."""
    toggles = [t for t in toggles_arg.split(",") if t]
    use_dawn_toggles(toggles)
    dev = Device(backend="dawn")
    return dev, toggles, tensor_core_problem(dev)


def use_dawn_toggles(toggles: list[str]) -> None:
    """Make the next Dawn devices of this process enable `toggles` (e.g. disable_robustness): an experiment
    only, since a toggle applies to every kernel of the device."""
    import functools

    from wgpudawn.backends.dawn import extras

    if toggles:
        extras.request_device_sync = functools.partial(extras.request_device_sync, enable_toggles=toggles)


def parse_cfg(text: str) -> TCConfig:
    """'sg_m,sg_n,tm,tn,bk,stages,vec[,pad,group_m][,field=int...]' -> TCConfig (e.g. producers=4)."""
    parts = text.split(",")
    named = dict(p.split("=", 1) for p in parts if "=" in p)
    return TCConfig(*[int(x) for x in parts if "=" not in x], **{k: int(v) for k, v in named.items()})


def parse_candidates(text: str) -> list[tuple[str | None, TCConfig | None]]:
    """'[orient:]cfg;...' with cfg 'preset' or as parse_cfg -> [(orient or None for both, TCConfig or None for
    the preset), ...]."""
    out = []
    for item in (s for s in text.split(";") if s):
        orient, _, cfg = item.rpartition(":")
        out.append((orient or None, None if cfg == "preset" else parse_cfg(cfg)))
    return out


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'MxNxK,...' -> [(M, N, K), ...]."""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]  # type: ignore[misc]


@contextmanager
def generic_staging(on: bool) -> Iterator[None]:
    """While on, gemm_tc dispatches the generic weight staging (TCVariant.w_generic) for every type."""
    if not on:
        yield
        return
    chosen = matmul_tc.variant_for
    matmul_tc.variant_for = lambda *a, **kw: replace(chosen(*a, **kw), w_generic=True)
    try:
        yield
    finally:
        matmul_tc.variant_for = chosen


def time_gemm(
    dev: Device,
    qtype: str,
    orient: str,
    m: int,
    n: int,
    k: int,
    *,
    cfg: TCConfig | None = None,
    a_dtype: str = "f32",
    seconds: float = 0.25,
    check_rows: int = 8,
    generic: bool = False,
    rng: np.random.Generator | None = None,
) -> dict[str, Any]:
    """Time C = A . W^T ("nt") or A . W ("nn") for a random W (n, k) of qtype; check sampled rows."""
    rng = rng or np.random.default_rng(0)
    qt = GGMLQuantizationType[qtype]
    raw = random_blocks(qt, (n, k), rng)
    w = upload_quant(dev, raw, qt, (n, k), name=f"bench_{qtype}")
    r, p = (k, n) if orient == "nt" else (n, k)
    a = rng.standard_normal((m, r), dtype=np.float32)
    a_dev = dev.upload(a.astype(np.float16) if a_dtype == "f16" else a)
    c_dev = dev.buffer(m * p * 4)
    cfg = cfg or pick_config(m, p)

    def call() -> None:
        gemm_tc(dev, a_dev, w, c_dev, m, orient=orient, a_dtype=a_dtype, cfg=cfg)

    with generic_staging(generic):
        timing = time_calls(dev, call, seconds)
    t = timing["seconds"]
    with generic_staging(generic):
        gpu = gpu_time(dev, call)
    if "gpu_us" in gpu:
        gpu["gpu_tflops"] = round(2.0 * m * n * k / (gpu["gpu_us"] * 1e-6) / 1e12, 2)
    out = {
        "type": qtype,
        "orient": orient,
        "a_dtype": a_dtype,
        "w_stage": "generic" if generic or qtype not in W_STAGING else "dedicated",
        "m": m,
        "n": n,
        "k": k,
        "cfg": cfg.label,
        "ms": round(t * 1e3, 4),
        "tflops": round(2.0 * m * n * k / t / 1e12, 2),
        **{key: timing[key] for key in ("reps", "spread", "first_call_s")},
        **gpu,
    }
    if check_rows:
        rows = np.sort(rng.choice(m, size=min(check_rows, m), replace=False))
        c = np.stack([dev.read(c_dev, np.float32, (p,), offset=int(i) * p * 4) for i in rows]).astype(np.float64)
        wd = dequantize(raw, qt).reshape(n, k).astype(np.float16).astype(np.float64)
        a16 = a[rows].astype(np.float16).astype(np.float64)
        ref = a16 @ (wd.T if orient == "nt" else wd)
        out["max_rel_err"] = float(np.abs(c - ref).max() / np.abs(ref).max())
    return out


def time_calls(dev: Device, call: Callable[[], None], seconds: float) -> dict[str, Any]:
    """Wall time of one `call`: compile + first run, then a warm-up window (clocks come up after the idle gap of
    data generation and compilation; the windows' length comes from it, since a slow single call would make
    them too short to time steadily), then the median of 3 windows of `reps` calls recorded in one step
    (submit + wait). spread = (slowest - fastest window) / median."""

    def run(reps: int) -> float:
        t = time.perf_counter()
        with dev.step():
            for _ in range(reps):
                call()
        dev.sync()
        return time.perf_counter() - t

    first = run(1)
    reps = int(min(500, max(3, seconds / max(run(1), 1e-6))))
    reps = int(min(1000, max(3, seconds / max(run(reps) / reps, 1e-6))))
    windows = sorted(run(reps) / reps for _ in range(3))
    spread = round((windows[2] - windows[0]) / windows[1], 3)
    return {"seconds": windows[1], "reps": reps, "spread": spread, "first_call_s": round(first, 3)}


def gpu_time(dev: Device, call: Any, reps: int = 5) -> dict[str, Any]:
    """GPU microseconds of one call by timestamp queries (median over reps, each dispatch in its own pass, all of
    a call's dispatches summed); {} without timestamp queries, the error when the profiler fails."""
    if "timestamp-query" not in dev.features:
        return {}
    from bench.lora import DispatchProfiler

    try:
        with DispatchProfiler(dev) as prof:
            with dev.step():
                for _ in range(reps):
                    call()
    except Exception as e:  # noqa: BLE001 - the wall-clock figures stand without it
        return {"gpu_error": str(e)[-300:]}
    per = [ns for _, ns in sorted((label, ns) for (_, label), ns in prof.ns.items())]  # in dispatch order
    d = max(1, len(per) // reps)  # dispatches per call
    totals = sorted(sum(per[j * d : (j + 1) * d]) for j in range(reps))
    return {"gpu_us": round(totals[reps // 2] / 1e3, 2)}


def torch_tflops(
    sizes: list[int], shapes: list[tuple[int, int, int]] = (), seconds: float = 0.25, *, int8: bool = False
) -> dict[str, Any]:
    """torch.matmul TFLOP/s for square (N) and (M, N, K) bf16 / fp16 products (CUDA events, random data),
    keyed by "N" or "MxNxK"; int8=True adds torch._int_mm (int8 x int8 -> int32, TOPS); or why there is none."""
    try:
        import torch
    except ImportError as e:
        return {"error": f"torch not importable: {e}"}
    if not torch.cuda.is_available():
        return {"error": "torch has no CUDA device"}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    kinds = [("bf16", torch.bfloat16, torch.matmul), ("fp16", torch.float16, torch.matmul)]
    kinds += [("int8", torch.int8, torch._int_mm)] if int8 else []
    for name, dtype, matmul in kinds:
        res = {}
        for m, n, k in [(s, s, s) for s in sizes] + list(shapes):
            if dtype == torch.int8:
                a = torch.randint(-127, 128, (m, k), device="cuda", dtype=dtype)
                b = torch.randint(-127, 128, (n, k), device="cuda", dtype=dtype).t()  # column-major, as _int_mm wants
            else:
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(k, n, device="cuda", dtype=dtype)
            matmul(a, b)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            reps = int(min(1000, max(5, seconds * 1e3 / max(start.elapsed_time(end), 1e-3))))
            start.record()
            for _ in range(reps):
                matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            t = start.elapsed_time(end) / 1e3 / reps
            key = str(m) if m == n == k else f"{m}x{n}x{k}"
            res[key] = round(2.0 * m * n * k / t / 1e12, 1)
            del a, b
        out[name] = res
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096,8192", help="N = M = K of the plain f16 GEMM")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in PROJECTIONS), help="MxNxK,...")
    ap.add_argument("--shape-types", default="Q4_K", help="fused weight types of the shapes runs (A: --fused-a)")
    ap.add_argument("--fused-n", type=int, default=4096, help="N = M = K of the fused Q4_K / Q4_0 runs")
    ap.add_argument("--fused-types", default="Q4_K,Q4_0")
    ap.add_argument("--fused-a", default="f32,f16", help="A dtypes of the fused runs")
    ap.add_argument("--generic", default="", help="fused types also timed with the generic staging, e.g. Q4_K,Q4_0")
    ap.add_argument("--seconds", type=float, default=0.25, help="length of one timing window")
    ap.add_argument("--cfg", default=None, help="sg_m,sg_n,tm,tn,bk,stages,vec[,pad,group_m] (default: presets)")
    ap.add_argument("--sweep", default="", help="candidate tiles '[nt:|nn:]cfg;...' timed on the shapes (cfg: preset)")
    ap.add_argument("--toggles", default="", help="Dawn device toggles to enable, e.g. disable_robustness")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    dev, toggles, problem = dawn_device(args.toggles)
    if problem is not None:
        print(json.dumps({"bench": "gemm_tc", "error": problem}))
        sys.exit(1)
    cfg = parse_cfg(args.cfg) if args.cfg else None
    sizes = [int(s) for s in args.sizes.split(",") if s]
    shapes = parse_shapes(args.shapes)
    a_types = [x for x in args.fused_a.split(",") if x]
    shape_types = [t for t in args.shape_types.split(",") if t]
    plain = [time_gemm(dev, "F16", "nt", n, n, n, cfg=cfg, a_dtype="f16", seconds=args.seconds) for n in sizes]
    runs = [("F16", "nt", "f16")] + [(t, o, a) for t in shape_types for o in ("nt", "nn") for a in a_types]
    proj = (
        []
        if args.sweep
        else [
            time_gemm(dev, t, o, m, n, k, cfg=cfg, a_dtype=a, seconds=args.seconds)
            for m, n, k in shapes
            for t, o, a in runs
        ]
    )
    sweep = [
        time_gemm(dev, t, o, m, n, k, cfg=sc, a_dtype=a, seconds=args.seconds)
        for m, n, k in shapes
        for t in shape_types
        for a in a_types
        for o in ("nt", "nn")
        for so, sc in parse_candidates(args.sweep)
        if so in (None, o)
    ]
    fn = args.fused_n
    types = [t for t in args.fused_types.split(",") if t]
    generic = [t for t in args.generic.split(",") if t]
    stagings = [("F16", False)] + [(t, g) for t in types for g in ((True, False) if t in generic else (False,))]
    fused = [
        time_gemm(dev, t, o, fn, fn, fn, cfg=cfg, a_dtype=a, generic=g, seconds=args.seconds)
        for a in a_types
        for o in ("nt", "nn")
        for t, g in stagings
    ]
    out = {
        "bench": "gemm_tc",
        "adapter": dev.adapter.summary,
        "backend": dev.backend,
        "toggles": toggles,
        "plain_f16": plain,
        "shapes": proj,
        "fused": fused,
        "sweep": sweep,
        "torch": {} if args.no_torch else torch_tflops(sizes, shapes),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
