"""Scale-out on Ray on one machine, as JSON lines: the teacher's top-k in this process vs as Ray tasks, and the
LoRA train step of one engine vs train.workers data-parallel Ray actors, each worker with its own device.

    python bench/ray_scale.py --shape smollm2 --batch 4 --seq 512 --accum 2 --workers 2 --gpus-per-worker 0.5

Weights: bench/train_step.py's random student at checkpoint-like scales (--quant blocks), written as a GGUF the
workers load (teacher = student). Teacher: --teacher-seqs random sequences of --seq tokens, top-k of --top-k;
local = training.teacher.make_teacher_fn here; ray = --workers Ray tasks (scale.gpus_per_worker GPUs each),
each its own process, device and upload, each taking an equal part; steady = after each worker's warm-up call,
wall = submit to last result (process start, upload and pipeline compilation included). Train: --steps steps of
--accum micro-batches of --batch sequences after one warm-up step; local = training.engines.build_engine here,
ray = training.data_parallel.DataParallelEngine (the per-step timings it records: gather_s, the micro-batch
gradients reaching the driver; sum_s, their ordered sum and put; broadcast_s, the sum reaching the last worker;
together the all-reduce cost per step). The first steps' losses of both are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from model.engine_spec import KdBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from bench.train_step import SHAPES, _teacher_batch, random_tensors  # noqa: E402


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def write_student(path: Path, shape: str, quant: str) -> Path:
    from model.gguf import llama_metadata, write_gguf

    cfg = SHAPES[shape]
    meta = llama_metadata(cfg, name=f"random-{shape}")
    rng = np.random.default_rng(0)
    write_gguf(path, "llama", meta, ((n, d, q) for n, d, q, _ in random_tensors(cfg, Q[quant], rng)))
    return path


def run_config(args: argparse.Namespace, student: Path, root: Path, workers: int) -> Any:
    from schemas.config import RunConfig

    return RunConfig.model_validate(
        {
            "model": {"student": str(student), "teacher": str(student)},
            "data": {"path": str(root), "seq_len": args.seq},
            "teacher": {"top_k": args.top_k, "backend": args.backend},
            "lora": {"r": args.rank, "alpha": 2.0 * args.rank},
            "train": {"batch_size": args.batch, "grad_accum": args.accum, "backend": args.backend, "workers": workers},
            "run": {"workdir": str(root / "run")},
            "scale": {"ray_address": "local", "gpus_per_worker": args.gpus_per_worker},
        }
    )


# ---- teacher -------------------------------------------------------------------------------------------------
def teacher_part(cfg_json: str, student: str, ids: np.ndarray) -> dict[str, float]:
    """Top-k of `ids` with this process's teacher: (load+warm-up seconds, steady seconds, positions)."""
    from schemas.config import RunConfig
    from training.teacher import make_teacher_fn

    t0 = time.time()
    cfg = RunConfig.model_validate_json(cfg_json)
    teacher = make_teacher_fn(cfg, Path(student))
    per_call = max(1, teacher.rows_per_call // ids.shape[1])
    mask = np.ones_like(ids, np.uint8)
    teacher(ids[:per_call], mask[:per_call])  # warm-up: pipelines compiled
    t1 = time.time()
    for s in range(0, len(ids), per_call):
        teacher(ids[s : s + per_call], mask[s : s + per_call])
    return {"start": t0, "warm_s": t1 - t0, "steady_s": time.time() - t1, "positions": float(ids.size)}


def bench_teacher(args: argparse.Namespace, cfg: Any, student: Path, ray: Any) -> None:
    from training.cluster import resources

    rng = np.random.default_rng(1)
    ids = rng.integers(0, SHAPES[args.shape].vocab, (args.teacher_seqs, args.seq))
    local = teacher_part(cfg.model_dump_json(), str(student), ids)
    emit(what="teacher", runner="local", positions_per_s=round(local["positions"] / local["steady_s"], 1), **local)
    options = resources(args.backend, "teacher.backend", args.gpus_per_worker)
    task = ray.remote(**options)(teacher_part)
    t0 = time.time()
    parts = np.array_split(ids, args.workers)
    results = ray.get([task.remote(cfg.model_dump_json(), str(student), p) for p in parts])
    wall = time.time() - t0
    steady = max(r["steady_s"] for r in results)
    emit(
        what="teacher",
        runner="ray",
        workers=args.workers,
        options=options,
        positions_per_s=round(ids.size / steady, 1),
        positions_per_s_wall=round(ids.size / wall, 1),
        wall_s=round(wall, 2),
        worker_start_s=[round(r["start"] - t0, 2) for r in results],
        warm_s=[round(r["warm_s"], 2) for r in results],
        steady_s=[round(r["steady_s"], 3) for r in results],
        speedup_vs_local=round((ids.size / steady) / (local["positions"] / local["steady_s"]), 3),
    )


# ---- train ----------------------------------------------------------------------------------------------------
def batches(args: argparse.Namespace, n: int) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(2)
    vocab, b, t, k = SHAPES[args.shape].vocab, args.batch, args.seq, args.top_k
    out = []
    for _ in range(n):
        ids, tids = _teacher_batch(vocab, b, t, k, rng)
        lp = np.log(np.full((b, t, k), 0.9 / k, np.float32))
        out.append((ids, np.roll(ids, -1, 1), np.ones((b, t), np.uint8), tids, lp, np.full((b, t), 0.1, np.float32)))
    return out


def train_steps(args: argparse.Namespace, engine: Any, data: list[tuple[np.ndarray, ...]]) -> dict[str, Any]:
    from model import reference
    from model.config import LORA_TARGETS

    init = reference.init_lora(engine.cfg, list(LORA_TARGETS), args.rank, 0)
    engine.set_adapter({key: pair for key, pair in init.items() if key in engine.layout.slots})
    secs, losses, i = [], [], 0
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        for micro in range(args.accum):
            engine.write_batch(KdBatch(*data[i % len(data)]))
            engine.accumulate(micro)
            i += 1
        stats = engine.apply(1e-4)
        losses.append(float(stats.loss))
        if step:  # the first step warms up
            secs.append(time.perf_counter() - t0)
    tokens = args.batch * args.seq * args.accum
    return {
        "seconds_per_step": round(statistics.median(secs), 4),
        "tokens_per_s": round(tokens / statistics.median(secs), 1),
        "steps_s": [round(s, 4) for s in secs],
        "losses": losses,
    }


def bench_train(args: argparse.Namespace, root: Path, student: Path) -> None:
    from training.data_parallel import DataParallelEngine
    from training.engines import build_engine

    data = batches(args, 2 * args.accum)
    t0 = time.perf_counter()
    local = build_engine(run_config(args, student, root, 1), student, args.seq)
    emit(what="train_build", runner="local", seconds=round(time.perf_counter() - t0, 2))
    one = train_steps(args, local, data)
    emit(what="train", runner="local", workers=1, precision=getattr(local, "precision", "f32"), **one)
    del local
    t0 = time.perf_counter()
    dp = DataParallelEngine(run_config(args, student, root, args.workers), student, args.seq)
    emit(what="train_build", runner="ray", workers=args.workers, seconds=round(time.perf_counter() - t0, 2))
    two = train_steps(args, dp, data)
    timings = dp.timings[1:]  # after the warm-up step
    med = {k: round(statistics.median(t[k] for t in timings), 4) for k in timings[0]}
    allreduce = med["gather_s"] + med["sum_s"] + med["broadcast_s"]
    emit(
        what="train",
        runner="ray",
        workers=args.workers,
        **two,
        timings_median=med,
        allreduce_s_per_step=round(allreduce, 4),
        allreduce_share=round(allreduce / two["seconds_per_step"], 3),
        gradient_bytes=4 * dp.layout.n_params,
        speedup_vs_local=round(one["seconds_per_step"] / two["seconds_per_step"], 3),
        losses_equal=one["losses"] == two["losses"],
        max_loss_diff=max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--quant", default="Q4_0")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--teacher-seqs", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpus-per-worker", type=float, default=0.5)
    p.add_argument("--backend", default="gpu", choices=("gpu", "numpy"))
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--skip", default="", help="comma list: teacher, train")
    args = p.parse_args()
    import ray

    root = Path(tempfile.mkdtemp(prefix="ray-scale-"))
    t0 = time.perf_counter()
    student = write_student(root / "student.gguf", args.shape, args.quant)
    emit(
        what="student",
        shape=args.shape,
        quant=args.quant,
        bytes=student.stat().st_size,
        seconds=round(time.perf_counter() - t0, 2),
    )
    t0 = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    emit(
        what="ray",
        version=ray.__version__,
        init_s=round(time.perf_counter() - t0, 2),
        resources=ray.cluster_resources(),
    )
    if "teacher" not in args.skip:
        bench_teacher(args, run_config(args, student, root, 1), student, ray)
    if "train" not in args.skip:
        bench_train(args, root, student)
    ray.shutdown()


if __name__ == "__main__":
    main()
