"""Preference tuning above the engine: the reference log-probs, epochs of DPO-family steps with checkpoints and
bitwise resume (training/loop.py's checkpoint format and restore), and held-out evaluation.

Training and the reference log-probs run on train.backend's engine with the preference objective (NumpyEngine +
cpu/objectives.py's NumpyPreference or GPUStudent + gpu/objectives.py's GpuPreference, chosen as for
distillation); evaluation on the numpy engine (its KL to the reference needs the hidden states and the lm_head on
the host). A batch is train.batch_size pairs
(2 * batch_size sequences); train.grad_accum micro-batches make a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cpu.head import kl_rows
from cpu.objectives import NumpyPreference
from data.preferences import PairRows, pair_batch
from model.dpo import DpoConfig
from model.engine_spec import EngineSpec, PairBatch
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest
from training import engines
from training.engine import Engine
from training.loop import StepRecord, finished_epoch, run_steps

log = logging.getLogger(__name__)


def dpo_config(cfg: RunConfig) -> DpoConfig:
    """model/dpo.py's config from the run's preference section."""
    p = cfg.preference
    return DpoConfig(p.beta, p.loss_type, p.label_smoothing, p.reference_free, p.gamma)


def check_backend(cfg: RunConfig) -> None:
    """train.precision=tensorcore needs the GPU engine: refuse it with train.backend=numpy."""
    if cfg.train.precision == "tensorcore" and cfg.train.backend == "numpy":
        raise ValueError("train.precision: tensorcore needs the GPU engine (train.backend=gpu); numpy computes in f32")


def build_engine(
    cfg: RunConfig, gguf: Path, seq_len: int, grad_accum: int | None = None, backend: str | None = None
) -> Engine:
    """The preference engine on the GGUF at `gguf` for train.batch_size pairs (2 sequences each) of seq_len
    tokens: train.backend's (training.engines.chosen_backend: GPUStudent with gpu/objectives.py's GpuPreference
    or NumpyEngine with cpu/objectives.py's NumpyPreference), or `backend` when given (evaluation reads hidden
    states on the host: numpy)."""
    check_backend(cfg)
    if (backend or engines.chosen_backend(cfg)) != "gpu" and cfg.train.precision == "tensorcore":
        raise ValueError("train.precision: tensorcore needs the GPU engine; this run's engine is numpy (no GPU)")
    dpo, pairs = dpo_config(cfg), cfg.train.batch_size
    return engines.objective_engine(
        cfg,
        gguf,
        lambda model_cfg: EngineSpec.from_run(cfg, model_cfg, seq_len, sequences=2 * pairs, grad_accum=grad_accum),
        numpy_objective=lambda: NumpyPreference(dpo),
        gpu_objective=lambda: _gpu_preference(dpo),
        backend=backend or engines.chosen_backend(cfg),
    )


def _gpu_preference(dpo: DpoConfig) -> Any:
    from gpu.objectives import GpuPreference

    return GpuPreference(dpo)


def zero_adapter(engine: Engine) -> None:
    """Set B = 0 in every slot (A too): the adapter adds exactly nothing, the engine is the frozen model."""
    engine.set_adapter(
        {key: type(p)(np.zeros_like(p.A), np.zeros_like(p.B)) for key, p in engine.get_adapter().items()}
    )


def _batches(n: int, size: int) -> list[np.ndarray]:
    return [np.arange(i, min(n, i + size)) for i in range(0, n, size)]


@dataclass
class Reference:
    """Reference log-probs of one split's pairs, by position in its PairRows: [n] each."""

    chosen: np.ndarray
    rejected: np.ndarray

    def batch(self, index: np.ndarray, pairs: int) -> np.ndarray:
        """[2 * pairs] in PairBatch order (chosen then rejected), zero for the missing rows."""
        out = np.zeros(2 * pairs)
        out[: len(index)] = self.chosen[index]
        out[pairs : pairs + len(index)] = self.rejected[index]
        return out


def reference_logps(
    cfg: RunConfig, gguf: Path, rows: PairRows, seq_len: int, on_batch: Callable[[int], None] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(chosen logp [n], rejected logp [n], chosen tokens [n], rejected tokens [n]) of every pair under the GGUF
    at `gguf` with no adapter, in batches of train.batch_size pairs of seq_len tokens (as training computes)."""
    engine = build_engine(cfg, gguf, seq_len, grad_accum=1)
    zero_adapter(engine)
    p = cfg.train.batch_size
    n = len(rows)
    out = np.zeros((4, n))
    for index in _batches(n, p):
        ids, mask = pair_batch(rows, index, p, engine.seq_len)
        engine.write_batch(PairBatch(ids, mask))
        logps = engine.evaluate_batch()
        logp, count = logps["logps"], logps["counts"]
        k = len(index)
        out[0, index], out[1, index] = logp[:k], logp[p : p + k]
        out[2, index], out[3, index] = count[:k], count[p : p + k]
        if on_batch is not None:
            on_batch(k)
    return out[0], out[1], out[2].astype(np.int32), out[3].astype(np.int32)


def train_epoch(
    cfg: RunConfig,
    *,
    student_gguf: Path,
    rows: PairRows,
    reference: Reference | None,
    seq_len: int,
    ckpt_root: Path,
    epoch: int,
    on_step: Callable[[StepRecord], None] | None = None,
) -> CheckpointManifest:
    """Train one epoch of preference steps, resuming bitwise from the newest complete checkpoint (training/loop.py's
    steps, checkpoint layout and restore; an item is a pair)."""
    finished = finished_epoch(ckpt_root, epoch)
    if finished is not None:
        return finished
    if not len(rows):
        raise ValueError("the train split has no preference pairs: nothing to train on")
    engine = build_engine(cfg, student_gguf, seq_len)
    p = cfg.train.batch_size

    def write_micro(index: np.ndarray) -> int:
        ids, mask = pair_batch(rows, index, p, seq_len)
        engine.write_batch(PairBatch(ids, mask, None if reference is None else reference.batch(index, p)))
        return int(mask.sum())

    return run_steps(cfg, engine, Path(ckpt_root), epoch, len(rows), write_micro, on_step)


def evaluate(
    cfg: RunConfig,
    *,
    student_gguf: Path,
    rows: PairRows,
    reference: Reference | None,
    reference_gguf: Path | None,
    seq_len: int,
    adapter: dict | None,
    max_batches: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Held-out metrics of the student with `adapter` (None: without one): mean preference loss, reward accuracy
    (ties count half), mean margin and rewards, and the mean per-token KL(policy || reference) over the response
    positions of both responses (reference_gguf: another reference model; None: the student without adapter)."""
    engine = build_engine(cfg, student_gguf, seq_len, grad_accum=1, backend="numpy")
    ref_engine = None
    if reference_gguf is not None:
        ref_engine = build_engine(cfg, reference_gguf, seq_len, grad_accum=1, backend="numpy")
    if ref_engine is not None:
        zero_adapter(ref_engine)
    p = cfg.train.batch_size
    losses, margins, chosen, rejected, kls = [], [], [], [], []
    for b, index in enumerate(_batches(len(rows), p)):
        if max_batches is not None and b >= max_batches:
            break
        ids, mask = pair_batch(rows, index, p, seq_len)
        engine.write_batch(PairBatch(ids, mask, None if reference is None else reference.batch(index, p)))
        if adapter is None:
            zero_adapter(engine)
        else:
            engine.set_adapter(adapter)
        terms = engine.evaluate_batch()
        live = np.flatnonzero(terms["valid"])
        losses += terms["pair_loss"][live].tolist()
        margins += terms["margin"][live].tolist()
        chosen += terms["chosen_reward"][live].tolist()
        rejected += terms["rejected_reward"][live].tolist()
        rows_m = np.flatnonzero(mask.reshape(-1) != 0)
        h = engine.objective.last_hidden[rows_m]
        if ref_engine is None and adapter is None:  # the policy is the reference
            h_ref, w_ref = h, engine.head.w
        elif ref_engine is None:
            zero_adapter(engine)
            h_ref, w_ref = engine.final_hidden()[rows_m], engine.head.w
        else:
            ref_engine.write_batch(PairBatch(ids, mask))
            h_ref, w_ref = ref_engine.final_hidden()[rows_m], ref_engine.head.w
        kls += kl_rows(h, engine.head.w, h_ref, w_ref).tolist()
        if on_batch is not None:
            on_batch(len(index))
    m = np.asarray(margins)
    return {
        "loss": float(np.mean(losses)) if losses else float("nan"),
        "reward_accuracy": float(np.mean((m > 0) + 0.5 * (m == 0))) if len(m) else 0.0,
        "margin": float(m.mean()) if len(m) else 0.0,
        "chosen_reward": float(np.mean(chosen)) if chosen else 0.0,
        "rejected_reward": float(np.mean(rejected)) if rejected else 0.0,
        "kl_reference": float(np.mean(kls)) if kls else 0.0,
        "n_pairs": len(m),
    }
