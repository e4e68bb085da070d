"""GEMM throughput of the in-kernel-dequantizing matmul vs numpy, printed as JSON.

    python bench/gemm.py --n 512                       # M = N = K = 512, f32 + Q4_K + Q4_0, both orientations
    python bench/gemm.py --n 4096 --types F32 --tile 128,128,8,8,8

GFLOP/s = 2 M N K / wall time of `reps` dispatches recorded in one step (submit + wait by a small read).
numpy times the same product on the dequantized f32 weight (forward x @ W.T, input grad dy @ W).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from gpu.codegen import TileConfig  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops.matmul import gemm, pick_tile  # noqa: E402
from gpu.weights import random_blocks, upload_quant  # noqa: E402


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def bench_one(dev: Device, qtype: str, orient: str, m: int, n: int, k: int, reps: int, tile, rng) -> dict:
    qt = GGMLQuantizationType[qtype]
    raw = random_blocks(qt, (n, k), rng)
    w = upload_quant(dev, raw, qt, (n, k), name=f"bench_{qtype}")
    wd = dequantize(raw, qt).reshape(n, k).astype(np.float32)
    r, p = (k, n) if orient == "nt" else (n, k)
    a = rng.standard_normal((m, r)).astype(np.float32)
    ab, cb = dev.upload(a), dev.buffer(m * p * 4)
    t_compile = time.perf_counter()
    gemm(dev, ab, w, cb, m, orient=orient, tile=tile)
    dev.sync()
    t_compile = time.perf_counter() - t_compile

    def run() -> None:
        with dev.step():
            for _ in range(reps):
                gemm(dev, ab, w, cb, m, orient=orient, tile=tile)
        dev.sync()

    t = _time(run, 1) / reps
    c = dev.read(cb, np.float32, (m, p))
    ref = a @ (wd.T if orient == "nt" else wd)
    t_np = _time(lambda: a @ (wd.T if orient == "nt" else wd), max(reps, 3))
    flop = 2.0 * m * n * k
    return {
        "type": qtype,
        "orient": orient,
        "m": m,
        "n": n,
        "k": k,
        "ms": round(t * 1e3, 3),
        "gflops": round(flop / t / 1e9, 2),
        "numpy_ms": round(t_np * 1e3, 3),
        "numpy_gflops": round(flop / t_np / 1e9, 2),
        "first_call_s": round(t_compile, 3),
        "max_rel_err": float(np.abs(c - ref).max() / np.abs(ref).max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512, help="N = K (and M unless --m)")
    ap.add_argument("--m", type=int, default=None, help="rows of X (tokens)")
    ap.add_argument("--types", default="F32,Q4_K,Q4_0")
    ap.add_argument("--orients", default="nt,nn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tile", default=None, help="bm,bp,br,tm,tn (default: the device preset)")
    ap.add_argument("--backend", default=None)
    args = ap.parse_args()
    dev = Device(backend=args.backend)
    m, n = args.m or args.n, args.n
    tile = TileConfig(*map(int, args.tile.split(","))) if args.tile else None
    rng = np.random.default_rng(0)
    results = [
        bench_one(dev, t, o, m, n, n, args.reps, tile, rng)
        for t in args.types.split(",")
        for o in args.orients.split(",")
    ]
    d = dev.describe()
    out = {
        "bench": "gemm",
        "adapter": d["adapter"],
        "backend": d["backend"],
        "tile": str(tile or pick_tile(dev, m)),
        "results": results,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
