"""Tensor-core GEMM tuning sweep (a GPU with subgroup matrices): tile configs x Dawn toggles, checked and timed, as
JSON lines (one per run) plus a summary table; adaptive, so one call does the whole study.

    source .gl/enter.sh; python3 bench/tc_probe.py            # lines to $OUT/tc_sweep.jsonl, table on stdout
    TC_PROBE_EMULATE=1 TC_PROBE_N=256 python bench/tc_probe.py --quick   # plumbing dry run on lavapipe

Phases (each job a subprocess, so a bad kernel or a lost device only loses its own job):
  1. tiles: every config of TILES, Dawn defaults: correctness on odd shapes (both orientations, K tails),
     then the F16 GEMM at N (f16 A);
  2. toggles: the 3 fastest correct tiles under each set of TOGGLES (robustness moved to the driver, range
     analysis, robustness off);
  3. where the time goes: the fastest tile with its MMAs dropped / its staging dropped (PROBES), plain
     raster order, the checked epilogue;
  4. shapes: the 2 fastest at N/4..2N, the projection shapes, fused Q4_K / Q4_0 (f32 A), both orientations;
  5. torch bf16 / fp16 on the same shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> TCConfig keyword arguments
TILES: dict[str, dict[str, Any]] = {
    "4x4_2x2_s0_v4_flat": dict(sg_m=4, sg_n=4, tm=2, tn=2, stages=0, vec=4, split=False),
    "4x4_2x2_s0_v4": dict(sg_m=4, sg_n=4, tm=2, tn=2, stages=0, vec=4),
    "4x4_2x2_s1_v8": dict(sg_m=4, sg_n=4, tm=2, tn=2, stages=1, vec=8),
    "2x4_4x2_s1_v8": dict(sg_m=2, sg_n=4, tm=4, tn=2, stages=1, vec=8),
    "2x4_4x2_s2_v8": dict(sg_m=2, sg_n=4, tm=4, tn=2, stages=2, vec=8),
    "2x4_4x2_s2_v8_flat": dict(sg_m=2, sg_n=4, tm=4, tn=2, stages=2, vec=8, split=False),
    "4x2_2x4_s2_v8": dict(sg_m=4, sg_n=2, tm=2, tn=4, stages=2, vec=8),
    "2x2_4x4_s1_v8": dict(sg_m=2, sg_n=2, tm=4, tn=4, stages=1, vec=8),
    "2x2_4x4_s2_v8": dict(sg_m=2, sg_n=2, tm=4, tn=4, stages=2, vec=8),
    "2x2_4x4_k64_s1_v8": dict(sg_m=2, sg_n=2, tm=4, tn=4, bk=64, stages=1, vec=8),
    "4x2_4x4_s1_v8": dict(sg_m=4, sg_n=2, tm=4, tn=4, stages=1, vec=8),
    "4x4_2x4_s1_v8": dict(sg_m=4, sg_n=4, tm=2, tn=4, stages=1, vec=8),
    "2x2_2x2_s2_v8": dict(sg_m=2, sg_n=2, tm=2, tn=2, stages=2, vec=8),
}
TOGGLES: dict[str, list[str]] = {
    "hwrobust_range": [  # robustness kept, moved to the driver (robustBufferAccess2) + range analysis
        "vulkan_use_buffer_robust_access_2",
        "vulkan_use_cooperative_matrix_robust_access",
        "enable_integer_range_analysis_in_robustness",
    ],
    "norobust": ["disable_robustness"],
}
PROJECTIONS = [(4096, 5632, 2048), (4096, 2048, 5632), (4096, 256, 2048)]
EMULATE = os.environ.get("TC_PROBE_EMULATE") == "1"  # dry run without tensor cores (lavapipe)
N = int(os.environ.get("TC_PROBE_N", "4096"))
DEADLINE_S = float(os.environ.get("TC_PROBE_DEADLINE", "240"))
CHECKS = [  # (type, orient, a_dtype, m, n, k): off every tile grid, K tails, "nn" with K % 8 != 0
    ("F16", "nt", "f16", 130, 200, 520),
    ("F16", "nn", "f16", 77, 200, 516),
    ("Q4_K", "nt", "f32", 1, 72, 768),
    ("Q4_K", "nn", "f32", 130, 201, 512),
]


# ---- worker (one subprocess per job) ---------------------------------------------------------------------
def _device(toggles: list[str]):
    import functools

    from gpu.device import Device

    if EMULATE:
        import bench.gemm_tc
        import gpu.ops.matmul_tc

        emu = functools.partial(gpu.ops.matmul_tc.gemm_tc, emulate=True)
        gpu.ops.matmul_tc.gemm_tc = bench.gemm_tc.gemm_tc = emu
        return Device(backend="wgpu")
    from bench.gemm_tc import use_dawn_toggles

    use_dawn_toggles(toggles)
    return Device(backend="dawn")


def _errors(dev, cfg) -> list[dict[str, Any]]:
    """Relative error vs float64 on f16-rounded operands for each CHECKS case; C is NaN-poisoned first."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from gpu.ops.matmul_tc import gemm_tc
    from gpu.weights import random_blocks, upload_quant

    out = []
    rng = np.random.default_rng(1)
    for qtype, orient, a_dtype, m, n, k in CHECKS:
        qt = GGMLQuantizationType[qtype]
        raw = random_blocks(qt, (n, k), rng)
        wd = dequantize(raw, qt).reshape(n, k).astype(np.float16).astype(np.float64)
        w = upload_quant(dev, raw, qt, (n, k))
        r, p = (k, n) if orient == "nt" else (n, k)
        a = rng.standard_normal((m, r)).astype(np.float32)
        c = dev.upload(np.full((m, p), np.nan, np.float32))
        try:
            a_dev = dev.upload(a.astype(np.float16) if a_dtype == "f16" else a)
            gemm_tc(dev, a_dev, w, c, m, orient=orient, a_dtype=a_dtype, cfg=cfg)
            got = dev.read(c, np.float32, (m, p)).astype(np.float64)
        except Exception as e:  # noqa: BLE001 - report, keep probing
            out.append({"case": [qtype, orient, a_dtype, m, n, k], "error": str(e)[-600:]})
            continue
        ref = a.astype(np.float16).astype(np.float64) @ (wd.T if orient == "nt" else wd)
        err = float(np.abs(got - ref).max() / np.abs(ref).max()) if np.isfinite(got).all() else float("inf")
        out.append({"case": [qtype, orient, a_dtype, m, n, k], "rel_err": err})
    return out


def worker(job: dict[str, Any]) -> None:
    """Run one job's runs, printing one JSON line per run as it completes."""
    if job.get("torch"):
        from bench.gemm_tc import torch_tflops

        print(json.dumps({"torch": torch_tflops(job["sizes"], [tuple(s) for s in job["shapes"]])}), flush=True)
        return
    from bench.gemm_tc import time_gemm
    from gpu.codegen_tc import TCConfig

    dev = _device(job.get("toggles", []))
    if job.get("env"):
        info = {"describe": dev.describe()}
        if dev.backend == "dawn":
            from wgpudawn.backends.dawn import extras

            info["toggles"] = sorted(extras.get_toggles(dev.device))
            info["subgroup_matrix_configs"] = str(
                extras.get_adapter_properties(dev.adapter).get("subgroup_matrix_configs")
            )
        print(json.dumps({"env": info}), flush=True)
        return
    for run in job["runs"]:
        cfg = TCConfig(**run["cfg"])
        res: dict[str, Any] = {"name": run["name"], "toggles": job["name"], "cfg": cfg.label}
        t0 = time.perf_counter()
        try:
            if run.get("check", True):
                res["errors"] = _errors(dev, cfg)
                res["ok"] = all(e.get("rel_err", 1.0) < 1e-3 for e in res["errors"])
            if res.get("ok", True):
                res["time"] = [
                    time_gemm(dev, t, o, m, n, k, cfg=cfg, a_dtype=a, seconds=run.get("seconds", 0.1))
                    for t, o, a, m, n, k in run["time"]
                ]
        except Exception as e:  # noqa: BLE001 - report, keep probing
            res["error"] = str(e)[-1500:]
        res["s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(res), flush=True)


# ---- driver ----------------------------------------------------------------------------------------------
def run_job(job: dict[str, Any], timeout: float, sink) -> list[dict[str, Any]]:
    """Run a job in a subprocess; its JSON lines (also those before a crash or timeout) go to sink."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        stdout, tail = proc.stdout, ("" if proc.returncode == 0 else f"rc {proc.returncode}: {proc.stderr[-1500:]}")
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail = f"timeout after {timeout:.0f} s"
    lines = [json.loads(s) for s in stdout.splitlines() if s.startswith("{")]
    if tail:
        lines.append({"job": job["name"], "problem": tail})
    for line in lines:
        sink(line)
    print(f"# job {job['name']}: {len(lines)} lines, {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return lines


def tflops(res: dict[str, Any], i: int = 0) -> float:
    times = res.get("time") or []
    return times[i].get("tflops", 0.0) if len(times) > i else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 tiles, no toggles (dry runs)")
    args = ap.parse_args()
    start = time.perf_counter()
    out_dir = os.environ.get("OUT")
    fh = open(Path(out_dir) / "tc_sweep.jsonl", "a") if out_dir else None  # noqa: SIM115
    results: list[dict[str, Any]] = []

    def sink(line: dict[str, Any]) -> None:
        results.append(line)
        if fh:
            fh.write(json.dumps(line) + "\n")
            fh.flush()

    def left() -> float:
        return DEADLINE_S - (time.perf_counter() - start)

    big = ("F16", "nt", "f16", N, N, N)
    run_job({"name": "env", "env": True}, 60, sink)
    tiles = TILES
    if args.quick:  # the tiles a lavapipe-sized device (32 KiB of workgroup memory) takes
        from gpu.codegen_tc import TCConfig

        tiles = {n: kw for n, kw in TILES.items() if TCConfig(**kw).workgroup_bytes("nt") <= 32768}
    names = list(tiles)
    for i in range(0, len(names), 7):  # a few tiles per process: device start-up once per group
        runs = [{"name": n, "cfg": tiles[n], "time": [big]} for n in names[i : i + 7]]
        run_job({"name": "default", "runs": runs}, min(150, max(left(), 10)), sink)
    ranked = sorted(
        (r for r in results if r.get("ok") and r.get("time") and r["name"] in tiles), key=lambda r: -tflops(r)
    )
    top = [r["name"] for r in ranked[:2]]
    if not top:
        print(json.dumps({"error": "no correct tile", "results": results}))
        return
    best = top[0]
    if not args.quick:
        for tname, toggles in TOGGLES.items():
            if left() < 60:
                break
            runs = [{"name": n, "cfg": tiles[n], "time": [big]} for n in top]
            run_job({"name": tname, "toggles": toggles, "runs": runs}, min(90, left()), sink)
    # the fastest safe toggle set (norobust drops bounds checks everywhere: reported, not chosen)
    safe = [r for r in results if r.get("name") == best and r.get("ok") and r.get("toggles") != "norobust"]
    best_toggles = max(safe, key=tflops)["toggles"] if safe else "default"
    tog = [] if best_toggles == "default" else TOGGLES[best_toggles]
    probes = [
        {"name": f"{best}+{p}", "cfg": {**tiles[best], **kw}, "time": [big], "check": check}
        for p, kw, check in (
            ("no_mma", {"probe": "no_mma"}, False),
            ("no_stage", {"probe": "no_stage"}, False),
            ("g0", {"group_m": 0}, False),
        )
    ]
    if left() > 45:
        run_job({"name": best_toggles, "toggles": tog, "runs": probes}, min(90, left()), sink)
    kinds = (("F16", "nt", "f16"), ("Q4_K", "nt", "f32"), ("Q4_K", "nn", "f32"))  # plain, fused fwd / input grad
    shapes = (
        [("F16", "nt", "f16", s, s, s) for s in (N // 4, N // 2, 2 * N)]
        + [(t, o, a, m, n, k) for m, n, k in PROJECTIONS for t, o, a in kinds]
        + [(t, o, "f32", N, N, N) for t in ("F16", "Q4_K", "Q4_0") for o in ("nt", "nn")]
        + [("F16", "nt", "f16", 2 * N, 2 * N, 2 * N)]  # again last: the spread of one measurement
    )
    if EMULATE:
        shapes = shapes[:2]
    for name in top[:1]:
        if left() > 40:
            runs = [{"name": name, "cfg": tiles[name], "time": shapes, "check": False, "seconds": 0.08}]
            run_job({"name": best_toggles, "toggles": tog, "runs": runs}, min(150, left()), sink)
    if not EMULATE and left() > 15:
        run_job({"name": "torch", "torch": True, "sizes": [N // 4, N // 2, N, 2 * N], "shapes": PROJECTIONS}, 90, sink)
    # summary table (the reply carries the tail of stdout)
    print(f"# total {time.perf_counter() - start:.0f} s; top {top}; best toggles {best_toggles}")
    for r in results:
        if "time" in r:
            ts = " ".join(
                f"{x['type']}/{x['orient']}/{x['a_dtype']}/{x['m']}x{x['n']}x{x['k']}={x['tflops']}" for x in r["time"]
            )
            errs = max((e.get("rel_err", 9.0) for e in r.get("errors", [])), default=-1)
            print(f"{r['toggles']:>14} {r['name']:<24} err={errs:.1e} {ts}")
        elif "torch" in r:
            print("torch", json.dumps(r["torch"]))
        elif "env" not in r:
            print(json.dumps(r)[:600])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
