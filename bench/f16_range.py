"""Where would f16 overflow? One f32 training step of a real student, reporting per block the largest |value| of
every operand the tensor-core path rounds to f16 (the A operand of each frozen-projection GEMM: forward inputs,
and dY of the input-gradient GEMMs), and how many values exceed f16's max (65504) or fall below its normal
range (6.1e-5, nonzero). JSON lines; the f32 path is the oracle, so the numbers say what the tensor-core path
would see.

    python bench/f16_range.py --gguf runs/demo/student/<key>/student.gguf --batch 1 --seq 256
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

F16_MAX = 65504.0
F16_MIN_NORMAL = 6.103515625e-05


def main() -> None:
    from bench.train_step import kd_student
    from gpu.device import BufferView, Device
    from gpu.model import ModelWeights

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--precision", default="f32", help="f32 (the oracle) or tensorcore (find its first bad operand)")
    args = p.parse_args()
    dev = Device()
    weights = ModelWeights.from_gguf(dev, args.gguf)
    st, _ = kd_student(dev, weights, args, np.random.default_rng(0))
    stats: dict[tuple[str, str], dict[str, float]] = defaultdict(
        lambda: {"max": 0.0, "over": 0, "subnormal": 0, "nonfinite": 0}
    )
    order: list[str] = []  # the first operands (in dispatch order) holding a value past f16's range
    by_weight = {id(w): key for key, w in weights.proj.items()}

    def observe(kind: str, a: Any, w: Any, m: int) -> None:
        layer, target = by_weight.get(id(w), ("head", "lm_head"))
        n_in = w.k if kind == "forward" else w.n
        view = a if isinstance(a, BufferView) else BufferView(a)
        x = np.abs(dev.read(view.buffer, np.float32, (m * n_in,), offset=view.offset))
        s = stats[(str(layer), f"{kind} {target}")]
        finite = np.isfinite(x)
        x = np.where(finite, x, 0)
        bad = int((~finite).sum()), int((x > F16_MAX).sum())
        s["nonfinite"] += bad[0]
        s["over"] += bad[1]
        s["max"] = max(s["max"], float(x.max()))
        if any(bad) and len(order) < 5:
            order.append(f"{kind} {target} of block {layer}")
        s["subnormal"] += int(((x > 0) & (x < F16_MIN_NORMAL)).sum())

    linear, linear_grad = st._linear, st._linear_grad

    def linear_watch(dev_: Any, x: Any, w: Any, y: Any, m: int, **kw: Any) -> None:
        observe("forward", x, w, m)
        linear(dev_, x, w, y, m, **kw)

    def grad_watch(dev_: Any, dy: Any, w: Any, dx: Any, m: int, **kw: Any) -> None:
        observe("dY", dy, w, m)
        linear_grad(dev_, dy, w, dx, m, **kw)

    st._linear, st._linear_grad = linear_watch, grad_watch
    loss = st.loss_and_grads()
    grads = dev.read(st.grads, np.float32, (st.layout.n_params,))
    print(
        json.dumps(
            {
                "what": "step",
                "precision": st.precision,
                "loss": loss,
                "grads_finite": bool(np.isfinite(grads).all()),
                "first_out_of_range": order,
            }
        ),
        flush=True,
    )
    for (layer, what), s in sorted(
        stats.items(), key=lambda kv: (kv[0][1], int(kv[0][0]) if kv[0][0].isdigit() else -1)
    ):
        print(json.dumps({"what": "range", "layer": layer, "operand": what, **s}), flush=True)
    worst = sorted(stats.items(), key=lambda kv: -kv[1]["max"])[:10]
    print(json.dumps({"what": "worst", "top": [[lw[0], lw[1], s["max"], s["over"]] for lw, s in worst]}), flush=True)


if __name__ == "__main__":
    main()
