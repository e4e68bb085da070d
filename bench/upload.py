"""GGUF stream + upload throughput (GiB/s) and host peak RSS, as JSON.

python bench/upload.py --shape tinyllama --quant Q4_K     # writes a random GGUF under /tmp, then uploads it
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType as Q  # noqa: E402
from train_step import SHAPES, random_tensors  # noqa: E402

from gpu.device import Device  # noqa: E402
from gpu.model import ModelWeights  # noqa: E402
from model.gguf import llama_metadata, write_gguf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--quant", default="Q4_K")
    p.add_argument("--backend", default=None)
    args = p.parse_args()
    cfg = SHAPES[args.shape]
    meta = llama_metadata(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.gguf"
        rng = np.random.default_rng(0)
        write_gguf(path, "llama", meta, ((n, d, t) for n, d, t, _ in random_tensors(cfg, Q[args.quant], rng)))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        dev = Device(args.backend)
        t0 = time.perf_counter()
        weights = ModelWeights.from_gguf(dev, path)
        dev.sync()
        dt = time.perf_counter() - t0
        size = path.stat().st_size
    print(
        json.dumps(
            {
                "what": "gguf_upload",
                "shape": args.shape,
                "quant": args.quant,
                "backend": dev.backend,
                "adapter": dev.adapter.summary,
                "file_bytes": size,
                "gpu_weight_bytes": weights.nbytes,
                "seconds": round(dt, 3),
                "gib_per_s": round(size / dt / 2**30, 3),
                "host_peak_rss_mib_before": round(rss_before),
                "host_peak_rss_mib_after": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        )
    )


if __name__ == "__main__":
    main()
