"""Are the tensor-core path's loss and LoRA gradients finite, and the same on the first and the second call?

For one student (a real GGUF or a random --shape) and one batch, on one fresh device, each variant in turn
builds a GPUStudent, computes loss_and_grads twice on the same batch and reports, per call, the loss, the
number of non-finite gradient entries, the first (layer, target) holding one, and the largest difference
between the two calls' gradients (0 when the path is deterministic and has no first-use effect). Variants:
tensor cores as shipped, tensor-core GEMMs with f32 attention, f32 GEMMs with tensor-core attention, f32.
JSON lines; needs Dawn subgroup matrices (H200).

    python bench/tc_first_step.py --gguf /tmp/student.gguf --batch 4 --seq 1024
    python bench/tc_first_step.py --shape tinyllama --layers 4 --batch 4 --seq 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from gpu.objectives import GpuKd
from model.engine_spec import EngineSpec, KdBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _nonfinite(st, grads: np.ndarray) -> dict:
    bad = ~np.isfinite(grads)
    row: dict = {"nonfinite": int(bad.sum())}
    if bad.any():
        for (layer, target), pair in st.layout.unpack(grads).items():
            if not (np.isfinite(pair.A).all() and np.isfinite(pair.B).all()):
                row["first_bad_slot"] = f"{layer}.{target}"
                break
    return row


def main() -> None:
    from gguf import GGMLQuantizationType as Q

    from bench.train_step import SHAPES, _teacher_batch, random_tensors
    from gpu.device import Device
    from gpu.model import ModelWeights
    from gpu.ops.attention import attention_backward, attention_forward
    from gpu.ops.attention_tc import attention_backward_tc, attention_forward_tc
    from gpu.ops.matmul import linear, linear_input_grad
    from gpu.ops.matmul_tc import linear_input_grad_tc, linear_tc
    from gpu.student import GPUStudent
    from model import reference
    from model.config import LORA_TARGETS
    from model.kd import LossConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None)
    p.add_argument("--shape", default="tinyllama")
    p.add_argument("--layers", type=int, default=0, help="random shape: this many blocks (0: the shape's)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--variants", default="tensorcore,tc-gemm,tc-attention,f32")
    args = p.parse_args()
    dev = Device()
    rng = np.random.default_rng(0)
    if args.gguf:
        w = ModelWeights.from_gguf(dev, args.gguf)
    else:
        cfg = SHAPES[args.shape]
        if args.layers:
            cfg = dataclasses.replace(cfg, n_layers=args.layers)
        w = ModelWeights.upload(dev, cfg, random_tensors(cfg, Q.Q4_K, rng))
    cfg, b, t, k = w.cfg, args.batch, args.seq, args.top_k
    ids, tids = _teacher_batch(cfg.vocab, b, t, k, rng)
    tlp = np.log(np.full((b, t, k), 0.9 / k, np.float32))
    adapter = reference.init_lora(cfg, list(LORA_TARGETS), args.rank, seed=0)
    for pair in adapter.values():  # B != 0, so that every LoRA product carries signal
        pair.B[...] = rng.normal(0, 0.01, pair.B.shape).astype(np.float32)
    gemms = {"tc": (linear_tc, linear_input_grad_tc), "f32": (linear, linear_input_grad)}
    attns = {"tc": (attention_forward_tc, attention_backward_tc), "f32": (attention_forward, attention_backward)}
    plans = {"tensorcore": ("tc", "tc"), "tc-gemm": ("tc", "f32"), "tc-attention": ("f32", "tc"), "f32": ("f32", "f32")}
    for name in args.variants.split(","):
        gemm, attn = plans[name]
        st = GPUStudent(
            dev,
            w,
            EngineSpec(
                w.cfg, targets=LORA_TARGETS, r=args.rank, alpha=2 * args.rank, batch=b, seq_len=t, precision="f32"
            ),
            GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=True), k),
        )
        st._linear, st._linear_grad = gemms[gemm]
        st._attention_fwd, st._attention_bwd = attns[attn]
        st.set_adapter(adapter)
        st.write_batch(KdBatch(ids, np.roll(ids, -1, 1), np.ones((b, t)), tids, tlp, np.full((b, t), 0.1, np.float32)))
        calls = []
        for call in range(2):
            loss = st.loss_and_grads()
            grads = dev.read(st.grads, np.float32, (st.layout.n_params,))
            calls.append(grads)
            row = {"what": "first_step", "variant": name, "call": call, "loss": loss, **_nonfinite(st, grads)}
            row.update(n_layers=cfg.n_layers, batch=b, seq=t, grad_max=float(np.nanmax(np.abs(grads))))
            if call == 1:
                row["max_diff_vs_call0"] = float(np.nanmax(np.abs(calls[1] - calls[0])))
            print(json.dumps(row), flush=True)
        st = None


if __name__ == "__main__":
    main()
