"""Does the demo's exported adapter carry its gain outside distillery? Held-out KL(teacher || student) of
`make demo`'s student, measured by HF transformers (+ peft) and from the GGUF LoRA file, printed as JSON.

    .venv/bin/python bench/demo_interop.py                    # after `make demo` (configs/demo.yaml, runs/demo)
    .venv/bin/python bench/demo_interop.py --config my.yaml   # any finished run with export.peft / gguf_lora

HF: transformers loads the run's student GGUF (dequantizing it), peft applies the exported PEFT adapter
(export/<key>/peft), and the logits on the held-out split are scored against the run's teacher top-k shards
with the pipeline's metric (model.kd forward KL over the top-k + tail bucket, tau = 1), without and with the
adapter. GGUF LoRA: the exported adapter-lora.gguf is read back tensor by tensor (lora_a [r, in], lora_b
[out, r], GGUF row order) and evaluated by distillery's own engine on the same positions. llama.cpp cannot be
installed on this machine (no wheel or compiler for llama-cpp-python here), so the GGUF LoRA is not run
through llama.cpp by this script; DESIGN.md records that llama.cpp 0.3.36 loads exactly this layout.
Needs the interop extra (torch, transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from model.kd import LossConfig, kd_loss_forward, log_softmax  # noqa: E402
from model.reference import LoraPair  # noqa: E402
from schemas.config import load_config  # noqa: E402
from stages.export import GGUF_LORA, PEFT_DIR  # noqa: E402
from stages.layout import stage_dir, workdir  # noqa: E402
from training.batches import read_split  # noqa: E402

METRIC = LossConfig("forward_kl", tau=1.0, use_tail=True)


def run_files(config: Path) -> dict[str, Path]:
    """The run's student GGUF, token folder, top-k folder and newest export folder, found by the stage keys."""
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
        "export": exports[-1],
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


def score(logits: np.ndarray, data: dict[str, np.ndarray], rows: slice) -> tuple[float, float, float, int]:
    """(sum of KL, sum of CE, top-1 agreements, positions) of logits [n, T, V] for sequences `rows`."""
    ids, mask = data["ids"][rows], data["mask"][rows]
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    flat = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    m = mask.reshape(-1)
    n = int(m.sum())
    k = data["tids"].shape[-1]
    kl = kd_loss_forward(
        flat, data["tids"][rows].reshape(-1, k), data["tlp"][rows].reshape(-1, k),
        data["tail"][rows].reshape(-1), targets.reshape(-1), m, METRIC,
    ) * n  # fmt: skip
    live = np.flatnonzero(m)
    ls = log_softmax(flat[live])
    ce = -float(np.take_along_axis(ls, targets.reshape(-1)[live, None], axis=1).sum())
    top1 = float((flat[live].argmax(axis=1) == data["tids"][rows].reshape(-1, k)[live, 0]).sum())
    return kl, ce, top1, n


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
    return {"baseline": base, "peft": run(with_adapter), "load_seconds": load_s}


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
        for name, checkpoint in (("baseline", None), ("gguf_lora", Path(tmp) / "ck")):
            m = evaluate(
                cfg, student_gguf=files["student"], token_dir=files["tokens"], topk_dir=files["topk"],
                checkpoint=checkpoint,
            )  # fmt: skip
            out[name] = {"kl": m["kl"], "top1": m["top1"], "ce": m["ce"], "ppl": m["ppl"], "positions": m["tokens"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    p.add_argument("--batch", type=int, default=4, help="sequences per HF forward")
    p.add_argument("--no-hf", action="store_true", help="skip transformers/peft (only the GGUF LoRA)")
    args = p.parse_args()
    files = run_files(args.config)
    data = heldout(files)
    out: dict[str, object] = {"what": "demo_interop", "files": {k: str(v) for k, v in files.items()}}
    if not args.no_hf:
        out["hf"] = hf_eval(files, data, args.batch)
        hf = out["hf"]
        out["hf_kl_reduction"] = 1 - hf["peft"]["kl"] / hf["baseline"]["kl"]  # type: ignore[index]
    ours = gguf_lora_eval(args.config, files)
    out["distillery_engine"] = ours
    out["gguf_lora_kl_reduction"] = 1 - ours["gguf_lora"]["kl"] / ours["baseline"]["kl"]
    out["llama_cpp"] = "not run: llama.cpp / llama-cpp-python is not installable on this machine"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
