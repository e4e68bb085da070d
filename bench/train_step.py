"""LoRA-KD train step and teacher top-k throughput, ours (wgpu) next to HF transformers + PEFT (torch), as JSON.

    python bench/train_step.py --shape tinyllama --batch 4 --seq 1024        # the H200 benchmark of docs/benchmarks.md
    python bench/train_step.py --shape smollm2 --batch 1 --seq 128 --no-torch # lavapipe: the demo's number

Shapes use random weights: projections as random GGML blocks of --quant (Q4_K), norms 1, lm_head random.
Loss: forward KL over the teacher's top-k (k=--top-k) with a random teacher. One line of JSON per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402

from model.config import LORA_TARGETS, ModelConfig  # noqa: E402

SHAPES = {
    "tinyllama": ModelConfig(
        n_layers=22,
        hidden=2048,
        ffn=5632,
        n_heads=32,
        n_kv_heads=4,
        vocab=32000,
        context_length=2048,
        tied_embeddings=False,
    ),
    "smollm2": ModelConfig(
        n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3, vocab=49152, context_length=8192, rope_base=1e5
    ),
    "tiny": ModelConfig(n_layers=2, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, vocab=1000, context_length=256),
}


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def random_tensors(cfg: ModelConfig, qtype: int, rng: np.random.Generator):
    from gpu.weights import random_blocks

    yield (
        "token_embd.weight",
        rng.standard_normal((cfg.vocab, cfg.hidden), np.float32) * 0.02,
        Q.F32,
        (cfg.vocab, cfg.hidden),
    )
    if not cfg.tied_embeddings:
        w = random_blocks(Q.Q6_K, (cfg.vocab, cfg.hidden), rng)
        yield "output.weight", w, Q.Q6_K, (cfg.vocab, cfg.hidden)
    yield "output_norm.weight", np.ones(cfg.hidden, np.float32), Q.F32, (cfg.hidden,)
    for i in range(cfg.n_layers):
        for norm in ("attn_norm", "ffn_norm"):
            yield f"blk.{i}.{norm}.weight", np.ones(cfg.hidden, np.float32), Q.F32, (cfg.hidden,)
        for t, stem in LORA_TARGETS.items():
            shape = cfg.target_shape(t)
            yield f"blk.{i}.{stem}.weight", random_blocks(qtype, shape, rng), qtype, shape


def bench_ours(cfg: ModelConfig, args: argparse.Namespace) -> None:
    from gpu.device import Device
    from gpu.model import StudentWeights
    from gpu.student import GPUStudent
    from gpu.teacher import GPUTeacher
    from model import reference
    from model.kd import LossConfig

    dev = Device(args.backend)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    weights = StudentWeights.upload(dev, cfg, random_tensors(cfg, Q[args.quant], rng))
    emit(what="upload", seconds=round(time.perf_counter() - t0, 2), weight_bytes=weights.nbytes)
    b, t, k = args.batch, args.seq, args.top_k
    st = GPUStudent(
        dev,
        weights,
        targets=LORA_TARGETS,
        r=args.rank,
        alpha=2 * args.rank,
        batch=b,
        seq_len=t,
        top_k=k,
        loss=LossConfig("forward_kl", tau=1.0, use_tail=True),
        precision=args.precision,
    )
    st.set_adapter(reference.init_lora(cfg, list(LORA_TARGETS), args.rank, seed=0))
    ids = rng.integers(0, cfg.vocab, (b, t))
    tids = np.stack([rng.permutation(cfg.vocab)[:k] for _ in range(b * t)]).reshape(b, t, k)
    tlp = np.log(np.full((b, t, k), 0.9 / k, np.float32))
    st.write_batch(ids, np.roll(ids, -1, 1), np.ones((b, t)), tids, tlp, np.full((b, t), 0.1, np.float32))
    st.train_step(lr=1e-4)  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        stats = st.train_step(lr=1e-4)
    dt = (time.perf_counter() - t0) / args.steps
    emit(
        what="train_step",
        impl="distillery",
        precision=st.precision,
        backend=dev.backend,
        adapter=dev.adapter.summary,
        shape=args.shape,
        quant=args.quant,
        batch=b,
        seq=t,
        rank=args.rank,
        top_k=k,
        seconds_per_step=round(dt, 4),
        tokens_per_s=round(b * t / dt, 1),
        loss=stats.loss,
        peak_gpu_bytes=dev.peak_bytes,
    )
    del st
    teacher = GPUTeacher(dev, weights, batch=b, seq_len=t, top_k=k, tau=1.0, precision=args.precision)
    teacher.topk(ids)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        teacher.topk(ids)
    dt = (time.perf_counter() - t0) / args.steps
    emit(
        what="teacher_topk",
        impl="distillery",
        precision=args.precision,
        shape=args.shape,
        quant=args.quant,
        batch=b,
        seq=t,
        top_k=k,
        tokens_per_s=round(b * t / dt, 1),
    )


def bench_torch(cfg: ModelConfig, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.context_length,
        tie_word_embeddings=cfg.tied_embeddings,
        rope_theta=cfg.rope_base,
    )
    for dtype in (torch.float32, torch.bfloat16):
        _torch_one(hf, dtype, args)
        torch.cuda.empty_cache()


def _cuda_seconds(fn: object, steps: int) -> float:
    """Seconds per call of fn after one warm-up call, CUDA-synchronised."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _torch_one(hf: object, dtype: object, args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = SHAPES[args.shape]
    b, t, k = args.batch, args.seq, args.top_k
    torch.cuda.reset_peak_memory_stats()
    model = LlamaForCausalLM(hf).to("cuda", dtype)
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
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab, (b, t), device="cuda")
    tids = torch.randint(0, cfg.vocab, (b, t, k), device="cuda")
    tp = torch.full((b, t, k), 1.0 / k, device="cuda")

    def step() -> float:
        logits = model(input_ids=ids).logits.float()
        logq = torch.log_softmax(logits, -1).gather(-1, tids)
        loss = (tp * (tp.log() - logq)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    dt = _cuda_seconds(step, args.steps)
    emit(
        what="train_step",
        impl="hf+peft",
        dtype=str(dtype),
        shape=args.shape,
        batch=b,
        seq=t,
        rank=args.rank,
        top_k=k,
        tokens_per_s=round(b * t / dt, 1),
        peak_gpu_bytes=torch.cuda.max_memory_allocated(),
    )
    with torch.no_grad():
        base = model.get_base_model()

        def teacher() -> None:
            logits = base(input_ids=ids).logits.float()
            torch.topk(torch.log_softmax(logits, -1), k, dim=-1)

        dt = _cuda_seconds(teacher, args.steps)
    emit(
        what="teacher_topk",
        impl="hf+torch.topk",
        dtype=str(dtype),
        shape=args.shape,
        batch=b,
        seq=t,
        top_k=k,
        tokens_per_s=round(b * t / dt, 1),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--quant", default="Q4_K")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default=None, help="wgpu or dawn (default: auto)")
    p.add_argument("--precision", default="f32", help="f32, tensorcore or auto")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-ours", action="store_true")
    args = p.parse_args()
    cfg = SHAPES[args.shape]
    if not args.no_ours:
        bench_ours(cfg, args)
    if not args.no_torch:
        bench_torch(cfg, args)


if __name__ == "__main__":
    main()
