"""One-shot tensor-core tuning probe for the device tool: many tile configs, correctness and speed, as JSON.

    source .gl/enter.sh; python3 bench/tc_probe.py > $OUT/tc.json            # first pass (CANDIDATES)
    source .gl/enter.sh; python3 bench/tc_probe.py --final > $OUT/tc2.json   # second pass (FINAL), one process

Each job runs in its own subprocess (a bad kernel can only lose its own job): the environment, one job per
candidate TCConfig (correctness of F16 / Q4_K in both orientations on small odd shapes, then the F16 GEMM
at N = 4096 with f16 and f32 A), then with the fastest correct config: all weight types' errors, the
N = 1024..8192 sweep, fused Q4_K / Q4_0 in both orientations, the same with Dawn's robustness off, and
torch's bf16 / fp16 matmul. Progress goes to stderr (and $OUT/tc_lines.jsonl when OUT is set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CANDIDATES = {
    "1x1_4x4_k32_pf": [1, 1, 4, 4, 32, 1],
    "2x2_4x4_k32": [2, 2, 4, 4, 32, 0],
    "2x2_4x4_k32_pf": [2, 2, 4, 4, 32, 1],
    "2x2_4x4_k64": [2, 2, 4, 4, 64, 0],
    "2x2_4x4_k16_pf": [2, 2, 4, 4, 16, 1],
    "2x4_4x4_k32": [2, 4, 4, 4, 32, 0],
    "4x2_4x4_k32": [4, 2, 4, 4, 32, 0],
    "2x4_4x4_k16_pf": [2, 4, 4, 4, 16, 1],
    "4x2_2x4_k32_pf": [4, 2, 2, 4, 32, 1],
    "4x4_2x2_k32": [4, 4, 2, 2, 32, 0],
    "2x2_4x2_k32_pf": [2, 2, 4, 2, 32, 1],
    "2x2_2x4_k32_pf": [2, 2, 2, 4, 32, 1],
}
ALL_TYPES = ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
DEADLINE_S = 240.0
# Dry run without tensor cores (plumbing check on lavapipe): TC_PROBE_EMULATE=1 TC_PROBE_N=64
EMULATE = os.environ.get("TC_PROBE_EMULATE") == "1"
N_BIG = int(os.environ.get("TC_PROBE_N", "4096"))
SWEEP = [N_BIG // 4, N_BIG // 2, N_BIG, N_BIG * 2]


def _device(toggles: list[str] | None = None):
    """A Dawn Device, optionally with extra Dawn device toggles (e.g. disable_robustness)."""
    import functools

    if toggles:
        from wgpudawn.backends.dawn import extras

        extras.request_device_sync = functools.partial(extras.request_device_sync, enable_toggles=toggles)
    from gpu.device import Device

    if EMULATE:
        import functools

        import bench.gemm_tc
        import gpu.ops.matmul_tc

        emu = functools.partial(gpu.ops.matmul_tc.gemm_tc, emulate=True)
        gpu.ops.matmul_tc.gemm_tc = bench.gemm_tc.gemm_tc = emu
        return Device(backend="wgpu")
    return Device(backend="dawn")


def _small_errors(dev, cfg, cases: list[tuple[str, str, str, int, int, int]]) -> list[dict[str, Any]]:
    """Relative errors of gemm_tc vs float64 on f16-rounded operands for (type, orient, a_dtype, m, n, k)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from gpu.ops.matmul_tc import gemm_tc
    from gpu.weights import random_blocks, upload_quant

    out = []
    rng = np.random.default_rng(1)
    for qtype, orient, a_dtype, m, n, k in cases:
        qt = GGMLQuantizationType[qtype]
        raw = random_blocks(qt, (n, k), rng)
        wd = dequantize(raw, qt).reshape(n, k).astype(np.float16).astype(np.float64)
        w = upload_quant(dev, raw, qt, (n, k))
        r, p = (k, n) if orient == "nt" else (n, k)
        a = rng.standard_normal((m, r)).astype(np.float32)
        c = dev.buffer(m * p * 4)
        t = time.perf_counter()
        try:
            gemm_tc(
                dev, dev.upload(a.astype(np.float16) if a_dtype == "f16" else a), w, c, m,
                orient=orient, a_dtype=a_dtype, cfg=cfg,
            )  # fmt: skip
            got = dev.read(c, np.float32, (m, p)).astype(np.float64)
        except Exception as e:  # noqa: BLE001 - report, keep probing
            out.append({"case": [qtype, orient, a_dtype, m, n, k], "error": str(e)[-800:]})
            continue
        ref = a.astype(np.float16).astype(np.float64) @ (wd.T if orient == "nt" else wd)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        out.append({"case": [qtype, orient, a_dtype, m, n, k], "rel_err": err, "s": round(time.perf_counter() - t, 3)})
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job in this process."""
    from bench.gemm_tc import time_gemm, torch_tflops
    from gpu.codegen_tc import TCConfig

    kind = spec["kind"]
    if kind == "torch":
        return torch_tflops(spec["sizes"])
    dev = _device(spec.get("toggles"))
    if kind == "env":
        from wgpudawn.backends.dawn import extras

        props = extras.get_adapter_properties(dev.adapter)
        return {
            "describe": dev.describe(),
            "info": {k: v for k, v in dict(dev.adapter.info).items() if isinstance(v, str | int)},
            "subgroup_matrix_configs": str(props.get("subgroup_matrix_configs")),
            "toggles": sorted(extras.get_toggles(dev.device)),
        }
    c = spec["cfg"]
    cfg = TCConfig(c[0], c[1], c[2], c[3], c[4], bool(c[5]))
    res: dict[str, Any] = {"cfg": c}
    if kind == "cfg":
        res["errors"] = _small_errors(
            dev,
            cfg,
            [
                ("F16", "nt", "f16", 130, 200, 512),
                ("F16", "nn", "f32", 77, 200, 512),
                ("Q4_K", "nt", "f32", 1, 72, 768),
                ("Q4_K", "nn", "f16", 130, 201, 512),
            ],
        )
        ok = all(e.get("rel_err", 1.0) < 1e-3 for e in res["errors"])
        res["ok"] = ok
        if ok:
            res["time"] = [
                time_gemm(dev, "F16", "nt", N_BIG, N_BIG, N_BIG, cfg=cfg, a_dtype="f16", seconds=0.12),
                time_gemm(dev, "F16", "nt", N_BIG, N_BIG, N_BIG, cfg=cfg, a_dtype="f32", seconds=0.12),
            ]
        return res
    if kind == "all_types":
        cases = [(t, o, "f32", m, 200, 768 if t in ("Q4_K", "Q6_K") else 480)
                 for t in ALL_TYPES for o in ("nt", "nn") for m in (1, 130)]  # fmt: skip
        res["errors"] = _small_errors(dev, cfg, cases)
        res["max_rel_err"] = max(e.get("rel_err", 1.0) for e in res["errors"])
        return res
    if kind == "sweep":
        res["plain_f16"] = [
            time_gemm(dev, "F16", "nt", n, n, n, cfg=cfg, a_dtype="f16", seconds=0.15) for n in spec["sizes"]
        ]
        res["fused"] = [
            time_gemm(dev, t, o, N_BIG, N_BIG, N_BIG, cfg=cfg, a_dtype=a, seconds=0.15)
            for t in ("Q4_K", "Q4_0", "F16")
            for o in ("nt", "nn")
            for a in ("f32",)
        ]
        return res
    if kind == "time":
        res["time"] = [time_gemm(dev, t, o, n, n, n, cfg=cfg, a_dtype=a, seconds=0.12) for t, o, a, n in spec["runs"]]
        return res
    raise ValueError(f"unknown probe job kind {kind!r}")


FINAL = [  # (name, [sg_m, sg_n, tm, tn, bk, prefetch, sg_from_lid], disable_robustness)
    ("4x4_2x2_k32_lid", [4, 4, 2, 2, 32, 0, 1], False),
    ("4x4_2x2_k32_nr", [4, 4, 2, 2, 32, 0, 0], True),
    ("2x2_4x4_k32_nr", [2, 2, 4, 4, 32, 0, 0], True),
    ("4x2_4x4_k32_nr", [4, 2, 4, 4, 32, 0, 0], True),
    ("4x4_2x2_k16_nr", [4, 4, 2, 2, 16, 0, 0], True),
    ("4x4_2x4_k32_nr", [4, 4, 2, 4, 32, 0, 0], True),
    ("4x4_4x2_k32_nr", [4, 4, 4, 2, 32, 0, 0], True),
    ("4x2_2x2_k32_nr", [4, 2, 2, 2, 32, 0, 0], True),
    ("2x2_4x4_k32_pf_nr", [2, 2, 4, 4, 32, 1, 0], True),
]


def final() -> None:
    """Second pass in one process: the configs of FINAL (most with Dawn's robustness off), then the sweep
    and fused runs with the fastest. One JSON line per result on stderr as it completes."""
    import functools

    from wgpudawn.backends.dawn import extras

    from bench.gemm_tc import time_gemm
    from gpu.codegen_tc import TCConfig
    from gpu.device import Device

    dev = Device(backend="dawn")
    plain = extras.request_device_sync
    extras.request_device_sync = functools.partial(plain, enable_toggles=["disable_robustness"])
    dev_nr = Device(backend="dawn")
    extras.request_device_sync = plain
    results: dict[str, Any] = {}

    def emit(key: str, value: Any) -> None:
        results[key] = value
        print(json.dumps({key: value})[:3000], file=sys.stderr, flush=True)

    best = (0.0, None, None)
    for name, c, no_robust in FINAL:
        cfg = TCConfig(c[0], c[1], c[2], c[3], c[4], bool(c[5]), sg_from_lid=bool(c[6]))
        d = dev_nr if no_robust else dev
        try:
            errs = _small_errors(d, cfg, [("F16", "nt", "f16", 130, 200, 512), ("Q4_K", "nn", "f32", 77, 201, 512)])
            ok = all(e.get("rel_err", 1.0) < 1e-3 for e in errs)
            t = time_gemm(d, "F16", "nt", N_BIG, N_BIG, N_BIG, cfg=cfg, a_dtype="f16", seconds=0.1) if ok else {}
            emit(name, {"errors": errs, "time": t})
            if ok and t["tflops"] > best[0]:
                best = (t["tflops"], cfg, d)
        except Exception as e:  # noqa: BLE001 - keep probing
            emit(name, {"error": str(e)[-1500:]})
    if best[1] is not None:
        _, cfg, d = best
        emit("best", {"cfg": str(cfg), "robust": d is dev})
        emit("plain_f16", [time_gemm(d, "F16", "nt", n, n, n, cfg=cfg, a_dtype="f16", seconds=0.1) for n in SWEEP])
        emit("fused", [time_gemm(d, t, o, N_BIG, N_BIG, N_BIG, cfg=cfg, seconds=0.1)
                       for t in ("Q4_K", "Q4_0") for o in ("nt", "nn")])  # fmt: skip
        emit("robust_same_cfg", time_gemm(dev, "F16", "nt", N_BIG, N_BIG, N_BIG, cfg=cfg, a_dtype="f16", seconds=0.1))
    print(json.dumps(results, indent=1))


def run_job(spec: dict[str, Any], timeout: float, log) -> dict[str, Any]:
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        lines = [s for s in proc.stdout.splitlines() if s.startswith("{")]
        if proc.returncode == 0 and lines:
            result = json.loads(lines[-1])
        else:
            result = {"rc": proc.returncode, "stderr": proc.stderr[-3000:], "stdout": proc.stdout[-1000:]}
    except subprocess.TimeoutExpired as e:
        result = {"timeout": timeout, "stderr": (e.stderr or b"")[-2000:].decode(errors="replace")}
    result = {"job": spec, "wall_s": round(time.perf_counter() - t, 1), **result}
    line = json.dumps(result)
    print(line[:4000], file=sys.stderr, flush=True)
    log(line)
    return result


def best_tflops(r: dict[str, Any]) -> float:
    times = r.get("time") or []
    return max((x.get("tflops", 0.0) for x in times if x.get("a_dtype") == "f16"), default=0.0)


def main() -> None:
    start = time.perf_counter()
    out_dir = os.environ.get("OUT")
    sink = open(Path(out_dir) / "tc_lines.jsonl", "a") if out_dir else None  # noqa: SIM115

    def log(line: str) -> None:
        if sink:
            sink.write(line + "\n")
            sink.flush()

    results: dict[str, Any] = {"env": run_job({"kind": "env"}, 120, log)}
    cfg_results = {}
    for name, cfg in CANDIDATES.items():
        if time.perf_counter() - start > DEADLINE_S * 0.55:
            cfg_results[name] = {"skipped": "deadline"}
            continue
        cfg_results[name] = run_job({"kind": "cfg", "cfg": cfg}, 60, log)
    results["configs"] = cfg_results
    ranked = sorted((n for n, r in cfg_results.items() if r.get("ok")), key=lambda n: -best_tflops(cfg_results[n]))
    results["ranking"] = [(n, best_tflops(cfg_results[n])) for n in ranked]
    if ranked:
        best = CANDIDATES[ranked[0]]
        for spec, timeout in (
            ({"kind": "all_types", "cfg": best}, 120),
            ({"kind": "all_types", "cfg": [1, 4, 1, 2, 32, 1]}, 120),
            ({"kind": "sweep", "cfg": best, "sizes": SWEEP}, 150),
            (
                {
                    "kind": "time",
                    "cfg": best,
                    "toggles": ["disable_robustness"],
                    "runs": [["F16", "nt", "f16", N_BIG], ["Q4_K", "nt", "f32", N_BIG]],
                },
                90,
            ),
            *(
                ({"kind": "time", "cfg": CANDIDATES[n], "runs": [["F16", "nt", "f16", 2 * N_BIG]]}, 90)
                for n in ranked[:3]
            ),
        ):
            if time.perf_counter() - start > DEADLINE_S:
                break
            results.setdefault("best", []).append(run_job(spec, timeout, log))
    if time.perf_counter() - start < DEADLINE_S + 30:
        results["torch"] = run_job({"kind": "torch", "sizes": SWEEP}, 90, log)
    results["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    elif sys.argv[1:] == ["--final"]:
        final()
    else:
        main()
