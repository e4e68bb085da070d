"""Integer tensor-core GEMM throughput (Dawn i8 subgroup matrices, gpu/ops/matmul_i8.py), as JSON, with torch's bf16
GEMM and int8 torch._int_mm from the same process.

    python bench/gemm_i8.py                                   # the Llama-3-8B projection shapes, preset tile
    python bench/gemm_i8.py --shapes 4096x4096x4096 --chunks 0,256 --sweep "4,2,4,2,64,2;2,2,4,4,64,2"
    python bench/gemm_i8.py --probes                          # the preset without MMAs / staging / scaling
    python bench/gemm_i8.py --probes --lora 16 --chunks 0     # + the LoRA epilogue without its blocks' products
    python bench/gemm_i8.py --orient nn --shapes 4096x4096x4096,4096x4096x1024,4096x4096x14336,4096x14336x4096

Each row: C[M, N] = A[M, K] . W[N, K]^T over int8 codes with one f32 scale per row and chunk of K (--chunks;
0 = one chunk, i.e. per-row scales), TOPS = 2 M N K / time (wall: median of 3 windows of calls recorded in
one step; gpu_tops: timestamp queries, median of 5), max_rel_err against model/int8.py's float64 reference on
the same codes over 8 sampled rows. quantize rows: the activation quantizer (gpu/kernels/quantize_i8.wgsl)
on M x K f32, in GB/s of f32 read. --orient nn times the input-gradient GEMM instead: C[M, N] = A[M, K] . W[K, N]
with W's codes stored [K, N] (a weight read by columns) and one f32 scale per column of C.
--sweep tiles: 'sg_m,sg_n,tm,tn,bk,fm[,pad,group_m]'. --lora 16 adds a rank-16 LoRA term t . B^T in the GEMM's
epilogue ("nt", one chunk; rows "lora": 16, checked against float64 on its f16 operands) beside the plain rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemm_tc import gpu_time, parse_shapes, time_calls, torch_tflops  # noqa: E402
from gpu.codegen_i8 import LORA_PROBES, PROBES, I8Config  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops.lora import lora_rank16, lora_term  # noqa: E402
from gpu.ops.matmul_i8 import (  # noqa: E402
    I8_TILE,
    Int8Matrix,
    gemm_i8,
    i8_buffers,
    int8_problem,
)
from gpu.ops.quantize_i8 import quantize_i8_gpu  # noqa: E402
from model.int8 import gemm_i8_reference, pack_i8  # noqa: E402

# Llama-3-8B's projections at B4 x T1024: q/o 4096 -> 4096, k/v 4096 -> 1024, gate/up 4096 -> 14336, down 14336 -> 4096
LLAMA8B = [(4096, 4096, 4096), (4096, 1024, 4096), (4096, 14336, 4096), (4096, 4096, 14336)]


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def parse_cfg(text: str) -> I8Config:
    """'sg_m,sg_n,tm,tn,bk,fm[,pad,group_m][,probe=name]' -> I8Config."""
    parts = text.split(",")
    named = dict(p.split("=", 1) for p in parts if "=" in p)
    return I8Config(
        *[int(x) for x in parts if "=" not in x], **{k: int(v) if v.isdigit() else v for k, v in named.items()}
    )


def random_i8(dev: Device, rows: int, k: int, chunk: int, rng: np.random.Generator) -> tuple[Int8Matrix, Any]:
    """Random codes in [-127, 127] and scales ~ 1/127 on the GPU, and the host copies (codes, scales)."""
    codes = rng.integers(-127, 128, size=(rows, k), dtype=np.int8)
    scales = (rng.uniform(0.5, 1.5, size=(rows, k // chunk)) / 127).astype(np.float32)
    return Int8Matrix(dev.upload(pack_i8(codes)), dev.upload(scales), rows, k, chunk), (codes, scales)


def time_gemm_i8(
    dev: Device,
    m: int,
    n: int,
    k: int,
    chunk: int,
    cfg: I8Config,
    rng: np.random.Generator,
    check: bool = True,
    orient: str = "nt",
    lora: int = 0,
    accumulate: bool = False,
) -> dict[str, Any]:
    chunk = chunk or k
    a, (ac, asc) = random_i8(dev, m, k, chunk, rng)
    if orient == "nt":
        w, (wc, wsc) = random_i8(dev, n, k, chunk, rng)
        col = None
    else:  # W [K, N]: one "chunk" per row of W; the column scales take the place of W's
        w, (wc, _) = random_i8(dev, k, n, n, rng)
        wsc = (rng.uniform(0.5, 1.5, size=n) / 127).astype(np.float32)
        col = dev.upload(wsc)
    c = dev.buffer(4 * m * n)
    term = t16 = b16 = None
    if lora:  # t [m, r], B [n, r], scale 2: packed once, as the engine does per projection
        t, b = (rng.standard_normal((size, lora), dtype=np.float32) * 0.1 for size in (m, n))
        lr = lora_rank16(lora)
        term = lora_term(dev, dev.upload(t), dev.upload(b), m, n, lora, 2.0, "rows", dev.buffer(2 * m * lr),
                         dev.buffer(2 * n * lr))  # fmt: skip
        t16, b16 = ((2 * t).astype(np.float16).astype(np.float64), b.astype(np.float16).astype(np.float64))

    def call() -> None:
        gemm_i8(dev, a, w, c, orient=orient, col_scales=col, cfg=cfg, lora=term, accumulate=accumulate)

    timing = time_calls(dev, call, 0.25)
    ops = 2.0 * m * n * k
    row = {
        "m": m,
        "n": n,
        "k": k,
        "chunk": chunk,
        "orient": orient,
        "cfg": cfg.label,
        "lora": lora,
        "accumulate": accumulate,
        "ms": round(timing["seconds"] * 1e3, 4),
        "tops": round(ops / timing["seconds"] / 1e12, 1),
        **{key: timing[key] for key in ("reps", "spread", "first_call_s")},
        **gpu_time(dev, call),
    }
    if "gpu_us" in row:
        row["gpu_tops"] = round(ops / (row["gpu_us"] * 1e-6) / 1e12, 1)
    if check and cfg.probe in ("", "direct"):  # "direct" computes the real product
        if accumulate:  # onto zeros: the timing's calls piled up in C
            dev.clear(c)
            call()
        rows = np.sort(rng.choice(m, size=min(8, m), replace=False))
        got = np.stack([dev.read(c, np.float32, (n,), offset=int(i) * n * 4) for i in rows]).astype(np.float64)
        if orient == "nt":
            ref = gemm_i8_reference(ac[rows], asc[rows], wc, wsc) + (t16[rows] @ b16.T if lora else 0.0)
        else:
            ref = (ac[rows].astype(np.float64) * asc[rows]) @ wc.astype(np.float64) * wsc.astype(np.float64)
        row["max_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    return row


def time_quantize(dev: Device, m: int, k: int, chunk: int, rng: np.random.Generator) -> dict[str, Any]:
    x = dev.upload(rng.standard_normal((m, k), dtype=np.float32))
    out = i8_buffers(dev, m, k, chunk or k, "x")
    timing = time_calls(dev, lambda: quantize_i8_gpu(dev, x, out), 0.25)
    t = timing["seconds"]
    return {
        "op": "quantize_i8",
        "m": m,
        "k": k,
        "chunk": chunk or k,
        "us": round(t * 1e6, 1),
        "gbs": round(4 * m * k / t / 1e9, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in LLAMA8B), help="MxNxK,...")
    ap.add_argument("--chunks", default="0,256", help="codes per scale along K (0: one per row), comma-separated")
    ap.add_argument("--sweep", default="", help="tiles 'sg_m,sg_n,tm,tn,bk,fm;...' (default: the preset)")
    ap.add_argument("--probes", action="store_true", help="also the preset without MMAs / staging / scaling")
    ap.add_argument("--orient", default="nt", choices=("nt", "nn"), help="forward (nt) or input-gradient (nn) GEMM")
    ap.add_argument("--lora", type=int, default=0, help="also each shape with a LoRA term of this rank in the epilogue")
    ap.add_argument("--accumulate", action="store_true", help="time C += A . B (the summed input gradients)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    dev = Device("dawn")
    problem = int8_problem(dev)
    if problem:
        raise SystemExit(f"bench/gemm_i8.py: {problem}")
    shapes = parse_shapes(args.shapes)
    chunks = [int(x) for x in args.chunks.split(",") if x] if args.orient == "nt" else [0]
    cfgs = [parse_cfg(t) for t in args.sweep.split(";") if t] or [I8_TILE]
    rng = np.random.default_rng(0)
    emit(device=dev.adapter.summary, preset=I8_TILE.label)
    for m, n, k in shapes:
        for chunk in chunks:
            for cfg in cfgs:
                ranks = [0, args.lora] if args.lora and not chunk and args.orient == "nt" else [0]
                for r in ranks:
                    try:
                        row = time_gemm_i8(dev, m, n, k, chunk, cfg, rng, orient=args.orient, lora=r,
                                           accumulate=args.accumulate)  # fmt: skip
                        emit(**row)
                    except Exception as e:  # noqa: BLE001 - one tile's failure leaves the others' figures
                        emit(m=m, n=n, k=k, chunk=chunk, cfg=cfg.label, lora=r, error=str(e)[-400:])
            if args.probes:
                for probe in PROBES[1:]:
                    cfg = I8Config(**{**I8_TILE.__dict__, "probe": probe})
                    r = args.lora if probe in LORA_PROBES else 0  # the LoRA epilogue's probes, with --lora only
                    if r or probe not in LORA_PROBES:
                        row = time_gemm_i8(dev, m, n, k, chunk, cfg, rng, check=False, orient=args.orient, lora=r)
                        emit(**row)
        for chunk in chunks:
            emit(**time_quantize(dev, m, k, chunk, rng))
    if not args.no_torch:
        emit(torch=torch_tflops([], shapes, int8=True))


if __name__ == "__main__":
    main()
