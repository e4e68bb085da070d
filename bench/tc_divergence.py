"""Which tensor-core component moves a real student's residual stream away from the f32 path? Per block, the
max relative difference to the f32 GPU forward (the oracle: on lavapipe it gives HF's loss to 7 digits) of
(a) the tensor-core precision as shipped, (b) tensor-core GEMMs with f32 attention, (c) f32 GEMMs with
tensor-core attention. JSON lines. Needs Dawn subgroup matrices (H200), or --emulate on any adapter (slow).

    python bench/tc_divergence.py --gguf FILE --batch 4 --seq 1024 --layers 1,4,12,30
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from bench.train_step import _teacher_batch
    from gpu.device import Device
    from gpu.model import GPUModel, ModelWeights
    from gpu.ops.attention import attention_forward
    from gpu.ops.matmul import linear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", default="1,4,12,30")
    p.add_argument("--emulate", action="store_true", help="emulated tensor-core kernels (any adapter)")
    args = p.parse_args()
    dev = Device()
    w = ModelWeights.from_gguf(dev, args.gguf)
    b, t = args.batch, args.seq
    ids = _teacher_batch(w.cfg.vocab, b, t, 8, np.random.default_rng(0))[0]
    ref = GPUModel(dev, w, batch=b, seq_len=t, precision="f32")
    variants = {}
    if args.emulate:
        from gpu.ops.attention_tc import attention_forward_tc
        from gpu.ops.matmul_tc import linear_tc

        tc_linear = functools.partial(linear_tc, emulate=True)
        tc_attention = functools.partial(attention_forward_tc, emulate=True)
        shipped = GPUModel(dev, w, batch=b, seq_len=t, precision="f32")
        shipped._linear, shipped._attention_fwd = tc_linear, tc_attention
    else:
        shipped = GPUModel(dev, w, batch=b, seq_len=t, precision="tensorcore")
        tc_linear, tc_attention = shipped._linear, getattr(shipped, "_attention_fwd", attention_forward)
    variants["tensorcore as shipped"] = shipped
    gemm_only = GPUModel(dev, w, batch=b, seq_len=t, precision="f32")
    gemm_only._linear, gemm_only._attention_fwd = tc_linear, attention_forward
    variants["tc gemm, f32 attention"] = gemm_only
    attention_only = GPUModel(dev, w, batch=b, seq_len=t, precision="f32")
    attention_only._linear, attention_only._attention_fwd = linear, tc_attention
    variants["f32 gemm, tc attention"] = attention_only
    for layer in (int(x) for x in args.layers.split(",")):
        want = ref.residual_stream(ids, layer)
        scale = float(np.abs(want).max())
        row = {"what": "divergence", "block_input": layer, "batch": b, "seq": t, "max_abs_f32": scale}
        for name, model in variants.items():
            got = model.residual_stream(ids, layer)
            diff = np.abs(got - want)
            row[name] = float(np.nanmax(diff) / scale) if np.isfinite(got).all() else "non-finite"
            row[f"{name}: worst token"] = int(np.nanargmax(diff.max(-1).reshape(-1)))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
