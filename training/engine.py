"""The engine interface: what trains and evaluates LoRA on one frozen student, below the loop.

The training loop, LR schedule, checkpoint/resume and evaluation loop (training/loop.py, training/evaluation.py)
talk to an `Engine` only; training/engines.py builds one. The wgpu engine is gpu/student.py's GPUStudent, which
satisfies this protocol structurally (gpu/ may not import training/). The types here are protocols for the same
reason: an engine returns its own objects with these attributes.

Frozen prefix: an engine built with start_layer = L > 0 (at most the lowest adapted block) starts its forward
at block L from the activations write_batch gets (training/prefix.py, data/prefix.py); the backward stops at
the lowest adapted block either way.

Every engine is a trunk built from one model.engine_spec.EngineSpec (B sequences of T tokens, rows = B * T,
the LoRA settings) with one objective plugged in: KD over the teacher's top-k (cfg.teacher.top_k) or a
preference loss over pairs (B = 2 per pair). Adapters map (layer, target) -> model.reference.LoraPair(A [r, d_in],
B [d_out, r]) in float32, for exactly the slots of `layout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from model.config import ModelConfig
from model.engine_spec import KdBatch, PairBatch
from model.reference import LoraPair

Adapter = Mapping[tuple[int, str], LoraPair]


class AdapterSlot(Protocol):
    """The shape of one adapted projection: A is [r, d_in], B is [d_out, r]."""

    @property
    def d_in(self) -> int: ...

    @property
    def d_out(self) -> int: ...


class AdapterLayout(Protocol):
    """Which (layer, target) projections carry LoRA, and its rank r."""

    @property
    def r(self) -> int: ...

    @property
    def slots(self) -> Mapping[tuple[int, str], AdapterSlot]: ...


class StepStats(Protocol):
    """The outcome of one optimizer step."""

    @property
    def loss(self) -> float:
        """Mean training loss over the step's micro-batches."""
        ...

    @property
    def grad_norm(self) -> float:
        """Global gradient norm before clipping."""
        ...

    @property
    def skipped(self) -> bool:
        """True when the loss or gradient was not finite: parameters and moments were left untouched."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Forward/backward, AdamW and adapter state of LoRA on one frozen student, for [B, T] batches.

    A training step is: for each micro-batch, write_batch then accumulate(micro); then apply(lr) once.
    An evaluation step is write_batch then evaluate_batch (an engine built with eval_mode=True).
    Every call is deterministic: the same calls in the same order give the same bytes."""

    @property
    def cfg(self) -> ModelConfig:
        """The student's architecture (the LoRA initialisation draws from it)."""
        ...

    @property
    def layout(self) -> AdapterLayout:
        """The adapted (layer, target) slots and the rank."""
        ...

    applied_steps: int
    """Optimizer updates applied so far (AdamW's bias-correction step count); restored by load_optimizer_state."""

    skipped_steps: int
    """Steps skipped for a non-finite loss or gradient so far; the loop sets it when it resumes."""

    def set_adapter(self, adapter: Adapter) -> None:
        """Load LoRA parameters for every slot of `layout` (float32 arrays of the slot's shapes)."""
        ...

    def get_adapter(self) -> dict[tuple[int, str], LoraPair]:
        """The current LoRA parameters, one LoraPair per slot, float32 copies."""
        ...

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The AdamW moments as named float32 arrays ("m", "v": flat, the engine's parameter order); the loop
        stores them as they are and hands them back to load_optimizer_state."""
        ...

    def load_optimizer_state(self, state: Mapping[str, np.ndarray], applied_steps: int) -> None:
        """Restore what optimizer_state() returned and the applied-step count of the checkpoint it came from."""
        ...

    def gradients(self) -> dict[str, np.ndarray]:
        """The step's gradients so far, for a data-parallel all-reduce (training/data_parallel.py): "grads" (flat
        float32 [n_params], the engine's parameter order, summed over the micro-batches accumulated, not yet
        averaged) and "losses" (float32 [grad_accum], each micro-batch's loss; unset slots hold anything)."""
        ...

    def set_gradients(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the accumulated gradients and micro-batch losses with `state` (as gradients() returns it, e.g.
        summed over workers): apply(lr) then steps on them as if this engine had accumulated them."""
        ...

    def write_batch(self, batch: KdBatch | PairBatch) -> None:
        """Take one batch of the engine's objective (model/engine_spec.py): a KdBatch for distillation (ids,
        targets, mask [B, T], the teacher's top-k ids and log-probs [B, T, k] at the teacher temperature, tail
        [B, T] or None, prefix [B, T, hidden]: the residual stream entering the engine's start_layer, given
        exactly when the engine was built with start_layer > 0), a PairBatch for a preference loss. Raises
        ValueError for ids outside the vocabulary or a prefix that does not fit, TypeError for the other
        objective's batch."""
        ...

    def accumulate(self, micro: int) -> None:
        """Forward + backward of the written batch as micro-batch `micro` (0-based, < grad_accum) of this step:
        micro 0 starts the gradients, later ones add to them."""
        ...

    def apply(self, lr: float) -> StepStats:
        """Average the accumulated gradients over grad_accum, clip them, and take one AdamW step at `lr` (skipped
        when the loss or gradient norm is not finite); counts it in applied_steps or skipped_steps."""
        ...

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """Forward only on the written batch: the objective's results. KD: kd_loss ([1] float32: the masked mean
        of the engine's loss, forward KL at the teacher temperature for an eval-mode engine), ce ([rows] float:
        cross-entropy of each row's target) and top1 ([rows] uint32: the student's most likely next token); rows
        whose mask is 0 are included, callers select the masked ones. Preference: logps and counts [2P] (summed
        response log-probs, response tokens) and, with reference log-probs or a reference-free loss, loss [1],
        pair_loss, margin, chosen_reward, rejected_reward, valid [P]."""
        ...
