"""Causal GQA attention: our tensor-core kernels vs our f32 kernels vs torch's scaled_dot_product_attention
(bf16) in the same run, forward and forward + backward, printed as JSON lines.

    python bench/attention.py                                # T = 1024, 2048; batch 4; 32 / 4 heads; D = 64
    python bench/attention.py --seq 1024 --batch 4 --no-f32

Ours runs as the model calls it: the tensor-core kernels take the whole batch in one call (sequence = grid z),
the f32 kernels one call per sequence (views into the batch's buffers), all recorded in one step. Times are the
median of 3 windows after a warm-up window (wall time of `reps` batches, submit + wait; torch: CUDA events).
TFLOP/s counts the causal half of the products: forward 4 B H T^2 D / 2, backward 2.5x that (5 products;
our backward recomputes S and dP, in its dQ pass, so it does 7, or with the dS store (--dq-from-ds) 5 plus the
store; neither extra is counted). Each of our results
carries max_rel_err vs the float64 reference on sequence 0 (|x - ref| / max |ref|, per output, the worst),
and gpu_ms: the GPU time of one batch by timestamp queries (each dispatch in its own pass; no CPU recording),
with its per-kernel split.
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

from gpu.device import BufferView, Device  # noqa: E402
from gpu.ops import attention_tc  # noqa: E402
from gpu.ops.attention import attention_backward, attention_forward  # noqa: E402
from gpu.ops.attention_tc import attention_backward_tc, attention_forward_tc  # noqa: E402
from gpu.ops.matmul_tc import tensor_core_problem  # noqa: E402
from gpu.profile import Profiler  # noqa: E402
from model import reference  # noqa: E402


def flops(b: int, h: int, t: int, d: int, backward: bool) -> float:
    fwd = 4.0 * b * h * t * t * d / 2
    return fwd * 3.5 if backward else fwd


def timed(run: Callable[[int], float], seconds: float) -> tuple[float, int, float]:
    """(median seconds per rep, reps, spread) of 3 windows after a warm-up window."""
    run(1)
    one = run(1)
    reps = int(min(200, max(3, seconds / max(one, 1e-6))))
    run(reps)
    windows = sorted(run(reps) / reps for _ in range(3))
    return windows[1], reps, (windows[2] - windows[0]) / windows[1]


def timing_row(
    run: Callable[[int], float], seconds: float, b: int, hq: int, hkv: int, t: int, d: int, backward: bool
) -> dict[str, Any]:
    """The shape, median ms, TFLOP/s, reps and spread of one timed attention pass (one JSON row's fields)."""
    sec, reps, spread = timed(run, seconds)
    return {
        "pass": "fwd+bwd" if backward else "fwd",
        "batch": b,
        "seq": t,
        "heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "ms": round(sec * 1e3, 4),
        "tflops": round(flops(b, hq, t, d, backward) / sec / 1e12, 2),
        "reps": reps,
        "spread": round(spread, 3),
    }


def ours(dev: Device, kind: str, b: int, t: int, hq: int, hkv: int, d: int, seconds: float) -> list[dict[str, Any]]:
    """Forward and forward + backward over b sequences with our `kind` kernels ("tc" or "f32")."""
    rng = np.random.default_rng(0)
    tc = kind == "tc"
    fwd, bwd = (attention_forward_tc, attention_backward_tc) if tc else (attention_forward, attention_backward)
    q = rng.standard_normal((b, t, hq, d), dtype=np.float32)
    k = rng.standard_normal((b, t, hkv, d), dtype=np.float32)
    v = rng.standard_normal((b, t, hkv, d), dtype=np.float32)
    do = rng.standard_normal((b, t, hq, d), dtype=np.float32)
    nq, nkv = t * hq * d, t * hkv * d
    qb, kb, vb, dob = (dev.upload(np.ascontiguousarray(x)) for x in (q, k, v, do))
    out, dq = dev.buffer(4 * b * nq), dev.buffer(4 * b * nq)
    dk, dv = dev.buffer(4 * b * nkv), dev.buffer(4 * b * nkv)
    lse, delta = dev.buffer(4 * b * hq * t), dev.buffer(4 * hq * t)

    def seq(buf: Any, n: int, s: int) -> BufferView:
        return BufferView(buf, 4 * s * n, 4 * n)

    def record(backward: bool) -> None:
        if tc:
            fwd(dev, qb, kb, vb, out, lse, t, hq, hkv, d, n_seqs=b)
            if backward:
                bwd(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d, n_seqs=b)
            return
        for s in range(b):
            qs, ks, vs, os, ls = seq(qb, nq, s), seq(kb, nkv, s), seq(vb, nkv, s), seq(out, nq, s), seq(lse, hq * t, s)
            fwd(dev, qs, ks, vs, os, ls, t, hq, hkv, d)
            if backward:
                grads = seq(dq, nq, s), seq(dk, nkv, s), seq(dv, nkv, s)
                bwd(dev, seq(dob, nq, s), qs, ks, vs, os, ls, *grads, t, hq, hkv, d, delta=delta)

    def run(backward: bool) -> Callable[[int], float]:
        def go(reps: int) -> float:
            t0 = time.perf_counter()
            with dev.step():
                for _ in range(reps):
                    record(backward)
            dev.sync()
            return time.perf_counter() - t0

        return go

    results = []
    for backward in (False, True):
        res = {"impl": f"ours_{kind}", **timing_row(run(backward), seconds, b, hq, hkv, t, d, backward)}
        q64, k64, v64 = (x[0].astype(np.float64) for x in (q, k, v))
        errs = {"out": _rel(dev.read(out, np.float32, (t, hq, d)), reference.attention_forward(q64, k64, v64))}
        if backward:
            want = reference.attention_backward(do[0].astype(np.float64), q64, k64, v64)
            for name, buf, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
                errs[name] = _rel(dev.read(buf, np.float32, ref.shape), ref)
        res["max_rel_err"] = {n: float(f"{e:.3g}") for n, e in errs.items()}
        res.update(_gpu_time(dev, run(backward), flops(b, hq, t, d, backward)))
        results.append(res)
    return results


def _gpu_time(dev: Device, go: Callable[[int], float], n_flops: float) -> dict[str, Any]:
    """GPU time of one batch by timestamp queries (every dispatch in its own pass): total and per kernel."""
    if "timestamp-query" not in dev.features:
        return {}
    with Profiler(dev) as prof:
        go(1)
    per: dict[str, float] = {}
    for (_, label), ns in prof.ns.items():
        name = label.split("'")[1] if "'" in label else label[:40]
        per[name] = per.get(name, 0.0) + ns / 1e6
    total = sum(per.values())
    return {
        "gpu_ms": round(total, 4),
        "gpu_tflops": round(n_flops / (total / 1e3) / 1e12, 2) if total else None,
        "gpu_ms_by_kernel": {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
    }


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def torch_sdpa(b: int, t: int, hq: int, hkv: int, d: int, seconds: float) -> list[dict[str, Any]]:
    """F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) in bf16, forward and forward + backward."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return [{"impl": "torch_sdpa_bf16", "error": f"torch not importable: {e}"}]
    if not torch.cuda.is_available():
        return [{"impl": "torch_sdpa_bf16", "error": "torch has no CUDA device"}]
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16)
    results = []
    for backward in (False, True):

        def go(reps: int, backward: bool = backward) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                if backward:
                    torch.autograd.grad(o, (q, k, v), do)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3

        with torch.set_grad_enabled(backward):
            row = timing_row(go, seconds, b, hq, hkv, t, d, backward)
        results.append(
            {
                "impl": "torch_sdpa_bf16",
                **row,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0),
            }
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="1024,2048", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=0.5, help="target length of one timing window")
    ap.add_argument("--no-f32", action="store_true", help="skip our f32 kernels")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--forward-subgroups",
        default="4",
        help="tensor cores: subgroups a workgroup of the forward, comma-separated (8: 128 query rows sharing each "
        "staged key tile of 32 at either head dim)",
    )
    ap.add_argument(
        "--paired-backward",
        default="off",
        help="tensor cores: the backward with S and dP side by side: off, on, or off,on for both",
    )
    ap.add_argument(
        "--dq-from-ds",
        default="off",
        help="tensor cores: dQ from the dS the dK/dV pass stores (the paired pass): off, on, or off,on for both",
    )
    args = ap.parse_args()
    dev = Device()
    problem = tensor_core_problem(dev)
    print(json.dumps({"adapter": dev.adapter.summary, "backend": dev.backend, "tensor_cores": problem or "yes"}))
    for t in (int(x) for x in args.seq.split(",")):
        shape = (args.batch, t, args.heads, args.kv_heads, args.head_dim)
        kinds = (["tc"] if problem is None else []) + ([] if args.no_f32 else ["f32"])
        for kind in kinds:
            tc = kind == "tc"
            for sg in [int(x) for x in args.forward_subgroups.split(",")] if tc else [0]:
                for paired, ds in _backwards(args) if tc else [("off", "off")]:
                    attention_tc.FORWARD_SUBGROUPS = sg or attention_tc.FORWARD_SUBGROUPS
                    attention_tc.PAIRED_BACKWARD = paired == "on"
                    attention_tc.DQ_FROM_DS = ds == "on"
                    tag = {"forward_subgroups": sg, "paired_backward": paired, "dq_from_ds": ds} if tc else {}
                    for res in ours(dev, kind, *shape, args.seconds):
                        print(json.dumps(res | tag))
        if not args.no_torch:
            for res in torch_sdpa(*shape, args.seconds):
                print(json.dumps(res))


def _backwards(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (paired, dq-from-ds) backward settings to time: the paired ones, and the stored dS (paired) ones."""
    runs = [(p, "off") for p in args.paired_backward.split(",")]
    return runs + [("on", "on")] * ("on" in args.dq_from_ds.split(","))


if __name__ == "__main__":
    main()
