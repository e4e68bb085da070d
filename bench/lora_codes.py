"""LoRA's thin products over the integer path's int8 codes against the same products over f32, as JSON lines
(gpu/ops/lora_matmul.py lora_matmul with Codes, gpu/kernels/lora_gemm_codes.wgsl).

    python bench/lora_codes.py                              # T = 4096 (B4 x T1024), r = 16, the Llama-3-8B widths
    python bench/lora_codes.py --tokens 256 --widths 576    # small, e.g. on lavapipe

Per width d and product: "t" (x [T, d] . A^T [d, r]: along the large operand's rows, x's row scales), "dt"
(dY [T, d] . B [d, r], W's row scales divided out too) and "dB" (dY^T [d, T] . t [T, r]: across its rows). ms: wall
time of the product (lora_gemm + lora_reduce), median of 3 windows; gpu_us: GPU microseconds per dispatch by
timestamp queries (each dispatch in its own pass); max_rel_err of the codes product against float64 numpy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import timed  # noqa: E402
from bench.lora import DispatchProfiler  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops import lora_matmul  # noqa: E402
from gpu.ops.lora_matmul import DIVIDED, TIMES, Codes  # noqa: E402
from gpu.ops.strided_matmul import row_major, transposed  # noqa: E402
from model.int8 import pack_i8, quantize_i8  # noqa: E402

PRODUCTS = ("t", "dt", "dB")


def _timings(dev: Device, call: Callable[[], None], seconds: float) -> dict[str, Any]:
    def go(reps: int) -> float:
        t0 = time.perf_counter()
        with dev.step():
            for _ in range(reps):
                call()
        dev.sync()
        return time.perf_counter() - t0

    sec, reps, spread = timed(go, seconds)
    out: dict[str, Any] = {"ms": round(sec * 1e3, 4), "reps": reps, "spread": round(spread, 3)}
    if "timestamp-query" in dev.features:
        with DispatchProfiler(dev) as prof:
            with dev.step():
                call()
        out["gpu_us"] = [[label[3:60], round(ns / 1e3, 1)] for (_, label), ns in sorted(prof.ns.items(), key=str)]
    return out


def one(dev: Device, product: str, n: int, d: int, r: int, seconds: float) -> list[dict[str, Any]]:
    """The product at width d over f32 and over codes: two rows."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((n, d), dtype=np.float32)
    codes, scales = quantize_i8(x, d)
    col = rng.uniform(0.5, 2.0, d).astype(np.float32)
    s = rng.standard_normal((d if product != "dB" else n, r), dtype=np.float32)
    xb, sb, cb = dev.upload(x), dev.upload(s), dev.upload(pack_i8(codes))
    rs, cs = dev.upload(scales.reshape(-1)), dev.upload(col)
    if product == "dB":
        m, k = d, n
        a32, a8 = transposed(xb, d), transposed(cb, d)
        spec = Codes((cs, DIVIDED), (rs, TIMES))
        want = (codes.astype(np.float64) * scales).T / col.reshape(-1, 1)
    else:
        m, k = n, d
        a32, a8 = row_major(xb, d), row_major(cb, d)
        spec = Codes((rs, TIMES), (cs, DIVIDED) if product == "dt" else None)
        want = codes.astype(np.float64) * scales / (col if product == "dt" else 1.0)
    want = want @ s.astype(np.float64)
    out = dev.buffer(4 * m * r)
    rows = []
    for kind, a, codes_spec in (("f32", a32, None), ("codes", a8, spec)):

        def call(a: Any = a, codes_spec: Codes | None = codes_spec) -> None:
            lora_matmul.lora_matmul(dev, a, row_major(sb, r), out, m, r, k, codes=codes_spec)

        row: dict[str, Any] = {"product": product, "operand": kind, "tokens": n, "width": d, "r": r}
        row.update(_timings(dev, call, seconds))
        if kind == "codes":
            call()
            got = dev.read(out, np.float32, (m, r)).astype(np.float64)
            row["max_rel_err"] = float(f"{np.abs(got - want).max() / np.abs(want).max():.3g}")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="token rows T (batch x sequence)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--widths", default="4096,14336,1024", help="comma-separated widths d of x or dY")
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"comma-separated, of {', '.join(PRODUCTS)}")
    ap.add_argument("--seconds", type=float, default=0.3, help="target length of one timing window")
    ap.add_argument(
        "--targets", default=str(lora_matmul.CODES_WORKGROUPS),
        help="comma-separated sweep of the codes kernels' workgroup target (lora_matmul.CODES_WORKGROUPS)",
    )  # fmt: skip
    ap.add_argument(
        "--paths", default="tc,fma",
        help="comma-separated: tc (the f16 tensor cores, where the device has subgroup matrices), fma (multiply-adds)",
    )  # fmt: skip
    args = ap.parse_args()
    dev = Device(backend="dawn") if "tc" in args.paths.split(",") else Device()
    print(json.dumps({"what": "device", **dev.describe()}))
    for path, target in ((p, int(t)) for p in args.paths.split(",") for t in args.targets.split(",")):
        lora_matmul.CODES_TENSOR_CORES = path == "tc"
        lora_matmul.CODES_WORKGROUPS = lora_matmul.CODES_TC_WORKGROUPS = target
        for d in (int(w) for w in args.widths.split(",")):
            for product in args.products.split(","):
                if product not in PRODUCTS:
                    ap.error(f"--products: {product!r} is not one of {', '.join(PRODUCTS)}")
                for row in one(dev, product, args.tokens, d, args.rank, args.seconds):
                    print(json.dumps({**row, "path": path, "codes_workgroups": target}), flush=True)


if __name__ == "__main__":
    main()
