"""The training loop: epochs over token + top-k shards, checkpoints every N steps, bitwise resume."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from data.topk import TopkReader
from gpu.ops.adamw import AdamWConfig
from gpu.student import GPUStudent
from model import reference
from model.kd import LossConfig
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest
from training.batches import batch_arrays, read_split
from training.engines import get_device, load_student
from training.schedule import learning_rate


def loss_config(cfg: RunConfig) -> LossConfig:
    """The model/kd.py loss of this run."""
    beta = cfg.loss.beta if cfg.loss.kind == "jsd" else 0.5
    return LossConfig(
        cfg.loss.kind, tau=cfg.loss.temperature, beta=beta, ce_weight=cfg.loss.ce_weight, use_tail=cfg.teacher.tail
    )


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, for progress bars and metric logging."""

    epoch: int
    step: int  # global optimizer step, 1-based
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    tokens_per_s: float


def build_student(cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool = False) -> GPUStudent:
    weights = load_student(student_gguf, cfg.run.gpu_backend)
    o = cfg.optim
    return GPUStudent(
        get_device(cfg.run.gpu_backend),
        weights,
        targets=cfg.lora.targets,
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        batch=cfg.train.batch_size,
        seq_len=seq_len,
        top_k=cfg.teacher.top_k,
        loss=LossConfig("forward_kl", tau=cfg.teacher.temperature, use_tail=True) if eval_mode else loss_config(cfg),
        optim=AdamWConfig(
            lr=o.lr,
            beta1=o.betas[0],
            beta2=o.betas[1],
            eps=o.eps,
            weight_decay=o.weight_decay,
            max_grad_norm=o.grad_clip,
        ),
        layers=cfg.lora.layers,
        grad_accum=1 if eval_mode else cfg.train.grad_accum,
        precision=cfg.train.precision,
    )


def _epoch_order(cfg: RunConfig, epoch: int, n: int) -> np.ndarray:
    """The sequence order of an epoch: a permutation fixed by (seed, epoch)."""
    return np.random.default_rng([cfg.train.seed, epoch]).permutation(n)


def _steps_per_epoch(cfg: RunConfig, n: int) -> int:
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    steps = max(1, math.ceil(n / per_step))
    if cfg.train.max_steps_per_epoch:
        steps = min(steps, cfg.train.max_steps_per_epoch)
    return steps


def epoch_dir(ckpt_root: Path, epoch: int) -> Path:
    return Path(ckpt_root) / f"epoch-{epoch:03d}"


def train_epoch(
    cfg: RunConfig,
    *,
    student_gguf: Path,
    token_dir: Path,
    topk_dir: Path,
    ckpt_root: Path,
    epoch: int,
    on_step: Callable[[StepRecord], None] | None = None,
) -> CheckpointManifest:
    """Train one epoch, resuming bitwise from the newest complete checkpoint under ckpt_root.

    Checkpoints every cfg.train.checkpoint_every optimizer steps (ckpt_root/step-XXXXXXXX) and at the epoch end
    (ckpt_root/epoch-EEE, whose manifest is returned). on_step runs after each step and after its checkpoint."""
    ckpt_root = Path(ckpt_root)
    done = epoch_dir(ckpt_root, epoch)
    if (done / "checkpoint.json").exists():
        from data.checkpoint import verify_checkpoint

        state = verify_checkpoint(done)
        return _manifest(done, ckpt_root, state)
    train = read_split(token_dir, "train")
    if len(train.seq_ids) == 0:
        raise ValueError(f"{token_dir}: the train split is empty: nothing to train on")
    reader = TopkReader(topk_dir)
    st = build_student(cfg, student_gguf, train.ids.shape[1])
    steps = _steps_per_epoch(cfg, len(train.seq_ids))
    total = steps * cfg.train.epochs
    cursor, losses, skipped = _restore(cfg, st, ckpt_root, epoch)
    order = _epoch_order(cfg, epoch, len(train.seq_ids))
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    tokens = 0
    t_start = time.perf_counter()
    for s in range(cursor, steps):
        t0, step_tokens = time.perf_counter(), 0
        rows = order[s * per_step : (s + 1) * per_step]
        for micro in range(cfg.train.grad_accum):
            part = rows[micro * cfg.train.batch_size : (micro + 1) * cfg.train.batch_size]
            batch = batch_arrays(train, part, cfg.train.batch_size, reader, cfg.teacher.top_k)
            st.write_batch(*batch[:5], batch[5] if cfg.teacher.tail else None)
            st.accumulate(micro)
            step_tokens += int(batch[2].sum())
        tokens += step_tokens
        global_step = epoch * steps + s
        lr = learning_rate(cfg, global_step, total)
        stats = st.apply(lr)
        losses.append(stats.loss)
        skipped += int(stats.skipped)
        record = StepRecord(
            epoch,
            global_step + 1,
            stats.loss,
            stats.grad_norm,
            lr,
            stats.skipped,
            step_tokens / (time.perf_counter() - t0),
        )
        every = cfg.train.checkpoint_every
        if every and (global_step + 1) % every == 0 and s + 1 < steps:
            _save(
                st, ckpt_root / f"step-{global_step + 1:08d}", ckpt_root, epoch, s + 1, global_step + 1, losses, skipped
            )
        if on_step is not None:
            on_step(record)
    elapsed = time.perf_counter() - t_start
    metrics = {
        "train_loss": float(np.mean(losses)) if losses else float("nan"),
        "skipped_steps": skipped,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    }
    return _save(st, done, ckpt_root, epoch, steps, (epoch + 1) * steps, losses, skipped, metrics, epoch_done=True)


def _restore(cfg: RunConfig, st: GPUStudent, ckpt_root: Path, epoch: int) -> tuple[int, list[float], int]:
    """Load the newest checkpoint (or initialise at epoch 0); returns (cursor in this epoch, losses, skipped)."""
    latest = latest_checkpoint(ckpt_root)
    if latest is None:
        if epoch != 0:
            raise FileNotFoundError(f"{ckpt_root}: no checkpoint to start epoch {epoch} from (train epoch 0 first)")
        init = reference.init_lora(st.cfg, list(cfg.lora.targets), cfg.lora.r, cfg.train.seed)
        st.set_adapter({key: pair for key, pair in init.items() if key in st.layout.slots})
        return 0, [], 0
    adapter, optim, state = load_checkpoint(latest)
    st.set_adapter(adapter)
    st.load_optimizer_state(optim, int(state["applied_steps"]))
    st.skipped_steps = int(state.get("skipped_steps_total", 0))
    if state["epoch"] == epoch and not state.get("epoch_done"):
        return int(state["cursor"]), list(state.get("losses", [])), int(state.get("skipped", 0))
    if state["epoch"] == epoch - 1 and state.get("epoch_done"):
        return 0, [], 0
    raise ValueError(f"{latest}: checkpoint of epoch {state['epoch']} cannot start epoch {epoch}")


def _save(
    st: GPUStudent,
    folder: Path,
    root: Path,
    epoch: int,
    cursor: int,
    step: int,
    losses: list[float],
    skipped: int,
    metrics: dict | None = None,
    epoch_done: bool = False,
) -> CheckpointManifest:
    state = {
        "step": step,
        "epoch": epoch,
        "cursor": cursor,
        "epoch_done": epoch_done,
        "applied_steps": st.applied_steps,
        "skipped_steps_total": st.skipped_steps,
        "skipped": skipped,
        "losses": [float(x) for x in losses],
        "metrics": metrics or {},
    }
    return save_checkpoint(folder, st.get_adapter(), st.optimizer_state(), state, root=root)


def _manifest(folder: Path, root: Path, state: dict) -> CheckpointManifest:
    from schemas.manifests import FileRef

    return CheckpointManifest(
        epoch=state["epoch"],
        step=state["step"],
        adapter=FileRef.of(folder / "adapter.safetensors", root=root),
        optimizer=FileRef.of(folder / "optimizer.safetensors", root=root),
        state=FileRef.of(folder / "checkpoint.json", root=root),
        metrics=state.get("metrics", {}),
    )
