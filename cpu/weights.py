"""The frozen student for the CPU engine: every tensor of a GGUF dequantized once to float32."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from model.config import LORA_TARGETS, ModelConfig


def load_gguf_f32(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, {GGUF name: float32 array in numpy shape}) of the GGUF at `path`."""
    from model.gguf import GGUFFile

    with GGUFFile(path) as f:
        return f.config(), {name: f.tensor_f32(name) for name in f.tensors}


def check_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """The weights as C-contiguous float32 arrays (no copy when they already are), complete for `cfg`."""
    need = ["token_embd.weight", "output_norm.weight"]
    need += [f"blk.{i}.{n}_norm.weight" for i in range(cfg.n_layers) for n in ("attn", "ffn")]
    need += [f"blk.{i}.{stem}.weight" for i in range(cfg.n_layers) for stem in LORA_TARGETS.values()]
    if not cfg.tied_embeddings:
        need.append("output.weight")
    missing = [n for n in need if n not in weights]
    if missing:
        raise ValueError(f"{source}: student weights incomplete: missing {', '.join(missing[:5])}")
    out = {name: np.ascontiguousarray(weights[name], dtype=np.float32) for name in need}
    for t, stem in LORA_TARGETS.items():
        shape = cfg.target_shape(t)
        got = out[f"blk.0.{stem}.weight"].shape
        if got != shape:
            raise ValueError(f"{source}: blk.0.{stem}.weight has shape {got}, the config needs {shape}")
    return out
