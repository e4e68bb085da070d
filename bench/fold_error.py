"""How much of a mergeable adapter's update each way of merging keeps, per GGML type (issue 23; docs/merge.md).

Takes real weights (the demo's F32 teacher, SmolLM2-135M: runs/demo/teacher-f32.gguf) and a real mergeable adapter
(a checkpoint of `lora.kind mergeable`), stores each adapted tensor in every type the reader supports, merges
dW = s B A the ways one could, and prints JSON: per (type, way) the max and rms error against stored base + dW,
the rms error over the rms of dW (0: all of dW kept) and the bytes per weight. Ways: `fold` (model/fold.py's
policy), `requant` (W + dW re-encoded in the tensor's own type, the plain merge), and for Q4_K `mins` (dW folded
into the 6-bit sub-block mins: the offsets re-rounded to a new 6-bit grid), for Q8_0 and Q6_K `f16`.

    .venv/bin/python bench/fold_error.py --checkpoint runs/demo/train/<key>/epoch-000 [--layers 0,14,29]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from data.checkpoint import load_checkpoint
from model import quant as qc
from model.config import LORA_TARGETS
from model.fold import fold
from model.gguf import GGUFFile

TYPES = (Q.F16, Q.Q8_0, Q.Q6_K, Q.Q5_1, Q.Q5_0, Q.Q4_K, Q.Q4_1, Q.Q4_0)


def _fold_into_q4_k_mins(raw: np.ndarray, shape: tuple[int, int], delta: np.ndarray) -> np.ndarray:
    """Q4_K kept: each sub-block's offset -dmin m_j + dW_j re-encoded on a new 6-bit grid (dmin' = the largest
    |offset| / 63, m'_j = round(-offset / dmin') clipped to 0..63); codes and scales kept. Returns the decoded
    values."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = qc.Q4_K.scale_min(blocks[:, 4:16])
    offset = -(dmin * m.astype(np.float32)) + delta[:, :: qc.QK].reshape(-1, 8)  # [super-blocks, 8]
    new_dmin = np.maximum(-offset, 0).max(axis=1, keepdims=True) / 63
    new_dmin = new_dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        new_m = np.where(new_dmin > 0, np.clip(np.rint(-offset / new_dmin), 0, 63), 0)
    q = blocks[:, 16:].reshape((-1, 4, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    q = (q & np.uint8(0x0F)).reshape((-1, 8, 32)).astype(np.float32)
    x = (d * sc.astype(np.float32))[..., None] * q - (new_dmin * new_m)[..., None]
    return x.reshape(shape)


def measure(w: np.ndarray, delta: np.ndarray) -> dict[str, dict[str, float]]:
    """Per type and way: errors against stored base + dW, and bytes per weight."""
    out: dict[str, dict[str, float]] = {}
    rms_delta = float(np.sqrt(np.mean(delta**2)))
    for qtype in TYPES:
        if w.shape[1] % qc.block_size(qtype):
            continue
        raw = qc.quantize(w, qtype) if qtype != Q.F16 else w.astype(np.float16)
        base = qc.dequantize(raw if qtype != Q.F16 else raw.view(np.uint8), qtype, w.shape).astype(np.float64)
        exact = base + delta
        ways: dict[str, tuple[np.ndarray, Q]] = {}
        to, data = fold(raw if qtype != Q.F16 else raw.view(np.uint8), qtype, w.shape, delta)
        ways["fold"] = (np.asarray(data, np.float32) if to == Q.F16 else qc.dequantize(data, to, w.shape), to)
        if qtype != Q.F16:
            requant = qc.dequantize(qc.quantize(exact.astype(np.float32), qtype), qtype, w.shape)
            ways["requant"] = (requant, qtype)
        if qtype == Q.Q4_K:
            ways["mins"] = (_fold_into_q4_k_mins(raw, w.shape, delta), Q.Q4_K)
        if qtype in (Q.Q8_0, Q.Q6_K):
            ways["f16"] = (exact.astype(np.float16).astype(np.float32), Q.F16)
        for way, (got, stored) in ways.items():
            err = got.astype(np.float64) - exact
            rms = float(np.sqrt(np.mean(err**2)))
            out[f"{qtype.name} {way}"] = {
                "stored_as": stored.name,
                "max_err": float(np.abs(err).max()),
                "rms_err": rms,
                "rms_err_over_rms_dw": rms / rms_delta,
                "dw_kept": float(np.sum((got - base) * delta) / np.sum(delta * delta)),
                "bits_per_weight": 8 * qc.type_size(stored) / qc.block_size(stored),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a mergeable adapter's checkpoint folder")
    parser.add_argument("--teacher", type=Path, default=Path("runs/demo/teacher-f32.gguf"))
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--layers", default="0,14,29")
    args = parser.parse_args()
    adapter, _, _ = load_checkpoint(args.checkpoint)
    r = next(iter(adapter.values())).A.shape[0]
    scale = args.alpha / r
    layers = [int(x) for x in args.layers.split(",")]
    totals: dict[str, list[dict[str, float]]] = {}
    with GGUFFile(args.teacher) as f:
        for layer in layers:
            for t in LORA_TARGETS:
                pair = adapter.get((layer, t))
                if pair is None:
                    continue
                w = f.tensor_f32(f"blk.{layer}.{LORA_TARGETS[t]}.weight")
                delta = scale * (pair.B.astype(np.float64) @ pair.A.astype(np.float64))
                for key, row in measure(w, delta).items():
                    totals.setdefault(key, []).append(row)
    summary = {
        key: {
            "stored_as": rows[0]["stored_as"],
            "bits_per_weight": rows[0]["bits_per_weight"],
            "max_err": max(r["max_err"] for r in rows),
            "rms_err_over_rms_dw": float(np.mean([r["rms_err_over_rms_dw"] for r in rows])),
            "dw_kept": float(np.mean([r["dw_kept"] for r in rows])),
            "tensors": len(rows),
        }
        for key, rows in totals.items()
    }
    print(json.dumps({"checkpoint": str(args.checkpoint), "layers": layers, "scale": scale, "ways": summary}, indent=1))


if __name__ == "__main__":
    main()
