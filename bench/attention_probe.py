"""Where the tensor-core attention kernels spend their time: each kernel timed as generated and in variants that
leave one stage out (or change one thing), by GPU timestamps, printed as JSON lines.

    python bench/attention_probe.py                                   # B4 T1024, 32 / 8 heads, D 128
    python bench/attention_probe.py --head-dim 64 --kv-heads 4        # the TinyLlama shape

Kernels: the forward on 8 subgroups (`attention_tc_forward8`) and the dK/dV pass that stores dS
(`attention_tc_backward_dkv_ds`), the ones the model runs. Variants are line edits of the generated WGSL:
- probes, whose outputs are wrong and only their time counts: `no_s_mma` / `no_pv_mma` / `no_mma` (the score or
  the accumulating products left out: their loads from workgroup memory go with them), `no_stage` (the key, or
  query, tile neither loaded nor staged), `no_softmax` (no reads of the scores, no writes of P), `no_b3` (the
  barrier between the scores' store and the lanes' reads dropped: a race), `no_rows` (dK/dV: no P, dS rows),
  `no_ds_store` (dK/dV: the dS store not written);
- candidates, the generator's options (gpu/codegen_attention_tc.py): `skip_masked` (a subgroup skips the products
  of a 16-key, or 16-query, block that the causal mask zeroes whole; bitwise the kernel's result), `one_flag`
  (forward: each subgroup moves its own reference max, and one uniform load after P's store replaces the separate
  flag exchange and barrier; within the tolerance).
Each row: the variant, the GPU ms of one dispatch (median of --reps back to back, after as many untimed), the
rate on the causal products, and `max_diff`: max |out - out of the kernel as generated| / max |out of the kernel
as generated| (dK, dV for that pass), 0.0 where bitwise.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import flops  # noqa: E402
from bench.lora import DispatchProfiler  # noqa: E402
from gpu import codegen_attention_tc as cg  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops import attention_tc  # noqa: E402
from gpu.ops.matmul_tc import tensor_core_problem  # noqa: E402

Edit = Callable[[list[str]], list[str]]


def drop(pattern: str) -> Edit:
    """Leave out every line matching `pattern`."""
    rx = re.compile(pattern)
    return lambda lines: [s for s in lines if not rx.search(s)]


def sub(pattern: str, repl: str) -> Edit:
    rx = re.compile(pattern)
    return lambda lines: [rx.sub(repl, s) for s in lines]


def chain(*edits: Edit) -> Edit:
    def run(lines: list[str]) -> list[str]:
        for e in edits:
            lines = e(lines)
        return lines

    return run


def drop_barrier_before(pattern: str) -> Edit:
    """Leave out the barrier line just before the first line matching `pattern`."""
    rx = re.compile(pattern)

    def run(lines: list[str]) -> list[str]:
        at = next(k for k, s in enumerate(lines) if rx.search(s))
        assert lines[at - 1].strip() == "workgroupBarrier();", lines[at - 1]
        return lines[: at - 1] + lines[at:]

    return run


MMA = r"= subgroupMatrixMultiplyAccumulate\("
# variant name: an edit of the generated source, or the generator's options (the candidates)
FORWARD: dict[str, Edit | dict[str, bool]] = {
    "base": {},
    "skip_masked": {"skip_masked": True},
    "one_flag": {"one_flag": True},
    "skip_masked+one_flag": {"skip_masked": True, "one_flag": True},
    "no_s_mma": drop(r"x\d+ " + MMA),
    "no_pv_mma": drop(r"o\d+ " + MMA),
    "no_mma": drop(r"[xo]\d+ " + MMA),
    "no_stage": drop(r"^\s*(put_[KV]s\(lid|[kv]r\d+ = load_)"),
    "no_softmax": chain(drop(r"^\s*Ps\[sg\]\[r \* LDP"), sub(r"Ss\[sg\]\[xb \+ \d+u\]", "1.0")),
    "no_b3": drop_barrier_before(r"^\s*let s0 = "),
}
DKV: dict[str, Edit | dict[str, bool]] = {
    "base": {},
    "skip_masked": {"skip_masked": True},
    "no_sdp_mma": drop(r"x\d+ " + MMA),
    "no_grad_mma": drop(r"d[kv]\d+ " + MMA),
    "no_mma": drop(r"(x|dk|dv)\d+ " + MMA),
    "no_rows": chain(drop(r"^\s*(Ps|dSs)\[sg\]\[r \* LDP"), drop(r"^\s*let p\d+ = f16")),
    "no_ds_store": sub(r"^(\s*)(subgroupMatrixStore\(&DSt.*)$", r"\1if (prm.T == 0u) { \2 }"),  # the binding kept
    "no_stage": drop(r"^\s*(put_(Qs|dOs)\(lid|(qr|dor)\d+ = load_)"),
}


def gpu_ms(dev: Device, go: Callable[[], None], reps: int) -> float:
    """Median GPU ms of one dispatch over `reps` back to back in one submit, each in its own timestamped pass,
    after as many untimed (the clocks up, as in a step; single dispatches between idle gaps run several times
    slower)."""
    with dev.step():
        for _ in range(reps):
            go()
    dev.sync()
    with DispatchProfiler(dev) as prof:
        with dev.step():
            for _ in range(reps):
                go()
    return statistics.median(ns / 1e6 for ns in prof.ns.values())


def probe(args: argparse.Namespace, dev: Device) -> None:
    """Print one JSON row per (kernel, variant): its time and output against the kernel as generated."""
    b, t, hq, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal((b * t, hq, d), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b * t, hkv, d), dtype=np.float32) for _ in range(2))
    qb, kb, vb, dob = (dev.upload(x) for x in (q, k, v, do))
    out, dq = dev.buffer(q.nbytes), dev.buffer(q.nbytes)
    dk, dv = dev.buffer(k.nbytes), dev.buffer(k.nbytes)
    lse = dev.buffer(4 * b * hq * t)
    attention_tc.FORWARD_SUBGROUPS, attention_tc.PAIRED_BACKWARD, attention_tc.DQ_FROM_DS = 8, True, True
    with dev.step():  # the packed operands, stats and the dS store, as the model leaves them
        attention_tc.attention_forward_tc(dev, qb, kb, vb, out, lse, t, hq, hkv, d, n_seqs=b)
        attention_tc.attention_backward_tc(dev, dob, qb, kb, vb, out, lse, dq, dk, dv, t, hq, hkv, d, n_seqs=b)
    dev.sync()
    s = attention_tc.scratch_for(dev, t, hq, hkv, d, b)
    prm = attention_tc._params(t, hq, hkv, d, hq * t)
    fwd_flops = flops(b, hq, t, d, backward=False)
    kernels = {
        "forward8": (
            lambda **options: cg.forward_source(d, cg.WIDE_FORWARD_SUBGROUPS, **options),
            FORWARD,
            lambda o1, o2: [prm, s.q16, s.k16, s.v16, o1, o2],
            (q.nbytes, 4 * b * hq * t),
            (math.ceil(t / cg.workgroup_rows(cg.WIDE_FORWARD_SUBGROUPS)), hq, b),
            fwd_flops,
        ),
        "dkv_ds": (
            lambda **options: cg.backward_dkv_source(d, paired=True, store_ds=True, **options),
            DKV,
            lambda o1, o2: [prm, s.q16, s.k16, s.v16, s.do16, s.ds, s.stats, o1, o2],
            (4 * b * t * hq * d, 4 * b * t * hq * d),
            (math.ceil(t / cg.workgroup_rows()), hq, b),
            4 * fwd_flops,
        ),
    }
    for name, (source, variants, bindings, sizes, grid, n_flops) in kernels.items():
        want = None
        for variant, edit in variants.items():
            if args.variants and variant not in args.variants.split(","):
                continue
            text = source(**edit) if isinstance(edit, dict) else "\n".join(edit(source().split("\n")))
            row: dict[str, Any] = {"kernel": name, "variant": variant, "head_dim": d, "seq": t, "batch": b}
            try:
                pipe = dev.pipeline(("attention_probe", name, variant, d), lambda text=text: text)
                o1, o2 = dev.buffer(sizes[0]), dev.buffer(sizes[1])
                group = bindings(o1, o2)
                ms = gpu_ms(dev, lambda pipe=pipe, group=group, grid=grid: dev.dispatch(pipe, group, grid), args.reps)
                got = np.concatenate([dev.read(o1, np.float32), dev.read(o2, np.float32)])
            except Exception as e:  # a probe that fails to compile is reported, the others still run
                print(json.dumps(row | {"error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
                continue
            if want is None:
                want = got
            diff = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            row |= {"gpu_ms": round(ms, 4), "tflops": round(n_flops / ms / 1e9, 1), "max_diff": float(f"{diff:.3g}")}
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30, help="timed dispatches per variant (median)")
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    dev = Device()
    problem = tensor_core_problem(dev)
    print(json.dumps({"adapter": dev.adapter.summary, "backend": dev.backend, "tensor_cores": problem or "yes"}))
    if problem is not None:
        raise SystemExit(f"bench/attention_probe.py: {problem}")
    if "timestamp-query" not in dev.features:
        raise SystemExit(f"bench/attention_probe.py: {dev.adapter.summary} has no timestamp queries")
    probe(args, dev)


if __name__ == "__main__":
    main()
