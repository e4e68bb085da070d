"""The frozen prefix of the student: which block training starts at from cached activations, and the function
that computes those activations (the residual stream entering that block) with the run's engine backend.

With LoRA on blocks >= L only, blocks 0..L-1 see no adapter, so their output is a fixed function of the tokens.
prefix_layer says L (0: no cache); prefix_fn computes it for [N, T] token batches, on numpy (the reference's
block_forward in float32, as cpu.NumpyEngine runs it) or on the GPU (gpu.model.GPUModel's forward, as
GPUStudent runs it). data/prefix.py stores it, stages/prefix.py runs it over the token splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model import reference as R
from schemas.config import RunConfig
from training.engines import chosen_backend, get_device, load_gpu_weights, load_host_weights

NUMPY_ROWS_PER_CALL = 2048  # positions per numpy call (a few seconds on 2 cores: a progress line per call)


def prefix_layer(cfg: RunConfig) -> int:
    """The block whose input is cached: the lowest adapted block when train.prefix_cache is auto and
    lora.layers leaves out block 0; 0 (no cache) otherwise."""
    if cfg.train.prefix_cache == "off" or not cfg.lora.layers:
        return 0
    return min(cfg.lora.layers)


@dataclass(frozen=True)
class PrefixFn:
    """fn(ids [N, T]) -> float32 [N, T, hidden], the input of block `layer`; best called with about
    rows_per_call positions (N * T) at a time."""

    fn: Callable[[np.ndarray], np.ndarray]
    layer: int
    hidden: int
    rows_per_call: int

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return self.fn(ids)


def numpy_prefix(weights: dict[str, np.ndarray], cfg: object, ids: np.ndarray, layer: int) -> np.ndarray:
    """Embedding and blocks 0..layer-1 (no LoRA) of the float32 student on ids [N, T]: float32 [N, T, H]."""
    x = R.embed(weights, cfg, np.asarray(ids).astype(np.intp))
    for block in range(layer):
        x = R.block_forward(x, weights, cfg, block, {}, 1.0)[0]
    return np.asarray(x, np.float32)


def prefix_fn(cfg: RunConfig, student_gguf: Path, layer: int, seq_len: int) -> PrefixFn:
    """The residual stream entering block `layer` of the student at `student_gguf`, on the run's engine
    backend (train.backend)."""
    if chosen_backend(cfg) == "numpy":
        model_cfg, weights = load_host_weights(student_gguf)
        return PrefixFn(
            lambda ids: numpy_prefix(weights, model_cfg, ids, layer), layer, model_cfg.hidden, NUMPY_ROWS_PER_CALL
        )
    from gpu.model import GPUModel

    dev = get_device(cfg.run.gpu_backend)
    student = load_gpu_weights(student_gguf, cfg.run.gpu_backend)
    batch = cfg.train.batch_size
    model = GPUModel(dev, student, batch=batch, seq_len=seq_len, precision=cfg.train.precision)

    def gpu_fn(ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        out = []
        for s in range(0, len(ids), batch):  # the last group padded with token 0 to the model's batch, then cut
            group = np.zeros((batch, seq_len), np.int64)
            group[: min(batch, len(ids) - s)] = ids[s : s + batch]
            out.append(model.residual_stream(group, layer)[: len(ids) - s])
        return np.concatenate(out)

    return PrefixFn(gpu_fn, layer, student.cfg.hidden, batch * seq_len)
