"""The frozen student for the CPU engine: every tensor of a GGUF dequantized once to float32."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from model.config import ModelConfig


def load_gguf_f32(path: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, {GGUF name: float32 array in numpy shape}) of the GGUF at `path`."""
    from model.gguf import GGUFFile

    with GGUFFile(path) as f:
        return f.config(), {name: f.tensor_f32(name) for name in f.tensors}


def check_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Every tensor `cfg` needs (ModelConfig.tensor_shapes) as a C-contiguous float32 array (no copy when it
    already is one), shapes checked; `source` names the weights in errors."""
    shapes = cfg.tensor_shapes()
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ValueError(f"{source}: student weights incomplete: missing {', '.join(missing[:5])}")
    out = {}
    for name, shape in shapes.items():
        out[name] = np.ascontiguousarray(weights[name], dtype=np.float32)
        if out[name].shape != tuple(shape):
            raise ValueError(f"{source}: {name} has shape {out[name].shape}, the config needs {tuple(shape)}")
    return out
