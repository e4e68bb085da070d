"""Where the tensor-core GEMM's time goes, and the ceiling of this stack (issue 8), as JSON lines.

    python3 bench/tc_ceiling.py            # on a GPU with subgroup matrices (H200)
    python bench/tc_ceiling.py --n 256 --iters 64 --no-torch    # plumbing only (needs Dawn subgroup matrices)

Rows:
  mma_peak: a kernel doing nothing but subgroup-matrix multiply-accumulates on register-resident f16 matrices
    (TM x TN independent f32 accumulators per subgroup, NSG subgroups per workgroup, enough workgroups to fill
    the GPU several times): the rate Dawn's lowering to KHR cooperative matrices reaches on this GPU at all,
    i.e. the ceiling of any GEMM written with WGSL subgroup matrices here. One row per (TM, TN, NSG), and per
    source of the left matrices: loaded once ("registers"), reloaded from workgroup memory every round
    ("workgroup"), loaded from a storage buffer every round ("storage": what a GEMM skipping A's staging does).
  gemm: the real kernel (pick_config's tile, C[N, N] = A . W^T, f16 A; F16 and Q4_K weights, both
    orientations), then the same kernel with its global -> workgroup staging dropped after the first step
    ("no_stage": the matrix loads from workgroup memory, the MMAs and the barriers remain) and with its MMAs
    dropped to one per step ("no_mma": the staging remains) -- gpu/codegen_tc.py's timing probes.
    If full ~ no_stage + no_mma, staging and MMAs do not overlap; if full ~ no_stage, the MMA side limits.
  staging (--staging): the preset tile's staging alone (no MMAs), its workgroup tile stored as f16 (2-byte
    stores, as the GEMM must), u32 or vec4<u32> (4- / 16-byte stores), with and without register prefetch:
    what the 2-byte stores cost against the loads and barriers.
  torch: torch.matmul bf16 / fp16 at N in the same process.
Times: median of 3 windows after a warm-up (wall, submit + wait); gpu_us by timestamp queries where present.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemm_tc import dawn_device, gpu_time, time_calls, time_gemm, torch_tflops  # noqa: E402
from gpu.codegen_attention_tc import LEFT, RESULT, RIGHT  # noqa: E402
from gpu.device import Device  # noqa: E402
from gpu.ops.common import pack  # noqa: E402
from gpu.ops.matmul_tc import pick_config  # noqa: E402

MMA_FLOP = 2 * 16 * 16 * 16  # one 16 x 16 x 16 multiply-accumulate
A_SOURCES = ("registers", "workgroup", "storage")


def mma_peak_source(tm: int, tn: int, nsg: int, a_from: str = "registers") -> str:
    """WGSL: TM left and TN right matrices per subgroup, prm.x rounds of TM x TN MMAs into independent
    accumulators, stored at the end (so nothing is dead code). a_from: where the left matrices come from each
    round -- "registers" (loaded once: the MMA rate alone), "workgroup" (reloaded from workgroup memory every
    round, as a staged GEMM does), "storage" (loaded from a storage buffer every round, rows prm.y f16 apart,
    walking along them: a GEMM that skips staging A)."""
    n_half = (tm + tn) * 256
    left = f"subgroupMatrixLoad<{LEFT}>"
    lines = [
        "enable f16;",
        "enable subgroups;",
        "enable chromium_experimental_subgroup_matrix;",
        "diagnostic(off, chromium.subgroup_matrix_uniformity);",
        "@group(0) @binding(0) var<uniform> prm: vec4<u32>;",
        "@group(0) @binding(1) var<storage, read_write> C: array<f32>;",
        "@group(0) @binding(2) var<storage, read> A: array<f16>;" if a_from == "storage" else "",
        f"var<workgroup> S: array<f16, {2 * n_half}>;",
        f"@compute @workgroup_size({nsg * 32})",
        "fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32,",
        "        @builtin(subgroup_id) sg: u32) {",
        f"    for (var i = lid; i < {2 * n_half}u; i += {nsg * 32}u) {{",
        "        S[i] = f16(f32(i % 13u) * 0.0625 - 0.375);",
        "    }",
        "    workgroupBarrier();",
    ]
    decl = "let" if a_from == "registers" else "var"
    lines += [f"    {decl} a{i} = {left}(&S, {i * 256}u, false, 16u);" for i in range(tm)]
    lines += [f"    let b{j} = subgroupMatrixLoad<{RIGHT}>(&S, {(tm + j) * 256}u, false, 16u);" for j in range(tn)]
    lines += [f"    var c{i}_{j} = {RESULT}();" for i in range(tm) for j in range(tn)]
    if a_from == "storage":  # this subgroup's TM x 16 rows of A, 16 columns further each round
        lines.append(f"    let row0 = ((wg.x * {nsg}u + sg) % 64u) * {tm * 16}u;")
    lines.append("    for (var it = 0u; it < prm.x; it++) {")
    if a_from == "workgroup":  # alternate between two copies, literal offsets (no robustness predicate)
        lines.append("        if ((it & 1u) == 0u) {")
        lines += [f"            a{i} = {left}(&S, {i * 256}u, false, 16u);" for i in range(tm)]
        lines.append("        } else {")
        lines += [f"            a{i} = {left}(&S, {n_half + i * 256}u, false, 16u);" for i in range(tm)]
        lines.append("        }")
    elif a_from == "storage":
        lines.append("        let k0 = (it * 16u) % prm.y;")
        lines += [f"        a{i} = {left}(&A, (row0 + {i * 16}u) * prm.y + k0, false, prm.y);" for i in range(tm)]
    lines += [
        f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});"
        for i in range(tm)
        for j in range(tn)
    ]
    lines += ["    }", f"    let base = (wg.x * {nsg}u + sg) * {tm * tn * 256}u;"]
    lines += [
        f"    subgroupMatrixStore(&C, base + {(i * tn + j) * 256}u, c{i}_{j}, false, 16u);"
        for i in range(tm)
        for j in range(tn)
    ]
    return "\n".join(line for line in lines + ["}"] if line)


STORES = ("f16", "u32", "vec4")  # staging_probe's workgroup element: 2-, 4- or 16-byte stores


def staging_source(store: str, prefetch: bool, h2: str = "bitcast<vec2<f16>>") -> str:
    """WGSL of the preset tile's staging alone (256 invocations; per step 256 rows of A and 128 of B, 32 f16
    each, in 16-byte units: 6 loads and 48 / 24 / 6 stores per invocation for f16 / u32 / vec4 elements),
    one workgroup read per step and two barriers; no MMAs. `prefetch` loads the next step into registers
    between the barriers, as the GEMM does. Tells the cost of the 2-byte stores the f16 matrix loads force
    (subgroupMatrixLoad of f16 needs an array<f16>) from that of the loads and barriers. h2: u32 -> vec2<f16>
    (naga, for a lavapipe run, lacks that bitcast)."""
    per = {"f16": 8, "u32": 4, "vec4": 1}[store]
    elem = {"f16": "f16", "u32": "u32", "vec4": "vec4<u32>"}[store]
    row = 40 // (8 // per)  # 32 + 8 pad halves per staged row, in elements
    if store == "f16":
        put = [f"        S[o + {2 * j + h}u] = {h2}(r{{e}}.{'xyzw'[j]}).{'xy'[h]};" for j in range(4) for h in (0, 1)]
        read = "f32(S[(lid * 41u) % arrayLength_S])"
    elif store == "u32":
        put = [f"        S[o + {j}u] = r{{e}}.{'xyzw'[j]};" for j in range(4)]
        read = "f32(S[(lid * 41u) % arrayLength_S] & 255u)"
    else:
        put = ["        S[o] = r{e};"]
        read = "f32(S[(lid * 41u) % arrayLength_S].x & 255u)"
    lines = [
        "enable f16;",
        "@group(0) @binding(0) var<uniform> prm: vec4<u32>;  // steps, row length (vec4 units), -, -",
        "@group(0) @binding(1) var<storage, read> A: array<vec4<u32>>;",
        "@group(0) @binding(2) var<storage, read_write> out: array<f32>;",
        f"const arrayLength_S = {384 * row}u;",
        f"var<workgroup> S: array<{elem}, {384 * row}>;",
        "fn unit(e: u32, lid: u32, m0: u32, p0: u32, t: u32) -> vec4<u32> {",
        "    let u = lid + e * 256u;",
        "    let r = u / 4u;",
        "    let g = select(p0 + r - 256u, m0 + r, r < 256u);",
        "    return A[g * prm.y + t * 4u + u % 4u];",
        "}",
        "@compute @workgroup_size(256)",
        "fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {",
        "    let m0 = wg.y * 256u;",
        "    let p0 = wg.x * 128u;",
        "    var acc = 0.0;",
    ]
    lines += [f"    var r{e} = unit({e}u, lid, m0, p0, 0u);" for e in range(6)]
    lines.append("    for (var t = 0u; t < prm.x; t++) {")
    if not prefetch:
        lines += [f"        r{e} = unit({e}u, lid, m0, p0, t);" for e in range(6)]
    for e in range(6):
        lines.append(f"        {{ let u = lid + {e * 256}u; let o = (u / 4u) * {row}u + (u % 4u) * {per}u;")
        lines += [p.format(e=e) for p in put]
        lines.append("        }")
    lines.append("        workgroupBarrier();")
    if prefetch:
        lines.append("        if (t + 1u < prm.x) {")
        lines += [f"            r{e} = unit({e}u, lid, m0, p0, t + 1u);" for e in range(6)]
        lines.append("        }")
    lines += [f"        acc += {read};", "        workgroupBarrier();", "    }"]
    lines += ["    out[(wg.y * 65535u + wg.x) * 256u % arrayLength(&out) + lid % 256u] = acc;", "}"]
    return "\n".join(lines)


def staging_probe(dev: Device, n: int, store: str, prefetch: bool, seconds: float) -> dict[str, Any]:
    """Time staging_source over an n x n f16 matrix (the GEMM's grid at n: n/128 x n/256 workgroups)."""
    pipe = dev.pipeline(("tc_ceiling_staging", store, prefetch), lambda: staging_source(store, prefetch))
    rng = np.random.default_rng(0)
    a = dev.upload(rng.standard_normal((n, n)).astype(np.float16))
    out = dev.buffer(4 * 256 * 64)
    params = pack(n // 32, n // 8, 0, 0)
    grid = (n // 128, n // 256, 1)

    def call() -> None:
        dev.dispatch(pipe, [params, a, out], grid)

    timing = time_calls(dev, call, seconds)
    sec, reps = timing["seconds"], timing["reps"]
    staged = grid[0] * grid[1] * (n // 32) * 384 * 32 * 2
    row = {"what": "staging", "store": store, "prefetch": prefetch, "n": n, "ms": round(sec * 1e3, 4), "reps": reps}
    row |= {"tflops_equiv": round(2.0 * n**3 / sec / 1e12, 1), "staged_tb_s": round(staged / sec / 1e12, 2)}
    gpu = gpu_time(dev, call)
    if "gpu_us" in gpu:
        gpu["gpu_tflops_equiv"] = round(2.0 * n**3 / (gpu["gpu_us"] * 1e-6) / 1e12, 1)
    return row | gpu


def mma_peak(
    dev: Device, tm: int, tn: int, nsg: int, n_wg: int, iters: int, seconds: float, a_from: str = "registers"
) -> dict[str, Any]:
    key = ("tc_ceiling_mma_peak", tm, tn, nsg, a_from)
    pipe = dev.pipeline(key, lambda: mma_peak_source(tm, tn, nsg, a_from))
    out = dev.buffer(4 * n_wg * nsg * tm * tn * 256)
    lda = 4096  # A [64 TM 16, lda] f16: rows a GEMM would read (32 MiB at TM = 4, inside the 50 MB L2)
    params = pack(iters, lda, 0, 0)
    extra = []
    if a_from == "storage":
        rng = np.random.default_rng(0)
        extra = [dev.upload((rng.standard_normal((64 * tm * 16, lda)) * 0.1).astype(np.float16))]

    def call() -> None:
        dev.dispatch(pipe, [params, out, *extra], (n_wg, 1, 1))

    timing = time_calls(dev, call, seconds)
    sec, reps = timing["seconds"], timing["reps"]
    flop = float(n_wg * nsg * tm * tn * iters * MMA_FLOP)
    row = {"what": "mma_peak", "a_from": a_from, "tm": tm, "tn": tn, "nsg": nsg, "workgroups": n_wg, "iters": iters}
    row |= {"ms": round(sec * 1e3, 4), "tflops": round(flop / sec / 1e12, 1), "reps": reps}
    gpu = gpu_time(dev, call)
    if "gpu_us" in gpu:
        gpu["gpu_tflops"] = round(flop / (gpu["gpu_us"] * 1e-6) / 1e12, 1)
    sample = dev.read(out, np.float32, (256,))
    return row | gpu | {"finite": bool(np.isfinite(sample).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="N = M = K of the real kernel's runs")
    ap.add_argument("--iters", type=int, default=2048, help="MMA rounds per subgroup in mma_peak")
    ap.add_argument("--workgroups", type=int, default=132 * 16, help="workgroups of mma_peak")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--a-from", default="all", choices=("all", *A_SOURCES), help="mma_peak's left operands")
    ap.add_argument("--no-gemm", action="store_true", help="only the mma_peak rows")
    ap.add_argument("--staging", action="store_true", help="also the staging rows (2-, 4-, 16-byte stores)")
    ap.add_argument("--toggles", default="", help="Dawn device toggles to enable, e.g. disable_robustness")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    dev, toggles, problem = dawn_device(args.toggles)
    print(
        json.dumps({"adapter": dev.adapter.summary, "tensor_cores": problem or "yes", "toggles": toggles}), flush=True
    )
    if problem:
        sys.exit(f"bench/tc_ceiling.py: {problem}")
    for a_from in A_SOURCES if args.a_from == "all" else (args.a_from,):
        for tm, tn, nsg in ((4, 2, 8), (4, 4, 4), (2, 2, 8), (4, 4, 8)):
            row = mma_peak(dev, tm, tn, nsg, args.workgroups, args.iters, args.seconds, a_from)
            print(json.dumps(row), flush=True)
    if args.staging:
        for store in STORES:
            for prefetch in (False, True):
                print(json.dumps(staging_probe(dev, args.n, store, prefetch, args.seconds)), flush=True)
    if args.no_gemm:
        return
    n = args.n
    base = pick_config(n, n)
    for qtype in ("F16", "Q4_K"):
        for orient in ("nt", "nn"):
            for probe in ("", "no_stage", "no_mma"):
                cfg = replace(base, probe=probe)
                row = time_gemm(
                    dev,
                    qtype,
                    orient,
                    n,
                    n,
                    n,
                    cfg=cfg,
                    a_dtype="f16",
                    seconds=args.seconds,
                    check_rows=8 if not probe else 0,
                )
                print(json.dumps({"what": "gemm", "probe": probe or "full", **row}), flush=True)
    if not args.no_torch:
        print(json.dumps({"what": "torch", **torch_tflops([n], seconds=args.seconds)}), flush=True)


if __name__ == "__main__":
    main()
