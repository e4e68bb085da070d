"""Student log-probs at the teacher's top-k ids, computed by llama.cpp (llama-cpp-python), for bench/demo_interop.py.

Runs in a separate interpreter that has llama-cpp-python and numpy (not the project's venv), so it imports
nothing from distillery. For every held-out sequence it evaluates the token ids as given (no BOS added, as the
HF path) with logits_all=True and keeps, per position, only what the held-out metrics need:

    support [N, T, k]  log softmax(z)[teacher top-k ids]   (float64)
    target  [N, T]     log softmax(z)[next token]          (float64; 0 at the last position)
    argmax  [N, T]     argmax(z)                           (int64)

    python bench/llama_cpp_support.py STUDENT.gguf IDS.npy TOPK_IDS.npy OUT_DIR [--lora adapter-lora.gguf]

IDS.npy is int [N, T], TOPK_IDS.npy int [N, T, k]; OUT_DIR gets support.npy, target.npy, argmax.npy (written
to a .tmp name then renamed). Plain .npy arrays only: object arrays are refused when read.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log softmax in float64."""
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))


def save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("student", type=Path)
    p.add_argument("ids", type=Path)
    p.add_argument("topk_ids", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--lora", type=Path, default=None, help="GGUF LoRA adapter (llama.cpp --lora)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--n-batch",
        type=int,
        default=0,
        help="tokens per llama.cpp batch (0: a whole sequence); 1 keeps llama.cpp's one-token kernels (its batched "
        "Q4_1 path crashed on an AMX CPU with llama-cpp-python 0.3.36)",
    )
    args = p.parse_args()

    import llama_cpp

    ids = np.load(args.ids, allow_pickle=False)
    tids = np.load(args.topk_ids, allow_pickle=False).astype(np.intp)
    n, t = ids.shape
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(args.student),
        lora_path=None if args.lora is None else str(args.lora),
        n_ctx=t,
        n_batch=args.n_batch or t,
        n_ubatch=args.n_batch or t,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        n_gpu_layers=0,
        seed=0,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    if llm.n_vocab() <= int(max(ids.max(), tids.max())):
        raise SystemExit(f"{args.student}: n_vocab {llm.n_vocab()} is smaller than the token ids in {args.ids}")
    support = np.zeros(tids.shape, np.float64)
    target = np.zeros((n, t), np.float64)
    argmax = np.zeros((n, t), np.int64)
    t1 = time.perf_counter()
    for i in range(n):
        llm.reset()
        llm.eval([int(x) for x in ids[i]])
        ls = log_softmax(np.asarray(llm.scores[:t], np.float32))
        support[i] = np.take_along_axis(ls, tids[i], axis=1)
        target[i, :-1] = ls[np.arange(t - 1), ids[i, 1:]]
        argmax[i] = ls.argmax(axis=1)
    args.out.mkdir(parents=True, exist_ok=True)
    save(args.out / "support.npy", support)
    save(args.out / "target.npy", target)
    save(args.out / "argmax.npy", argmax)
    eval_s = time.perf_counter() - t1
    print(f"llama.cpp {llama_cpp.__version__}: loaded in {load_s:.1f} s, {n} x {t} tokens in {eval_s:.1f} s")


if __name__ == "__main__":
    main()
