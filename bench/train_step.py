"""LoRA-KD train step and teacher top-k throughput, ours (wgpu) next to HF transformers + PEFT (torch), as JSON.

    python bench/train_step.py --shape tinyllama --batch 4 --seq 1024 --precision tensorcore --profile
    python bench/train_step.py --gguf runs/demo/student/<key>/student.gguf --batch 4 --seq 1024  # real weights
    python bench/train_step.py --shape smollm2 --batch 1 --seq 128 --no-torch    # lavapipe: the demo's number

Each side (ours; HF+PEFT bf16; HF+PEFT fp32) runs in its own process, alone on the GPU, while this process
samples the GPU's used memory (bench/gpu_memory.py: NVML, else nvidia-smi): the peak above the baseline is
the side's whole-process footprint, measured the same way for both; each side also reports its own accounting
(our Device.peak_bytes, torch.cuda.max_memory_allocated). Throughput: one warm-up step, then --repeats windows
of --steps steps each; the median window is reported with all windows. The last line is a summary with ratios.

Weights: --gguf FILE loads a real student (ours: ModelWeights.from_gguf; HF: from_pretrained(dir,
gguf_file=...)), else --shape builds random weights at checkpoint-like scales (embedding and projections
N(0, 0.02), o/down scaled by 1/sqrt(2 n_layers), norms 1; ours as random GGML blocks of --quant whose f16
scales are set to that RMS, the embedding Q4_K (Q8_0 where the row length is not a multiple of 256) and the
untied lm_head Q6_K as llama.cpp's K-quant mixes store them, HF by its own initializer at 0.02). Loss: forward
KL over a random teacher's top-k (k=--top-k) plus the tail. --profile adds per-kernel-class GPU time of
--profile-steps extra steps (gpu/profile.py, timestamp queries) to our side's output.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gpu.model import INT8_CODES
from gpu.objectives import GpuKd
from gpu.ops.matmul_i8 import I8_TILE
from model.engine_spec import EngineSpec, KdBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from model.config import LORA_TARGETS, ModelConfig  # noqa: E402

# issue 22's sizes: Llama-3-8B (untied) and Llama-3.2-3B (tied) shapes, vocab 128,256, head dim 128
_LLAMA3 = {"vocab": 128256, "context_length": 8192, "rope_base": 5e5}
SHAPES = {
    "tinyllama": ModelConfig(
        n_layers=22, hidden=2048, ffn=5632, n_heads=32, n_kv_heads=4, vocab=32000, tied_embeddings=False
    ),
    "llama8b": ModelConfig(
        n_layers=32, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8, tied_embeddings=False, **_LLAMA3
    ),
    "llama3b": ModelConfig(n_layers=28, hidden=3072, ffn=8192, n_heads=24, n_kv_heads=8, **_LLAMA3),
    "smollm2": ModelConfig(
        n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3, vocab=49152, context_length=8192, rope_base=1e5
    ),
    "tiny": ModelConfig(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=1000, context_length=256),
}
SIDES = ("ours", "hf-bf16", "hf-fp32", "hf-qlora")
INIT_STD = 0.02  # projections and embeddings of real checkpoints (HF's initializer_range)
_F16_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


# ---- random weights at checkpoint scales -------------------------------------------------------------------
def scaled_blocks(qtype: int, shape: tuple[int, int], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random GGML blocks of `qtype` whose dequantized values have RMS `std` and mean ~0 (gpu.weights.random_blocks
    with its f16 block scales rescaled; Q4_K/Q4_1 minimums set to centre each block's 4-bit codes)."""
    from gpu.weights import random_blocks
    from model.quant import dequantize

    qtype = Q(qtype)
    raw = random_blocks(qtype, shape, rng)
    if qtype.name in ("F32", "F16"):
        w = raw.view(np.float32 if qtype.name == "F32" else np.float16) * std
        return w.astype(np.float32 if qtype.name == "F32" else np.float16).view(np.uint8)
    nb = raw.size // _block_bytes(qtype)
    blocks = raw.reshape(nb, -1)  # a view: edits land in raw
    fields = _F16_SCALES[qtype.name]
    d = blocks[:, fields[0] : fields[0] + 2].copy().view(np.float16).astype(np.float32)
    if qtype.name in ("Q4_K", "Q4_1"):  # w = d*sc*q - dmin*m (Q4_1: d*q + m): centre the 4-bit codes
        m = (7.5 * d) if qtype.name == "Q4_K" else (-7.5 * d)
        blocks[:, fields[1] : fields[1] + 2] = m.astype(np.float16).view(np.uint8).reshape(nb, 2)
    rows = min(shape[0], 64)
    sample = dequantize(raw[:rows], qtype, (rows, shape[1]))
    factor = std / float(np.sqrt(np.mean(np.square(sample, dtype=np.float64))))
    for off in fields:
        v = blocks[:, off : off + 2].copy().view(np.float16).astype(np.float32) * factor
        blocks[:, off : off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(shape[0], -1)


def _block_bytes(qtype: Q) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


def random_tensors(cfg: ModelConfig, qtype: int, rng: np.random.Generator) -> Iterator[tuple]:
    """(name, data, ggml type, shape) of a random student at checkpoint-like scales (see the module doc)."""
    h = cfg.hidden
    embd = Q.Q4_K if h % 256 == 0 else Q.Q8_0  # as llama.cpp's K-quant mixes store token_embd (Q4_K_M: Q4_K)
    yield "token_embd.weight", scaled_blocks(embd, (cfg.vocab, h), INIT_STD, rng), embd, (cfg.vocab, h)
    if not cfg.tied_embeddings:
        yield "output.weight", scaled_blocks(Q.Q6_K, (cfg.vocab, h), INIT_STD, rng), Q.Q6_K, (cfg.vocab, h)
    yield "output_norm.weight", np.ones(h, np.float32), Q.F32, (h,)
    residual_out = INIT_STD / np.sqrt(2 * cfg.n_layers)
    for i in range(cfg.n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            yield f"blk.{i}.{norm}.weight", np.ones(h, np.float32), Q.F32, (h,)
        for t, stem in LORA_TARGETS.items():
            shape = cfg.target_shape(t)
            std = residual_out if t in ("o", "down") else INIT_STD
            yield f"blk.{i}.{stem}.weight", scaled_blocks(qtype, shape, std, rng), qtype, shape


# ---- timing -------------------------------------------------------------------------------------------------
def windows(step: Callable[[], Any], steps: int, repeats: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per call of step() in `repeats` windows of `steps` calls, after one warm-up call."""
    step()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out.append((time.perf_counter() - t0) / steps)
    return out


def throughput(tokens: int, secs: list[float]) -> dict[str, Any]:
    per_window = [round(tokens / s, 1) for s in secs]
    return {
        "tokens_per_s": statistics.median(per_window),
        "tokens_per_s_windows": per_window,
        "seconds_per_step": round(statistics.median(secs), 4),
    }


def _teacher_batch(vocab: int, b: int, t: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [b, t] and k distinct random teacher ids per position (windows of one random permutation)."""
    ids = rng.integers(0, vocab, (b, t))
    perm = rng.permutation(vocab)
    starts = rng.integers(0, vocab, b * t)
    tids = perm[(starts[:, None] + np.arange(k)[None, :]) % vocab].reshape(b, t, k)
    return ids, tids


# ---- ours ---------------------------------------------------------------------------------------------------
def kd_student(dev: Any, weights: Any, args: argparse.Namespace, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """The bench's KD student on `weights` (LoRA r = args.rank on all 7 projections, alpha 2r, args.precision) with
    a random batch of args.batch x args.seq written (top-args.top_k teacher, forward KL with the tail); and its ids."""
    from gpu.student import GPUStudent
    from model import reference
    from model.kd import LossConfig

    cfg, b, t, k = weights.cfg, args.batch, args.seq, args.top_k
    spec = EngineSpec(
        cfg, targets=LORA_TARGETS, r=args.rank, alpha=2 * args.rank, batch=b, seq_len=t, precision=args.precision
    )
    kept = args.kept_blocks if args.kept_blocks == "auto" else int(args.kept_blocks)
    kd = GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=True), k)
    st = GPUStudent(dev, weights, spec, kd, kept_blocks=kept, int8_codes=args.int8_codes)
    st.set_adapter(reference.init_lora(cfg, list(LORA_TARGETS), args.rank, seed=0))
    ids, tids = _teacher_batch(cfg.vocab, b, t, k, rng)
    tlp = np.log(np.full((b, t, k), 0.9 / k, np.float32))
    st.write_batch(KdBatch(ids, np.roll(ids, -1, 1), np.ones((b, t)), tids, tlp, np.full((b, t), 0.1, np.float32)))
    return st, ids


# --ab: engine switches timed one after the other on the same uploaded weights, each against the settings of the
# run's other flags (name: the module or class and attribute, and the value to try); "baseline" re-times those
AB_SWITCHES: dict[str, tuple[str, str, Any]] = {
    "kd-two-pass": ("gpu.ops.kd", "ONE_PASS", False),
    # the head's tensor-core products decoding its quantized vocab chunks as they stage them, not once to f16
    "kd-staged-chunk": ("gpu.ops.kd", "DECODED_CHUNK", False),
    # int8: the student's logits on the f16 tensor cores (the default: on the integer GEMM, --int8-head logits)
    "int8-logits-off": ("gpu.ops.head", "INT8_STUDENT_LOGITS", False),
    # int8: the one-pass backward's P . W on the f16 tensor cores (the default: on the integer GEMM from stochastic
    # 8-bit probabilities; --int8-head logits)
    "int8-probs-off": ("gpu.ops.head", "INT8_STUDENT_PROBS", False),
    # int8: that P . W on the "nn" GEMM (the default: "nt" over the chunk's codes transposed)
    "head-probs-nn": ("gpu.ops.head", "PROBS_NT", False),
    # int8: LoRA's t = x A^T from f32 x on lora_matmul (the default: from x's int8 codes and A's on the integer
    # MMAs, gpu/ops/lora_i8.py)
    "lora-t-f32": ("gpu.ops.lora_i8", "THIN_I8", False),
    # int8: LoRA's dt = s dY B from f32 dY on lora_matmul (the default: from the input gradient's dY codes and
    # B / sW on the integer MMAs)
    "lora-dt-f32": ("gpu.ops.lora_i8", "THIN_DT", False),
    # int8: LoRA's dB = s dY^T t from f32 dY on lora_matmul (the default: from the input gradient's dY codes and t
    # on the integer MMAs, gpu/ops/lora_db_i8.py)
    "lora-db-f32": ("gpu.ops.lora_db_i8", "THIN_DB", False),
    # int8: LoRA's dA = dt^T x from f32 x on lora_matmul (the default: from the forward's x codes, kept through the
    # block's backward, on the integer MMAs, gpu/ops/lora_da_i8.py)
    "lora-da-f32": ("gpu.ops.lora_da_i8", "THIN_DA", False),
    # int8: the norms' and the gated unit's f32 outputs written where only their codes are read (the default: not)
    "inputs-f32": ("gpu.ops.quantize_i8", "CODES_ALONE", False),
    "attention-forward4": ("gpu.ops.attention_tc", "FORWARD_SUBGROUPS", 4),
    # the forward at head dim 64 on 4 subgroups (key tiles of 64), or on 8 (key tiles of 32); 8 at 128 either way
    "attention-forward4-d64": ("gpu.ops.attention_tc", "WIDE_FORWARD_HEAD_DIMS", (128,)),
    "attention-forward8-d64": ("gpu.ops.attention_tc", "WIDE_FORWARD_HEAD_DIMS", (64, 128)),
    "attention-sequential": ("gpu.ops.attention_tc", "PAIRED_BACKWARD", False),
    # the attention backward's dQ pass recomputing S, P and dP (the default: dQ from the dS the dK/dV pass stores)
    "attention-dq-pass": ("gpu.ops.attention_tc", "DQ_FROM_DS", False),
    # each subgroup skips the products of the blocks the causal mask zeroes whole (bitwise the same results)
    "attention-skip-masked": ("gpu.ops.attention_tc", "SKIP_MASKED", True),
    # the forward's subgroups each moving their own reference max, the flags exchanged after P (a barrier pair less)
    "attention-one-flag": ("gpu.ops.attention_tc", "ONE_FLAG", True),
    "lora-dual": ("gpu.ops.lora_dual", "DUAL", True),
    "lora-fast-paths": ("gpu.ops.lora_matmul", "FAST_PATHS", True),
    # lora_gemm's reduction split over more workgroups (pick_splits' target, default 1024) or shorter chunks
    "lora-wg-2048": ("gpu.ops.lora_matmul", "TARGET_WORKGROUPS", 2048),
    "lora-wg-4096": ("gpu.ops.lora_matmul", "TARGET_WORKGROUPS", 4096),
    "lora-chunk-64": ("gpu.ops.lora_matmul", "MIN_CHUNK", 64),
    "unit-rows-off": ("gpu.ops.quantize_i8", "UNIT_ROWS", False),
    # the RMSNorm backward on its scalar kernel (the row read twice) instead of rmsnorm_backward4's vec4s
    "norm-backward-scalar": ("gpu.ops.rmsnorm", "VEC4_BACKWARD", False),
    # the accumulating GEMMs' reads of C as each value is written (a read-modify-write), not two groups ahead
    "old-reads-late": ("gpu.ops.matmul_i8", "I8_TILE", replace(I8_TILE, old_ahead=0)),
    # the integer GEMM's tile 128 x 256 (2 x 4 subgroups of 4 x 4) instead of 256 x 128 (+2 % alone at 4096^3, H100)
    "i8-tile-2x4": ("gpu.ops.matmul_i8", "I8_TILE", replace(I8_TILE, sg_m=2, sg_n=4)),
    # plain products (the teacher's, the KD head's logits) on the preset instead of PLAIN_TILE
    "i8-plain-preset": ("gpu.ops.matmul_i8", "PLAIN_TILE", None),
    # 16 subgroups of 4 x 2 (or 2 x 4) result matrices on the same tile: twice the warps to hide the staging's
    # latency, each staging half as much; the scaling scratch in the staging buffers, so the LoRA variants fit
    "i8-tile-16sg": ("gpu.ops.matmul_i8", "I8_TILE", replace(I8_TILE, sg_n=4, tn=2, cs_in_stage=True)),
    "i8-tile-16sg-2x4": ("gpu.ops.matmul_i8", "I8_TILE", replace(I8_TILE, sg_n=4, tm=2, cs_in_stage=True)),
    "cs-own": ("gpu.ops.matmul_i8", "I8_TILE", replace(I8_TILE, cs_in_stage=False)),
    # narrow products (the preset's grid under NARROW_WORKGROUPS workgroups, or filling under NARROW_FILL of its
    # waves) on NARROW_TILE or not; the tile switches pick another narrow tile
    "i8-narrow-off": ("gpu.ops.matmul_i8", "NARROW_WORKGROUPS", 0),
    "i8-narrow-on": ("gpu.ops.matmul_i8", "NARROW_WORKGROUPS", 100),
    "i8-narrow-256x64": ("gpu.ops.matmul_i8", "NARROW_TILE", replace(I8_TILE, tn=2)),
    "i8-narrow-128x128": ("gpu.ops.matmul_i8", "NARROW_TILE", replace(I8_TILE, sg_m=2, sg_n=2)),
    "i8-narrow-below-200": ("gpu.ops.matmul_i8", "NARROW_WORKGROUPS", 200),
    "i8-narrow-fill-off": ("gpu.ops.matmul_i8", "NARROW_FILL", 0.0),
    "row-wg-256": ("gpu.ops.quantize_i8", "SHORT_ROW_WORKGROUP", 256),
    # the input gradients' quantizer (dY times W's row scales): 4 rows a workgroup, the scales read once for them
    "quantize-rows-4": ("gpu.ops.quantize_i8", "SCALED_ROWS_PER_WORKGROUP", 4),
    "fused-codes-off": ("gpu.model:GPUModel", "fused_codes_i8", False),
    # the block's residual adds as passes of their own (the default: in the o and down projections' epilogues)
    "residual-pass": ("gpu.model:GPUModel", "residual_in_gemm_i8", False),
    "lora-epilogue-off": ("gpu.model:GPUModel", "lora_in_gemm_i8", False),
    # the epilogues' LoRA operands packed per GEMM (lora_term) instead of from the parameters' f16 mirrors
    "lora-mirrors-off": ("gpu.ops.lora_mirror", "MIRRORS", False),
    "lora-per-projection": ("gpu.model:GPUModel", "shared_lora_inputs", False),
    "fused-grad-codes": ("gpu.student:GPUStudent", "fused_grad_codes_i8", True),
    # the gated unit's backward, then the gate and up dY quantizers (the default: one pass, glu_back_i8)
    "glu-grad-codes-off": ("gpu.student:GPUStudent", "glu_grad_codes_i8", False),
    # ... and it turning the down projection's rotated input gradient back as it reads it (no rotation pass over ds)
    "glu-turns-back": ("gpu.student:GPUStudent", "glu_turns_back", True),
    "norm-turns-back": ("gpu.student:GPUStudent", "norm_turns_back", True),
    "rope-pass": ("gpu.model:GPUModel", "rope_in_pack", False),
}


def _switch(name: str, value: Any = None) -> Any:
    """Set AB_SWITCHES[name] to its value to try (or to `value`); returns the value it had."""
    import importlib

    where, attr, trial = AB_SWITCHES[name]
    module, _, cls = where.partition(":")
    owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
    old = getattr(owner, attr)
    setattr(owner, attr, trial if value is None else value)
    return old


def bench_ours(args: argparse.Namespace) -> None:
    from gpu.device import Device
    from gpu.model import ModelWeights
    from gpu.profile import Profiler
    from gpu.teacher import GPUTeacher

    dev = Device(args.backend)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    if args.gguf:
        weights = ModelWeights.from_gguf(dev, args.gguf)
    else:
        cfg = SHAPES[args.shape]
        weights = ModelWeights.upload(dev, cfg, random_tensors(cfg, Q[args.quant], rng))
    cfg = weights.cfg
    emit(what="upload", side="ours", seconds=round(time.perf_counter() - t0, 2), weight_bytes=weights.nbytes)
    b, t, k = args.batch, args.seq, args.top_k
    st, ids = kd_student(dev, weights, args, rng)
    losses: list[float] = []

    def step() -> None:
        losses.append(st.train_step(lr=args.lr).loss)  # reads the step's stats back: synchronous

    secs = windows(step, args.steps, args.repeats, lambda: None)
    emit(
        what="train_step",
        side="ours",
        impl="distillery",
        precision=st.precision,
        switches=args.switch,
        backend=dev.backend,
        adapter=dev.adapter.summary,
        **_step_row(args, secs, losses),
        applied_steps=st.applied_steps,
        skipped_steps=st.skipped_steps,
        own_peak_bytes=dev.peak_bytes,
        kept_blocks=st.kept_blocks,
        kept_bytes=st.kept_blocks * st.kept_block_bytes(),
        resident_codes=st.resident_codes,
        device_memory_bytes=dev.memory_bytes(),
    )
    if args.profile:
        with Profiler(dev, by_grid=args.profile_grids) as prof:
            for _ in range(args.profile_steps):
                st.train_step(lr=args.lr)
        top = 300 if args.profile_grids else 60
        emit(what="profile", side="ours", of="train_step", **prof.summary(args.profile_steps, top=top))
    st = None  # frees the student's buffers before the next's (its objective refers back to it: a cycle)
    gc.collect()
    for name in [n for n in args.ab.split(",") if n]:
        parts = [] if name == "baseline" else name.split("+")  # "a+b": both switches flipped at once
        olds = [(part, _switch(part)) for part in parts]
        try:
            ab, _ = kd_student(dev, weights, args, rng)
            ab_losses: list[float] = []

            def ab_step(ab: Any = ab, out: list[float] = ab_losses) -> None:
                out.append(ab.train_step(lr=args.lr).loss)

            secs = windows(ab_step, args.steps, args.repeats, lambda: None)
            emit(what="train_step_ab", side="ours", variant=name, **_step_row(args, secs, ab_losses))
            ab = None
            gc.collect()
            if not args.no_teacher:  # the teacher's top-k under the same switches
                ab_teacher = GPUTeacher(dev, weights, batch=b, seq_len=t, top_k=k, tau=1.0, precision=args.precision,
                                        int8_codes=args.teacher_codes)  # fmt: skip
                secs = windows(partial(ab_teacher.topk, ids), args.steps, args.repeats, lambda: None)
                emit(what="teacher_topk_ab", side="ours", variant=name, **throughput(b * t, secs))
                ab_teacher = None
        finally:
            for part, old in reversed(olds):
                _switch(part, old)
            ab = None
            gc.collect()
    if args.no_teacher:
        _emit_own_memory(dev)
        return
    teacher = GPUTeacher(
        dev, weights, batch=b, seq_len=t, top_k=k, tau=1.0, precision=args.precision, int8_codes=args.teacher_codes
    )
    secs = windows(lambda: teacher.topk(ids), args.steps, args.repeats, lambda: None)
    row = {"precision": args.precision, "resident_codes": teacher.resident_codes, **throughput(b * t, secs)}
    emit(what="teacher_topk", side="ours", impl="distillery", **row)
    if args.profile:
        with Profiler(dev) as prof:
            teacher.topk(ids)
        emit(what="profile", side="ours", of="teacher_topk", **prof.summary(1, top=30))
    _emit_own_memory(dev)


def _emit_own_memory(dev: Any) -> None:
    """Our peak buffer bytes and the 24 largest labels' share of it."""
    top = sorted(dev.peak_by_label.items(), key=lambda kv: -kv[1])[:24]
    emit(what="own_memory", side="ours", own_peak_bytes=dev.peak_bytes, peak_by_label=dict(top))


def _step_row(args: argparse.Namespace, secs: list[float], losses: list[float]) -> dict[str, Any]:
    """The fields every side's train_step row reports: the model and batch shape, the speed, the losses."""
    b, t = args.batch, args.seq
    return {
        "model": _model_name(args),
        "batch": b,
        "seq": t,
        "rank": args.rank,
        "top_k": args.top_k,
        **throughput(b * t, secs),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": [round(x, 5) for x in losses],
    }


def _model_name(args: argparse.Namespace) -> str:
    return Path(args.gguf).name if args.gguf else f"{args.shape} (random {args.quant})"


# ---- HF transformers + PEFT ---------------------------------------------------------------------------------
def bench_torch(args: argparse.Namespace, dtype_name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "qlora": torch.bfloat16}[dtype_name]
    t0 = time.perf_counter()
    model = _hf_qlora_model(args) if dtype_name == "qlora" else _hf_model(args, dtype)
    cfg = model.config
    emit(what="upload", side=f"hf-{dtype_name}", seconds=round(time.perf_counter() - t0, 2))
    b, t, k = args.batch, args.seq, args.top_k
    torch.cuda.reset_peak_memory_stats()
    if args.hf_checkpointing == "on":
        model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(
        model,
        LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    rng = np.random.default_rng(0)
    ids_np, tids_np = _teacher_batch(cfg.vocab_size, b, t, k, rng)
    ids = torch.from_numpy(ids_np).to("cuda")
    tids = torch.from_numpy(tids_np).to("cuda")
    tp = torch.full((b, t, k), 0.9 / k, device="cuda")
    tail = 0.1
    losses: list[float] = []

    def step() -> None:
        logits = model(input_ids=ids).logits.float()
        logq = torch.log_softmax(logits, -1)
        q_top = logq.gather(-1, tids)
        q_tail = torch.log1p(-q_top.exp().sum(-1).clamp(max=1 - 1e-6))
        loss = ((tp * (tp.log() - q_top)).sum(-1) + tail * (np.log(tail) - q_tail)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    secs = windows(step, args.steps, args.repeats, torch.cuda.synchronize)
    emit(
        what="train_step",
        side=f"hf-{dtype_name}",
        impl="hf+peft",
        dtype=str(dtype),
        **_step_row(args, secs, losses),
        own_peak_bytes=torch.cuda.max_memory_allocated(),
        gradient_checkpointing=args.hf_checkpointing == "on",
    )
    if args.no_teacher or f"hf-{dtype_name}" not in args.teacher_sides.split(","):
        return
    base = model.get_base_model()

    @torch.no_grad()
    def teacher() -> None:
        logits = base(input_ids=ids).logits.float()
        torch.topk(torch.log_softmax(logits, -1), k, dim=-1)

    secs = windows(teacher, args.steps, args.repeats, torch.cuda.synchronize)
    emit(
        what="teacher_topk", side=f"hf-{dtype_name}", impl="hf+torch.topk", dtype=str(dtype), **throughput(b * t, secs)
    )
    emit(what="own_memory", side=f"hf-{dtype_name}", own_peak_bytes=torch.cuda.max_memory_allocated())


def _hf_config(cfg: Any) -> Any:
    """The HF LlamaConfig of a random shape (model.config.ModelConfig)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **cfg.hf_shape(),
        max_position_embeddings=cfg.context_length,
        rope_theta=cfg.rope_base,
        initializer_range=INIT_STD,
    )


def _hf_model(args: argparse.Namespace, dtype: Any, device: str = "cuda") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if args.gguf:  # dequantized by transformers once, kept as float32 safetensors for the next side's process
        path = Path(args.gguf).resolve()
        st = path.stat()
        cache = Path(args.hf_cache) / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"
        if not (cache / "model.safetensors").is_file():
            from safetensors.torch import save_model

            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            cache.mkdir(parents=True, exist_ok=True)  # save_pretrained refuses gguf-loaded models
            model.config.save_pretrained(str(cache))
            save_model(model, str(cache / "model.safetensors"))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(cache), dtype=torch.float32)
        return model.to(device, dtype)
    hf = _hf_config(SHAPES[args.shape])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the target dtype (an 8B model in f32 is 32 GB)
    try:
        with torch.device(device):
            return LlamaForCausalLM(hf)
    finally:
        torch.set_default_dtype(default)


def _hf_qlora_model(args: argparse.Namespace) -> Any:
    """QLoRA's base model: every decoder-layer Linear as bitsandbytes NF4 with double quantization (blocks of 64,
    the absmax constants quantized again), bf16 compute; embeddings, norms and the head bf16. A random model is
    built on the meta device and made real on the GPU one decoder layer at a time (drawn there in bf16, its
    projections quantized, the bf16 freed), so neither the host nor the GPU ever holds the whole bf16 model (an 8B
    model drawn on the host took minutes); a GGUF is loaded in bf16 on the host and quantized as it moves. peft's
    prepare_model_for_kbit_training is not applied: it would upcast the embeddings and the head to fp32."""
    import bitsandbytes as bnb
    import torch

    def quantized(lin: Any) -> Any:
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=torch.bfloat16,
            compress_statistics=True,
            quant_type="nf4",
        )
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4")
        return q.to("cuda")

    if args.gguf:
        model = _hf_model(args, torch.bfloat16, device="cpu")
    else:
        model = _hf_meta_model(args, torch.bfloat16)
        _materialize(model.model.embed_tokens, model.model.norm, model.lm_head, device="cuda")
    for layer in model.model.layers:
        if not args.gguf:
            _materialize(layer, device="cuda")
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, torch.nn.Linear):
                    setattr(parent, name, quantized(lin))
    model = model.to("cuda")
    torch.cuda.empty_cache()
    return model


def _hf_meta_model(args: argparse.Namespace, dtype: Any, device: str = "cuda") -> Any:
    """The random shape's HF model on the meta device (no memory), its rotary embedding real on `device`."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config(SHAPES[args.shape])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(hf)
        with torch.device(device):  # its inv_freq is computed, not a parameter: made where it is used
            model.model.rotary_emb = LlamaRotaryEmbedding(config=hf)
    finally:
        torch.set_default_dtype(default)
    return model


def _materialize(*modules: Any, device: str) -> None:
    """Give meta modules real storage on `device` with HF Llama's initialisation: RMSNorm weights one, every
    other weight normal(0, INIT_STD)."""
    import torch

    for module in modules:
        module.to_empty(device=device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("norm.weight") or name == "weight" and "Norm" in type(module).__name__:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, INIT_STD)


# ---- one process per side, memory sampled from here ------------------------------------------------------------
def run_sides(args: argparse.Namespace, argv: list[str]) -> None:
    from bench.gpu_memory import run_child

    wanted = args.sides.split(",")
    if unknown := set(wanted) - set(SIDES):
        raise SystemExit(f"bench/train_step.py --sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")
    sides = [
        s for s in SIDES if s in wanted and not (s == "ours" and args.no_ours) and not (s != "ours" and args.no_torch)
    ]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for side in sides:

        def on_line(line: str, poller: Any, side: str = side) -> None:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                print(line, flush=True)
                return
            if row.get("what") in ("upload", "train_step", "teacher_topk", "own_memory"):
                # process peak so far (upload, then training, then the teacher)
                row["gpu_mem_peak_bytes"] = poller.peak_bytes()
                row["gpu_mem_how"] = poller.how
            rows[(side, row.get("what", ""))] = row
            print(json.dumps(row), flush=True)

        rc = run_child([sys.executable, str(Path(__file__).resolve()), *argv, "--side", side], on_line)
        if rc != 0:
            emit(what="error", side=side, returncode=rc)
    emit(what="summary", **summarize(rows))


def summarize(rows: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """Ours against each HF side: tokens/s ratios (median windows) and whole-process memory ratios."""
    out: dict[str, Any] = {}
    ours = rows.get(("ours", "train_step"))
    for side in SIDES[1:]:
        for what in ("train_step", "teacher_topk"):
            a, b = rows.get(("ours", what)), rows.get((side, what))
            if a and b:
                out[f"{what}_ours_over_{side}"] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
        theirs = rows.get((side, "train_step"))
        if ours and theirs and ours.get("gpu_mem_peak_bytes") and theirs.get("gpu_mem_peak_bytes"):
            out[f"train_gpu_mem_ours_over_{side}"] = round(ours["gpu_mem_peak_bytes"] / theirs["gpu_mem_peak_bytes"], 3)
    if ours:
        out["ours_loss_finite_and_decreasing"] = bool(
            np.isfinite(ours["loss_last"]) and ours["loss_last"] < ours["loss_first"]
        )
        out["ours_skipped_steps"] = ours["skipped_steps"]
    return out


# the string-valued switches of main(): (flag, choices, default, help)
_CHOICES = (
    (
        "--int8-head",
        ("on", "logits", "probs", "off"),
        "probs",
        "int8: the student's LM head on the integer GEMM (probs, the engine's default: its logits and the one-pass "
        "backward's P . W, from stochastically rounded probabilities; logits: its logits only, the backward on f16; "
        "on: both, the two-pass backward's dlogits rounded to nearest; off: neither)",
    ),
    ("--int8-teacher-head", ("on", "off"), "on", "int8: the teacher's LM head on integer GEMMs"),
    (
        "--int8-lora-epilogue",
        ("on", "off"),
        "on",
        "int8: the LoRA terms (forward s t B^T, backward dt A) in the integer GEMMs' epilogues, the engine's default "
        "(off: passes of their own)",
    ),
    (
        "--int8-rotation",
        ("on", "off"),
        "on",
        "int8: both GEMM operands rotated in Walsh-Hadamard blocks along the inputs (off: plain per-row scales)",
    ),
    (
        "--kd-one-pass",
        ("on", "off"),
        "on",
        "the KD head's backward in one pass over the logits, the engine's default (off: two, computing them twice)",
    ),
    (
        "--int8-fused-codes",
        ("on", "off"),
        "on",
        "int8: the RMSNorms and the gated unit write their outputs' int8 codes in the same pass, the engine's default "
        "(off: the quantizer reads them back; the backward's: --ab fused-grad-codes)",
    ),
    (
        "--int8-input-grads",
        ("transposed", "nn", "f16"),
        "transposed",
        "int8: the input gradients on the forward's GEMM over W's transposed codes, the 'nn' GEMM, or f16",
    ),
    (
        "--hf-checkpointing",
        ("on", "off"),
        "on",
        "HF sides: gradient checkpointing (on: each block recomputed in the backward, as ours at --kept-blocks 0)",
    ),
    (
        "--int8-codes",
        INT8_CODES,
        "per_block",
        "ours, int8: the student's projections decoded once and kept (resident), one block's at a time whenever a "
        "pass needs them (per_block: the least memory), or resident where they fit (auto, as train.int8_codes)",
    ),
    ("--teacher-codes", INT8_CODES, "auto", "ours, int8: --int8-codes for the teacher (auto: as a run)"),
    (
        "--lora-dual",
        ("on", "off"),
        "off",
        "our LoRA backward's dB and dt in one pass over dY (gpu/ops/lora_dual.py, rank 16; off: two lora_matmul)",
    ),
    (
        "--lora-path",
        ("default", "fused", "split"),
        "default",
        "our LoRA products: gpu/ops/lora.py's FUSED default, or forced fused / split (an A/B of the two)",
    ),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--gguf", default=None, help="a real student GGUF instead of --shape's random weights")
    p.add_argument("--quant", default="Q4_K", help="projection type of the random weights")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="steps per timing window")
    p.add_argument("--repeats", type=int, default=3, help="timing windows (the median is reported)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--backend", default=None, help="wgpu or dawn (default: auto)")
    p.add_argument("--precision", default="f32", help="f32, tensorcore, int8 (integer GEMMs) or auto")
    for flag, choices, default, text in _CHOICES:
        p.add_argument(flag, choices=choices, default=default, help=text)
    p.add_argument(
        "--int8-row-wg",
        type=int,
        choices=(64, 256),
        default=None,
        help="int8: invocations a row of the quantizer and Q4_K decode for rows of <= 4096 (default: the engine's)",
    )
    p.add_argument(
        "--attention-forward-subgroups",
        type=int,
        choices=(4, 8),
        default=None,
        help="tensor cores, head dim 128: subgroups a workgroup of the attention forward (gpu/ops/attention_tc.py; "
        "default: the engine's)",
    )
    p.add_argument(
        "--attention-paired-backward",
        choices=("on", "off"),
        default=None,
        help="tensor cores: the attention backward with S and dP side by side (gpu/ops/attention_tc.py; default: the "
        "engine's)",
    )
    p.add_argument(
        "--kept-blocks",
        default="0",
        help="ours: blocks whose intermediates the forward keeps for the backward instead of recomputing them (a "
        "number, or auto: as many as fit, as train.kept_blocks); 0 recomputes every block, like --hf-checkpointing on",
    )
    p.add_argument(
        "--ab",
        default="",
        help="ours: after the main timing, time the step again with each of these switches flipped, one at a time, "
        "on the same weights (comma-separated; a+b flips both at once; baseline re-times the run's own settings): "
        f"{', '.join(AB_SWITCHES)}",
    )
    p.add_argument(
        "--switch",
        default="",
        help="ours: switches of --ab flipped for the whole run, a+b for several (a change timed against the peers "
        "before it becomes the default)",
    )
    p.add_argument("--profile", action="store_true", help="per-kernel-class GPU time of our step (timestamps)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument(
        "--profile-grids",
        action="store_true",
        help="with --profile: each kernel's calls split by their workgroup grid (by shape), the 300 slowest listed",
    )
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-ours", action="store_true")
    p.add_argument("--no-teacher", action="store_true")
    p.add_argument("--teacher-sides", default=",".join(SIDES), help="sides that also time the teacher top-k")
    p.add_argument("--hf-cache", default="/tmp/distillery-hf", help="where --gguf's HF float32 copy is kept")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides to run (default: all)")
    p.add_argument("--side", choices=SIDES, default=None, help="run one side in this process (internal)")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.gguf and not Path(args.gguf).is_file():
        p.error(f"--gguf {args.gguf}: no such file")
    if args.kept_blocks != "auto" and not args.kept_blocks.isdigit():
        p.error(f"--kept-blocks {args.kept_blocks}: expected a number of blocks >= 0 or auto")
    named = {part for n in args.ab.split(",") if n and n != "baseline" for part in n.split("+")}
    if unknown := named - set(AB_SWITCHES):
        p.error(f"--ab {','.join(sorted(unknown))}: expected some of baseline, {', '.join(AB_SWITCHES)}")
    if unknown := {n for n in args.switch.split("+") if n} - set(AB_SWITCHES):
        p.error(f"--switch {'+'.join(sorted(unknown))}: expected some of {', '.join(AB_SWITCHES)}")
    if args.side == "ours":
        from gpu.ops import head

        head.INT8_HEAD = args.int8_teacher_head == "on"
        head.INT8_STUDENT_HEAD = args.int8_head == "on"
        head.INT8_STUDENT_LOGITS = args.int8_head in ("logits", "probs")
        head.INT8_STUDENT_PROBS = args.int8_head == "probs"
        from gpu.model import GPUModel
        from gpu.student import GPUStudent

        GPUModel.lora_in_gemm_i8 = args.int8_lora_epilogue == "on"
        if args.int8_row_wg:
            from gpu.ops import quantize_i8

            quantize_i8.SHORT_ROW_WORKGROUP = args.int8_row_wg
        GPUModel.int8_rotation = args.int8_rotation == "on"
        GPUModel.fused_codes_i8 = args.int8_fused_codes == "on"
        from gpu.ops import attention_tc

        if args.attention_forward_subgroups:
            attention_tc.FORWARD_SUBGROUPS = args.attention_forward_subgroups
        if args.attention_paired_backward:
            attention_tc.PAIRED_BACKWARD = args.attention_paired_backward == "on"
        from gpu.ops import kd

        kd.ONE_PASS = args.kd_one_pass == "on"
        GPUStudent.int8_input_grads = args.int8_input_grads != "f16"
        GPUStudent.transposed_input_grads = args.int8_input_grads == "transposed"
        from gpu.ops import lora_dual

        lora_dual.DUAL = args.lora_dual == "on"
        if args.lora_path != "default":
            from gpu.ops import lora

            lora.FUSED = args.lora_path == "fused"
        for name in [n for n in args.switch.split("+") if n]:
            _switch(name)
        bench_ours(args)
    elif args.side is not None:
        bench_torch(args, args.side.removeprefix("hf-"))
    else:
        try:
            run_sides(args, argv)
        except (OSError, subprocess.SubprocessError) as exc:
            sys.exit(f"bench/train_step.py: {exc}")


if __name__ == "__main__":
    main()
