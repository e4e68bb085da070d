"""What a dispatch costs the GPU beside its work, as JSON lines: N dispatches of a small elementwise kernel recorded
into one compute pass (as gpu/device.py records a step), timed as a whole by a timestamp pair around the pass.

    python bench/dispatch_cost.py
    python bench/dispatch_cost.py --dispatches 500,2000 --elements 256,1048576

Cases, each at every element count (one thread per element, 256 a workgroup):
- `chain`: each dispatch reads the previous one's output (x -> y -> x ...): every dispatch waits for the one
  before, as most of a training step's do (the implementation's barrier between them);
- `independent`: each dispatch reads and writes buffers of its own (no hazard between them, so no barrier is
  needed): whether the implementation lets them overlap;
- `alone`: one dispatch per pass (its own timestamps), the work of one dispatch without its neighbours.
us_per_dispatch = the pass's GPU time / N. The Llama-3-8B step records ~5,000 dispatches: at a few microseconds
each beside their work, that is the share of the step that fusing small kernels (or recording independent ones
back to back) could win. Needs the timestamp-query feature.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.device import Device, grid_1d  # noqa: E402
from gpu.ops.common import pack  # noqa: E402

KERNEL = """
struct Params { n: u32, _p0: u32, _p1: u32, _p2: u32 };
@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i < prm.n) {
        Y[i] = X[i] * 1.0001 + 1.0;
    }
}
"""


def pass_time_us(dev: Device, pipe: Any, groups: list[Any], grid: tuple[int, ...], per_pass: int) -> float:
    """GPU microseconds of len(groups) dispatches (bind groups in order), per_pass of them in each timestamped
    compute pass, all passes summed."""
    w = dev.wgpu
    n_pass = -(-len(groups) // per_pass)
    qs = dev.device.create_query_set(type="timestamp", count=2 * n_pass)
    buf = dev.device.create_buffer(size=16 * n_pass, usage=w.BufferUsage.QUERY_RESOLVE | w.BufferUsage.COPY_SRC)
    enc = dev.device.create_command_encoder()
    for p in range(n_pass):
        stamps = {"query_set": qs, "beginning_of_pass_write_index": 2 * p, "end_of_pass_write_index": 2 * p + 1}
        cp = enc.begin_compute_pass(timestamp_writes=stamps)
        cp.set_pipeline(pipe)
        for bg in groups[p * per_pass : (p + 1) * per_pass]:
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(*grid)
        cp.end()
    enc.resolve_query_set(qs, 0, 2 * n_pass, buf, 0)
    dev.queue.submit([enc.finish()])
    t = np.frombuffer(dev.queue.read_buffer(buf, 0, 16 * n_pass), np.uint64).astype(np.int64).reshape(-1, 2)
    return float(np.maximum(t[:, 1] - t[:, 0], 0).sum()) / 1e3


def measure(dev: Device, n_dispatch: int, n_elem: int, reps: int) -> list[dict[str, Any]]:
    pipe = dev.pipeline(("dispatch_cost",), lambda: KERNEL)
    prm = pack(n_elem, 0, 0, 0)
    grid = grid_1d(-(-n_elem // 256))
    x, y = dev.upload(np.ones(n_elem, np.float32)), dev.buffer(4 * n_elem)
    chain = [dev.bind_group(pipe, [prm, x, y] if i % 2 == 0 else [prm, y, x]) for i in range(n_dispatch)]
    own = [(dev.upload(np.ones(n_elem, np.float32)), dev.buffer(4 * n_elem)) for _ in range(min(n_dispatch, 256))]
    independent = [dev.bind_group(pipe, [prm, *own[i % len(own)]]) for i in range(len(own))]
    rows = []
    for case, groups, per_pass in (
        ("chain", chain, n_dispatch),
        ("independent", independent, len(independent)),
        ("alone", chain[: min(n_dispatch, 256)], 1),
    ):
        pass_time_us(dev, pipe, groups, grid, per_pass)  # warm-up
        times = [pass_time_us(dev, pipe, groups, grid, per_pass) for _ in range(reps)]
        us = statistics.median(times)
        rows.append(
            {
                "case": case,
                "dispatches": len(groups),
                "elements": n_elem,
                "workgroups": -(-n_elem // 256),
                "gpu_us": round(us, 1),
                "us_per_dispatch": round(us / len(groups), 3),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dispatches", default="256,2048", help="dispatches per pass (chain); independent caps at 256")
    ap.add_argument("--elements", default="256,65536,1048576", help="elements per dispatch (one thread each)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--backend", default=None, help="wgpu or dawn (default: the project's choice)")
    args = ap.parse_args()
    dev = Device(args.backend)
    if "timestamp-query" not in dev.features:
        raise SystemExit(f"bench/dispatch_cost.py: {dev.adapter.summary} has no timestamp queries")
    print(json.dumps({"device": dev.adapter.summary, "backend": dev.backend}), flush=True)
    for n_dispatch in (int(v) for v in args.dispatches.split(",") if v):
        for n_elem in (int(v) for v in args.elements.split(",") if v):
            for row in measure(dev, n_dispatch, n_elem, args.reps):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
