"""What every training engine is built from and what it is fed, shared by cpu/ and gpu/ (neither imports the
other): `EngineSpec`, the shapes and LoRA settings of an engine, built once from the run config; `KdBatch` and
`PairBatch`, the typed batches of the two objectives (what `write_batch` takes).

An engine is one trunk (the frozen student's forward and backward with LoRA, the flat parameters, AdamW) and one
objective plugged into it: knowledge distillation (cpu/objectives.py `NumpyKd`, gpu/objectives.py `GpuKd`) or a
preference loss (`NumpyPreference`, `GpuPreference`). The objective says what a batch is, turns the final hidden
states into a loss and dL/dh, and what an evaluation returns; the trunk does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from model.config import ModelConfig
from model.lora_layout import LoraLayout
from schemas.config import RunConfig, lora_scale

PRECISIONS = ("f32", "tensorcore", "int8", "auto")  # matmul paths (gpu/model.py resolves them on a device)


@dataclass(frozen=True)
class EngineSpec:
    """The shapes and LoRA settings of an engine: `batch` sequences of `seq_len` tokens (rows = batch * seq_len)
    of the student `cfg`, LoRA of rank r on `targets` of `layers` (None: all blocks) scaled by alpha / r,
    grad_accum micro-batches per optimizer step. start_layer > 0: the forward starts at that block from a given
    residual stream (the frozen-prefix cache); vocab_chunk: the LM head's vocabulary slice per pass.
    lora_group > 0: a mergeable adapter (lora.kind mergeable): every A is constant over each group of lora_group
    inputs, and the engines project dA onto such matrices (model/reference.py lora_group_project)."""

    cfg: ModelConfig
    targets: tuple[str, ...]
    r: int
    alpha: float
    batch: int
    seq_len: int
    layers: tuple[int, ...] | None = None
    grad_accum: int = 1
    precision: str = "f32"
    start_layer: int = 0
    vocab_chunk: int = 4096
    lora_group: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.seq_len > self.cfg.context_length:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's context length {self.cfg.context_length}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.lora_group:
            check_group_dims(self.cfg, self.targets, self.lora_group)

    @property
    def rows(self) -> int:
        """Token positions per micro-batch: batch * seq_len."""
        return self.batch * self.seq_len

    @property
    def scale(self) -> float:
        """The LoRA update's scale alpha / r (schemas/config.py's lora_scale)."""
        return lora_scale(self.alpha, self.r)

    def layout(self) -> LoraLayout:
        """The flat parameter layout of this spec's adapted slots."""
        return LoraLayout.build(self.cfg, self.targets, self.r, self.layers)

    @classmethod
    def from_run(
        cls,
        run: RunConfig,
        cfg: ModelConfig,
        seq_len: int,
        *,
        sequences: int | None = None,
        grad_accum: int | None = None,
        start_layer: int = 0,
        precision: str | None = None,
    ) -> EngineSpec:
        """The spec of `run` on the student `cfg` for seq_len tokens: sequences per micro-batch (default
        train.batch_size; a preference batch holds two per pair), grad_accum (default train.grad_accum), precision
        (default train.precision)."""
        return cls(
            cfg,
            targets=run.lora.targets,
            r=run.lora.r,
            alpha=run.lora.alpha,
            batch=run.train.batch_size if sequences is None else sequences,
            seq_len=seq_len,
            layers=run.lora.layers,
            grad_accum=run.train.grad_accum if grad_accum is None else grad_accum,
            precision=run.train.precision if precision is None else precision,
            start_layer=start_layer,
            lora_group=run.lora.group,
        )


def check_group_dims(cfg: ModelConfig, targets: tuple[str, ...], group: int) -> None:
    """Refuse a mergeable adapter on a target whose input size is not a multiple of `group` (one line)."""
    for t in targets:
        d_in = cfg.target_shape(t)[1]
        if d_in % group:
            raise ValueError(
                f"lora.kind mergeable: target {t!r} has {d_in} inputs, not a multiple of the quantization group "
                f"{group}; leave {t!r} out of lora.targets or use lora.kind plain"
            )


@dataclass(frozen=True)
class KdBatch:
    """One distillation batch: ids, targets (the next token) [B, T] in [0, vocab); mask [B, T] (1 where the loss
    counts); the teacher's top-k ids [B, T, k] and log-probs [B, T, k] at the teacher temperature; tail [B, T],
    the teacher mass outside the top-k, or None to leave the tail out of the loss; prefix [B, T, hidden] float32,
    the residual stream entering the engine's start_layer (given exactly when start_layer > 0); teacher_counts
    [B, T, n] uint8 for the sampled store (model/sampled.py): teacher_ids are then the distinct drawn ids padded with
    count 0, teacher_logprobs their stored log-probs, and the tail is None."""

    ids: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    teacher_ids: np.ndarray
    teacher_logprobs: np.ndarray
    teacher_tail: np.ndarray | None = None
    prefix: np.ndarray | None = None
    teacher_counts: np.ndarray | None = None


@dataclass(frozen=True)
class PairBatch:
    """P preference pairs as 2P sequences: ids, mask [2P, T], the chosen responses' rows first, then the
    rejected ones (mask[t] = 1 where ids[t+1] is a response token); ref_logps [2P], the reference's summed
    response log-probs (None: a reference-free loss, or log-probs only)."""

    ids: np.ndarray
    mask: np.ndarray
    ref_logps: np.ndarray | None = None


def expect_batch(batch: object, kind: type, objective: str) -> None:
    """Refuse another objective's batch: TypeError unless `batch` is a `kind`."""
    if not isinstance(batch, kind):
        raise TypeError(f"the {objective} objective takes a {kind.__name__}, not {type(batch).__name__}")


def check_pair_engine(batch: int, start_layer: int) -> int:
    """The number of pairs of a preference engine of `batch` sequences starting at block `start_layer`; refuses
    an odd batch or a frozen-prefix start."""
    if batch % 2:
        raise ValueError(f"a preference batch is 2 sequences per pair: batch={batch} is odd")
    if start_layer:
        raise ValueError("the preference objective starts at block 0 (no frozen-prefix cache)")
    return batch // 2


def pair_arrays(batch: PairBatch, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64, mask bool, targets int64) [B, T] of a PairBatch: the last position of each row has no target
    (its mask is cleared), targets[t] = ids[t + 1]."""
    ids = np.asarray(batch.ids).reshape(shape).astype(np.int64)
    mask = np.asarray(batch.mask).reshape(shape) != 0
    mask[:, -1] = False
    targets = np.zeros(shape, np.int64)
    targets[:, :-1] = ids[:, 1:]
    return ids, mask, targets


def gradient_state(state: Mapping[str, np.ndarray], n_params: int, grad_accum: int) -> tuple[np.ndarray, np.ndarray]:
    """(grads [n_params], losses [grad_accum]) float32 of an Engine.gradients() state handed to set_gradients;
    ValueError when the shapes are not the engine's."""
    grads, losses = np.asarray(state["grads"], np.float32), np.asarray(state["losses"], np.float32)
    if grads.shape != (n_params,) or losses.shape != (grad_accum,):
        raise ValueError(f"gradients {grads.shape}, losses {losses.shape}: expected ({n_params},), ({grad_accum},)")
    return grads, losses
