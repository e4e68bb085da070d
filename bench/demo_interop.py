"""Does the demo's exported adapter carry its gain outside distillery? Held-out KL(teacher || student) of
`make demo`'s student, measured by HF transformers (+ peft), from the GGUF LoRA file, and by llama.cpp, as JSON.

    .venv/bin/python bench/demo_interop.py                    # after `make demo` (configs/demo.yaml, runs/demo)
    .venv/bin/python bench/demo_interop.py --config my.yaml   # any finished run with export.peft / gguf_lora
    .venv/bin/python bench/demo_interop.py --llama-cpp /work/lcpp-venv/bin/python   # + llama.cpp (README)

HF: transformers loads the run's student GGUF (dequantizing it), peft applies the exported PEFT adapter
(export/<key>/peft), and the logits on the held-out split are scored against the run's teacher top-k shards
with the pipeline's metric (model.kd forward KL over the top-k + tail bucket, tau = 1), without and with the
adapter, and the merged GGUF alone when the run wrote one (export.merge; the demo's mergeable adapter folded:
`*_merged_gain_kept` is the share of the adapter's KL gain it keeps, `merged_size_ratio` its size over the
student's). GGUF LoRA: the exported adapter-lora.gguf is read back tensor by tensor (lora_a [r, in], lora_b
[out, r], GGUF row order) and evaluated by distillery's own engine on the same positions. llama.cpp
(--llama-cpp PYTHON, an interpreter with llama-cpp-python, built from its sdist in a venv of its own): that
interpreter runs bench/llama_cpp_support.py, which loads the student GGUF with llama.cpp's own quantized CPU
kernels, without and with lora_path=adapter-lora.gguf, and returns per position only the log-probs at the
teacher's top-k ids, at the next token and the argmax (.npy files); they are scored here with the same formula.
Needs the interop extra (torch, transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # wgpu's Vulkan loader (train.backend auto asks for an adapter)

import stages.student  # noqa: E402
import stages.teacher  # noqa: E402
import stages.tokenize  # noqa: E402
from data.checkpoint import save_checkpoint  # noqa: E402
from data.tokens import read_tokenize_manifest  # noqa: E402
from data.topk import TopkReader  # noqa: E402
from model.config import LORA_TARGETS  # noqa: E402
from model.gguf import GGUFFile  # noqa: E402
from model.kd import LossConfig, kd_support_forward, log_softmax  # noqa: E402
from model.reference import LoraPair  # noqa: E402
from schemas.config import load_config  # noqa: E402
from stages.evaluate import gain_kept  # noqa: E402
from stages.export import GGUF_LORA, MERGED, PEFT_DIR  # noqa: E402
from stages.layout import stage_dir, workdir  # noqa: E402
from training.batches import read_split  # noqa: E402

METRIC = LossConfig("forward_kl", tau=1.0, use_tail=True)
# llama.cpp runs the 4-bit student with its own kernels (activations quantized to 8 bits for the Q4/Q8 dot
# products, f16 KV cache), so its held-out KL differs from the dequantized float32 forward of HF / distillery;
# measured on the demo: +0.0064 without and +0.0068 with the adapter (docs/benchmarks.md). Stated tolerance:
LLAMA_CPP_KL_TOL = 0.01


def run_files(config: Path, export: Path | None = None) -> dict[str, Path]:
    """The run's student GGUF, token folder, top-k folder and export folder (`export`, else the newest), found by
    the stage keys."""
    cfg = load_config(config)
    root = workdir(cfg)
    token_dir = stage_dir(cfg, stages.tokenize.FOLDER, stages.tokenize.KEY.key(cfg, {}))
    tokens = read_tokenize_manifest(token_dir)
    topk_dir = stage_dir(cfg, stages.teacher.FOLDER, stages.teacher.KEY.key(cfg, {"tokens": tokens}))
    exports = sorted(
        (p.parent.parent for p in (root / "export").glob(f"*/{PEFT_DIR}/adapter_config.json")),
        key=lambda p: p.stat().st_mtime,
    )
    if not exports:
        raise FileNotFoundError(f"{root / 'export'}: no exported PEFT adapter (run the demo first)")
    return {
        "student": stages.student.student_file(cfg, stages.student.KEY.key(cfg, {})),
        "tokens": token_dir,
        "topk": topk_dir,
        "export": exports[-1] if export is None else export,
    }


def heldout(files: dict[str, Path]) -> dict[str, np.ndarray]:
    """The held-out split and its teacher rows: ids, mask [N, T], top-k ids/logprobs [N, T, k], tail [N, T]."""
    split = read_split(files["tokens"], "eval")
    top = TopkReader(files["topk"]).read(split.seq_ids.tolist(), masks=list(split.mask))
    n, t = split.ids.shape
    k = top.ids.shape[1]
    tids, tlp, tail = np.zeros((n, t, k), np.int64), np.zeros((n, t, k), np.float32), np.zeros((n, t), np.float32)
    b, p = np.nonzero(split.mask)
    tids[b, p], tlp[b, p], tail[b, p] = top.ids, top.logprobs, top.tail
    return {"ids": split.ids, "mask": split.mask, "tids": tids, "tlp": tlp, "tail": tail}


def score_support(
    support: np.ndarray, target: np.ndarray, argmax: np.ndarray, data: dict[str, np.ndarray], rows: slice
) -> tuple[float, float, float, int]:
    """(sum of KL, sum of CE, top-1 agreements, positions) of sequences `rows` from the student's log-probs at
    the teacher's top-k ids [n, T, k], at the next token [n, T] and its argmax [n, T]: model.kd's forward KL
    (tau = 1, so tau^2 = 1 and log softmax(z / tau) = log softmax(z)), the same numbers kd_loss_forward gives."""
    live = np.flatnonzero(data["mask"][rows].reshape(-1))
    k = data["tids"].shape[-1]
    a = support.reshape(-1, k)[live].astype(np.float64)
    lt, tail = data["tlp"][rows].reshape(-1, k)[live], data["tail"][rows].reshape(-1)[live]
    kl = float(kd_support_forward(a, lt.astype(np.float64), tail.astype(np.float64), METRIC).sum())
    ce = -float(target.reshape(-1)[live].sum())
    top1 = float((argmax.reshape(-1)[live] == data["tids"][rows].reshape(-1, k)[live, 0]).sum())
    return kl, ce, top1, int(live.size)


def support_of(logits: np.ndarray, data: dict[str, np.ndarray], rows: slice) -> tuple[np.ndarray, ...]:
    """What score_support needs from logits [n, T, V]: log softmax at the top-k ids and next token, argmax."""
    ids = data["ids"][rows]
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    ls = log_softmax(logits.astype(np.float64))  # METRIC.tau = 1
    support = np.take_along_axis(ls, data["tids"][rows], axis=2)
    target = np.take_along_axis(ls, targets[..., None], axis=2)[..., 0]
    return support, target, ls.argmax(axis=2)


def score(logits: np.ndarray, data: dict[str, np.ndarray], rows: slice) -> tuple[float, float, float, int]:
    """(sum of KL, sum of CE, top-1 agreements, positions) of logits [n, T, V] for sequences `rows`."""
    return score_support(*support_of(logits, data, rows), data, rows)


def metrics(sums: list[tuple[float, float, float, int]]) -> dict[str, float]:
    kl, ce, top1, n = (sum(x[i] for x in sums) for i in range(4))
    return {"kl": kl / n, "top1": top1 / n, "ce": ce / n, "ppl": math.exp(min(ce / n, 50.0)), "positions": n}


def hf_eval(files: dict[str, Path], data: dict[str, np.ndarray], batch: int) -> dict[str, dict[str, float]]:
    """Held-out metrics of the student GGUF loaded by transformers, without and with the PEFT adapter."""
    import peft
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    student = files["student"]
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        student.parent, gguf_file=student.name, dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - t0

    def run(m: object) -> dict[str, float]:
        sums = []
        with torch.no_grad():
            for s in range(0, len(data["ids"]), batch):
                rows = slice(s, s + batch)
                logits = m(torch.tensor(data["ids"][rows])).logits.numpy()
                sums.append(score(logits, data, rows))
        return metrics(sums)

    base = run(model)
    with_adapter = peft.PeftModel.from_pretrained(model, files["export"] / PEFT_DIR).eval()
    out = {"baseline": base, "peft": run(with_adapter), "load_seconds": load_s}
    merged = files["export"] / MERGED
    if merged.is_file():  # the merged GGUF alone (a mergeable adapter's fold: Q4_1 where the student had Q4_0 / Q4_K)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            merged.parent, gguf_file=merged.name, dtype=torch.float32
        ).eval()
        out["merged"] = run(model)
    return out


def gguf_lora_adapter(path: Path) -> dict[tuple[int, str], LoraPair]:
    """The adapter in a GGUF LoRA file: blk.N.<stem>.weight.lora_a [r, in] / lora_b [out, r] (GGUF row order)."""
    stems = {stem: target for target, stem in LORA_TARGETS.items()}
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    with GGUFFile(path) as f:
        for name in f.tensors:
            blk, layer, stem, _, which = name.split(".")
            if blk != "blk" or stem not in stems or which not in ("lora_a", "lora_b"):
                raise ValueError(f"{path}: unexpected tensor {name}")
            pairs.setdefault((int(layer), stems[stem]), {})[which] = f.tensor_f32(name)
    return {key: LoraPair(A=p["lora_a"], B=p["lora_b"]) for key, p in pairs.items()}


def gguf_lora_eval(config: Path, files: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Held-out metrics of the student without an adapter and with the GGUF LoRA file's adapter, through
    distillery's engine (train.backend of the config)."""
    from training.evaluation import evaluate

    cfg = load_config(config)
    adapter = gguf_lora_adapter(files["export"] / GGUF_LORA)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ck", adapter, {"m": np.zeros(1, np.float32)}, {"step": 0, "epoch": 0})
        runs = [("baseline", files["student"], None), ("gguf_lora", files["student"], Path(tmp) / "ck")]
        if (files["export"] / MERGED).is_file():
            runs.append(("merged", files["export"] / MERGED, None))
        for name, gguf, checkpoint in runs:
            m = evaluate(
                cfg, student_gguf=gguf, token_dir=files["tokens"], topk_dir=files["topk"], checkpoint=checkpoint,
            )  # fmt: skip
            out[name] = {"kl": m["kl"], "top1": m["top1"], "ce": m["ce"], "ppl": m["ppl"], "positions": m["tokens"]}
    return out


def llama_cpp_eval(
    python: Path, files: dict[str, Path], data: dict[str, np.ndarray], threads: int, n_batch: int = 0
) -> dict:
    """Held-out metrics of the student GGUF run by llama.cpp, without and with the exported GGUF LoRA, through
    bench/llama_cpp_support.py in `python` (its own venv: llama-cpp-python is not a project dependency)."""
    out: dict[str, object] = {}
    runs = [("baseline", files["student"], None), ("gguf_lora", files["student"], files["export"] / GGUF_LORA)]
    if (files["export"] / MERGED).is_file():
        runs.append(("merged", files["export"] / MERGED, None))
    for name, gguf, lora in runs:
        out[name], out[f"{name}_log"] = llama_cpp_metrics(python, gguf, lora, data, threads, n_batch)
    return out


def llama_cpp_metrics(
    python: Path, gguf: Path, lora: Path | None, data: dict[str, np.ndarray], threads: int, n_batch: int = 0
) -> tuple[dict[str, float], str]:
    """Held-out metrics of `gguf` (+ the GGUF LoRA `lora`) run by llama.cpp in `python`, and its log line."""
    helper = Path(__file__).with_name("llama_cpp_support.py")
    with tempfile.TemporaryDirectory() as tmp:
        ids, tids, res = Path(tmp) / "ids.npy", Path(tmp) / "tids.npy", Path(tmp) / "out"
        np.save(ids, data["ids"].astype(np.int64), allow_pickle=False)
        np.save(tids, data["tids"], allow_pickle=False)
        cmd = [str(python), str(helper), str(gguf), str(ids), str(tids), str(res)]
        cmd += ["--threads", str(threads), "--n-batch", str(n_batch)]
        cmd += [] if lora is None else ["--lora", str(lora)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise SystemExit(f"--llama-cpp {python}: cannot run it ({e})") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"--llama-cpp {python}: {helper.name} failed ({last})")
        arrays = [np.load(res / f"{x}.npy", allow_pickle=False) for x in ("support", "target", "argmax")]
        out = metrics([score_support(*arrays, data, slice(None))])
        out["seconds"] = time.perf_counter() - t0
    return out, proc.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    p.add_argument("--batch", type=int, default=4, help="sequences per HF forward")
    p.add_argument("--no-hf", action="store_true", help="skip transformers/peft (only the GGUF LoRA)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="PYTHON", help="python with llama-cpp-python")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--llama-cpp-batch", type=int, default=0, help="llama.cpp tokens per batch (0: a sequence)")
    p.add_argument("--export", type=Path, default=None, help="the export folder (default: the newest)")
    args = p.parse_args()
    files = run_files(args.config, args.export)
    data = heldout(files)
    out: dict[str, object] = {"what": "demo_interop", "files": {k: str(v) for k, v in files.items()}}
    if not args.no_hf:
        out["hf"] = hf_eval(files, data, args.batch)
        hf = out["hf"]
        out["hf_kl_reduction"] = 1 - hf["peft"]["kl"] / hf["baseline"]["kl"]  # type: ignore[index]
    ours = gguf_lora_eval(args.config, files)
    out["distillery_engine"] = ours
    out["gguf_lora_kl_reduction"] = 1 - ours["gguf_lora"]["kl"] / ours["baseline"]["kl"]
    if args.llama_cpp is not None:
        out["llama_cpp"] = llama_cpp_eval(args.llama_cpp, files, data, args.threads, args.llama_cpp_batch)
        lc = out["llama_cpp"]
        out["llama_cpp_kl_reduction"] = 1 - lc["gguf_lora"]["kl"] / lc["baseline"]["kl"]  # type: ignore[index]
        gaps = {k: lc[k]["kl"] - ours[k]["kl"] for k in ("baseline", "gguf_lora")}  # type: ignore[index]
        out["llama_cpp_kl_minus_engine"] = gaps
        out["llama_cpp_within_tolerance"] = all(abs(g) <= LLAMA_CPP_KL_TOL for g in gaps.values())
    else:
        out["llama_cpp"] = "not run: pass --llama-cpp PYTHON (an interpreter with llama-cpp-python; README)"
    for name, adapter_key in (("hf", "peft"), ("distillery_engine", "gguf_lora"), ("llama_cpp", "gguf_lora")):
        res = out.get(name)
        if isinstance(res, dict) and "merged" in res:  # the share of the adapter's KL gain the merged file keeps
            base, adapter, merged = (res[k]["kl"] for k in ("baseline", adapter_key, "merged"))
            out[f"{name}_merged_gain_kept"] = gain_kept(base, adapter, merged)
            out[f"{name}_merged_kl_reduction"] = 1 - merged / base
    if (files["export"] / MERGED).is_file():
        out["merged_size_ratio"] = (files["export"] / MERGED).stat().st_size / files["student"].stat().st_size
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
