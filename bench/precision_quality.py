"""Held-out quality of one matmul precision against another, as JSON: issue 22's gate for int8 (the demo trained
through it reaches a held-out KL within 2 % of the f16 tensor-core path's, same data, steps and seed).

    python bench/precision_quality.py configs/demo.yaml --precisions tensorcore,int8      # a GPU with Dawn
    python bench/precision_quality.py configs/demo.yaml --precisions f32 --set train.epochs=1   # plumbing (lavapipe)

Tokenize, student and teacher run once through the stage library (cached in the workdir by their content keys)
and their manifests are written to <workdir>/prepared.json; `--until teacher` stops there. On another machine
(the GPU one) `--prepared <workdir>/prepared.json` reads them instead, so only the workdir's student GGUF, token
and teacher shards travel (not the model files the keys hash), and that machine needs neither `datasets` nor
the tokenizer. Train and evaluate run per precision
(train.precision is in both stages' keys: each precision has its own checkpoints and evaluations; the int8
engine knobs below are not, so with any of them each precision's checkpoints are deleted and trained afresh).
Rows: per precision the baseline's and each epoch's held-out KL, top-1 agreement and CE, and the best epoch;
last, each precision's best KL relative to the first precision's (`kl_vs_first`: the gate is |x| <= 0.02).
No Prefect or MLflow: the stage functions alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages.evaluate  # noqa: E402
import stages.train  # noqa: E402
from schemas.config import RunConfig, load_config  # noqa: E402
from schemas.manifests import EvalManifest, StudentManifest, TeacherManifest, TokenizeManifest  # noqa: E402
from stages.layout import workdir  # noqa: E402
from training import engines  # noqa: E402

PREPARED = {"tokens": TokenizeManifest, "student": StudentManifest, "teacher": TeacherManifest}


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def metrics(manifest: EvalManifest) -> dict[str, Any]:
    """The held-out figures of an evaluation manifest."""
    return manifest.model_dump(include={"epoch", "step", "kl", "top1", "ce", "n_positions"})


# int8: LoRA's products from int8 codes or from f32 (--int8-lora-<flag> codes|f32): the module switch each sets
LORA_CODES = {
    "t": ("gpu.ops.lora_i8", "THIN_I8", "t = x A^T from x's int8 codes and A's (gpu/ops/lora_i8.py), or from f32 x"),
    "dt": ("gpu.ops.lora_i8", "THIN_DT", "dt = s dY B from the input gradient's dY codes and B / sW (THIN_DT)"),
    "db": ("gpu.ops.lora_db_i8", "THIN_DB", "dB = s dY^T t from the input gradient's dY codes (THIN_DB)"),
    "da": ("gpu.ops.lora_da_i8", "THIN_DA", "dA = dt^T x from the forward's x codes (THIN_DA)"),
}


def prepare(cfg: RunConfig, prepared: str | None) -> dict[str, Any]:
    """The tokens, student and teacher manifests: read from `prepared`, or made by their stages and saved."""
    if prepared:
        data = json.loads(Path(prepared).read_text())
        return {name: cls.model_validate(data[name]) for name, cls in PREPARED.items()}
    import stages.student  # the first stages (and their `datasets`) only where they run
    import stages.teacher
    import stages.tokenize

    tokens = stages.tokenize.run(cfg)
    out = {"tokens": tokens, "student": stages.student.prepare(cfg), "teacher": stages.teacher.run(cfg, tokens)}
    path = workdir(cfg) / "prepared.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({name: m.model_dump(mode="json") for name, m in out.items()}, indent=1))
    tmp.replace(path)
    return out


def with_precision(cfg: RunConfig, precision: str) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": precision})})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a run config (e.g. configs/demo.yaml)")
    ap.add_argument("--precisions", default="tensorcore,int8", help="comma-separated; the first is the reference")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config overrides")
    ap.add_argument("--until", choices=("teacher", "evaluate"), default="evaluate", help="teacher: prepare only")
    ap.add_argument("--prepared", default=None, help="a prepared.json to read instead of running the first stages")
    ap.add_argument(
        "--int8-lora-epilogue", choices=("on", "off"), default=None, help="int8: LoRA expansions in the GEMM epilogues"
    )
    ap.add_argument(
        "--int8-input-grads", choices=("transposed", "nn", "f16"), default=None, help="int8: the input gradients' GEMM"
    )
    ap.add_argument(
        "--int8-head",
        choices=("on", "logits", "probs", "off"),
        default=None,
        help="int8: the student's LM head on the integer GEMM (logits: its logits only, the backward on f16; probs: "
        "the backward's P . W too, from stochastically rounded probabilities)",
    )
    ap.add_argument(
        "--int8-rotation", choices=("on", "off"), default=None, help="int8: GEMM operands in Walsh-Hadamard blocks"
    )
    for flag, (_, _, what) in LORA_CODES.items():
        ap.add_argument(f"--int8-lora-{flag}", choices=("codes", "f32"), default=None, help=f"int8: LoRA's {what}")
    args = ap.parse_args()
    lora_codes = {flag: getattr(args, f"int8_lora_{flag}") for flag in LORA_CODES}
    for flag, choice in lora_codes.items():
        if choice:
            module, switch, _ = LORA_CODES[flag]
            setattr(importlib.import_module(module), switch, choice == "codes")
    if args.int8_head:
        from gpu.ops import head

        head.INT8_STUDENT_HEAD = args.int8_head == "on"
        head.INT8_STUDENT_LOGITS = args.int8_head in ("logits", "probs")
        head.INT8_STUDENT_PROBS = args.int8_head == "probs"
    if args.int8_lora_epilogue or args.int8_input_grads or args.int8_rotation:  # the engine's class defaults (A/B)
        from gpu.model import GPUModel
        from gpu.student import GPUStudent

        if args.int8_rotation:
            GPUModel.int8_rotation = args.int8_rotation == "on"
        if args.int8_lora_epilogue:
            GPUModel.lora_in_gemm_i8 = args.int8_lora_epilogue == "on"
        if args.int8_input_grads:
            GPUStudent.int8_input_grads = args.int8_input_grads != "f16"
            GPUStudent.transposed_input_grads = args.int8_input_grads == "transposed"
    cfg = load_config(args.config, args.set)
    t0 = time.perf_counter()
    m = prepare(cfg, args.prepared)
    tokens, student, teacher = m["tokens"], m["student"], m["teacher"]
    emit(what="prepared", workdir=str(workdir(cfg)), seconds=round(time.perf_counter() - t0, 1))
    if args.until == "teacher":
        return
    best: dict[str, float] = {}
    # the engine knobs are not part of the train stage's key: with any of them, each precision trains afresh
    knobs = any(
        (args.int8_lora_epilogue, args.int8_input_grads, args.int8_head, args.int8_rotation, *lora_codes.values())
    )  # fmt: skip
    for precision in [p for p in args.precisions.split(",") if p]:
        pcfg = with_precision(cfg, precision)
        if knobs:
            shutil.rmtree(stages.train.checkpoint_root(pcfg, student, tokens, teacher), ignore_errors=True)
        t0 = time.perf_counter()
        checkpoints = stages.train.run(pcfg, student, tokens, teacher)
        trained = time.perf_counter() - t0
        baseline = metrics(stages.evaluate.run(pcfg, student, tokens, teacher))
        epochs = [metrics(stages.evaluate.run(pcfg, student, tokens, teacher, c)) for c in checkpoints]
        kls = [float(e["kl"]) for e in epochs]
        best[precision] = min(kls)
        emit(
            what="precision",
            precision=precision,
            eval_precision=engines.eval_precision(pcfg),
            train_seconds=round(trained, 1),
            baseline=baseline,
            epochs=epochs,
            best_epoch=kls.index(best[precision]),
            best_kl=best[precision],
        )
    first = next(iter(best.values()), None)
    if first:
        emit(what="summary", best_kl=best, kl_vs_first={p: round(v / first - 1, 4) for p, v in best.items()})


if __name__ == "__main__":
    main()
