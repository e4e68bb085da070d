"""The training loop above the engine interface: epochs over token + top-k shards, the LR per step, checkpoints
every N steps, bitwise resume."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from model import reference
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, FileRef
from training import engines
from training.batches import KdSource, read_split
from training.engine import Engine
from training.schedule import learning_rate, steps_per_epoch

log = logging.getLogger(__name__)


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


def _epoch_order(cfg: RunConfig, epoch: int, n: int) -> np.ndarray:
    """The sequence order of an epoch: a permutation fixed by (seed, epoch)."""
    return np.random.default_rng([cfg.train.seed, epoch]).permutation(n)


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
    prefix_dir: Path | None = None,
) -> CheckpointManifest:
    """Train one epoch, resuming bitwise from the newest complete checkpoint under ckpt_root.

    Checkpoints every cfg.train.checkpoint_every optimizer steps (ckpt_root/step-XXXXXXXX) and at the epoch end
    (ckpt_root/epoch-EEE, whose manifest is returned). on_step runs after each step and after its checkpoint.
    prefix_dir: a frozen-prefix cache (data/prefix.py); the engine then starts its forward at its block."""
    finished = finished_epoch(ckpt_root, epoch)
    if finished is not None:
        return finished
    train = read_split(token_dir, "train")
    if len(train.seq_ids) == 0:
        raise ValueError(f"{token_dir}: the train split is empty: nothing to train on")
    source = KdSource.open(train, topk_dir, prefix_dir)
    start = source.start_layer
    if cfg.train.workers > 1:  # N Ray actors, each with its own engine; the same steps (training/data_parallel.py)
        from training import data_parallel

        engine: Engine = data_parallel.build(cfg, student_gguf, train.seq_len, start_layer=start)
    else:
        engine = engines.build_engine(cfg, student_gguf, train.seq_len, start_layer=start)

    def write_micro(part: np.ndarray) -> int:
        batch = source.batch(part, cfg.train.batch_size, engines.teacher_width(cfg), tail=cfg.teacher.tail)
        engine.write_batch(batch)
        return int(batch.mask.sum())

    return run_steps(cfg, engine, Path(ckpt_root), epoch, len(train.seq_ids), write_micro, on_step)


def finished_epoch(ckpt_root: Path, epoch: int) -> CheckpointManifest | None:
    """The verified end-of-epoch checkpoint of `epoch` if one exists (a corrupt one is retrained: None)."""
    done = epoch_dir(Path(ckpt_root), epoch)
    if not (done / "checkpoint.json").exists():
        return None
    try:
        return _manifest(done, Path(ckpt_root), verify_checkpoint(done))
    except CheckpointError as exc:  # rewritten by run_steps, from the checkpoint before it
        log.warning("%s: retraining epoch %d from the checkpoint before it", exc, epoch)
        return None


def run_steps(
    cfg: RunConfig,
    engine: Engine,
    ckpt_root: Path,
    epoch: int,
    n_items: int,
    write_micro: Callable[[np.ndarray], int],
    on_step: Callable[[StepRecord], None] | None = None,
) -> CheckpointManifest:
    """The optimizer steps of one epoch over `n_items` training items (sequences or pairs) in the epoch's fixed
    order: restore, then per step train.grad_accum micro-batches of train.batch_size items (write_micro writes
    one into the engine and returns its trained tokens), the LR, apply, periodic checkpoints; the epoch-end
    checkpoint's manifest is returned."""
    steps = steps_per_epoch(cfg, n_items)
    total = steps * cfg.train.epochs
    cursor, losses, skipped = _restore(cfg, engine, ckpt_root, epoch, steps)
    order = _epoch_order(cfg, epoch, n_items)
    per_step, size = cfg.train.sequences_per_step, cfg.train.batch_size
    tokens = 0
    t_start = time.perf_counter()
    for s in range(cursor, steps):
        t0, step_tokens = time.perf_counter(), 0
        rows = order[s * per_step : (s + 1) * per_step]
        for micro in range(cfg.train.grad_accum):
            step_tokens += write_micro(rows[micro * size : (micro + 1) * size])
            engine.accumulate(micro)
        tokens += step_tokens
        global_step = epoch * steps + s
        lr = learning_rate(cfg, global_step, total)
        stats = engine.apply(lr)
        losses.append(stats.loss)
        skipped += int(stats.skipped)
        record = StepRecord(
            epoch, global_step + 1, stats.loss, stats.grad_norm, lr, stats.skipped,
            step_tokens / (time.perf_counter() - t0),
        )  # fmt: skip
        every = cfg.train.checkpoint_every
        if every and (global_step + 1) % every == 0 and s + 1 < steps:
            folder = ckpt_root / f"step-{global_step + 1:08d}"
            _save(engine, folder, ckpt_root, epoch, s + 1, global_step + 1, losses, skipped)
        if on_step is not None:
            on_step(record)
    elapsed = time.perf_counter() - t_start
    metrics = {
        "train_loss": float(np.mean(losses)) if losses else float("nan"),
        "skipped_steps": skipped,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    }
    done = epoch_dir(ckpt_root, epoch)
    return _save(engine, done, ckpt_root, epoch, steps, (epoch + 1) * steps, losses, skipped, metrics, epoch_done=True)


def _restore(cfg: RunConfig, engine: Engine, ckpt_root: Path, epoch: int, steps: int) -> tuple[int, list[float], int]:
    """Load the newest checkpoint before this epoch's end (or initialise at epoch 0); returns (cursor in this
    epoch, losses, skipped). Later epochs' checkpoints are passed over: a recomputed epoch starts where it did."""
    latest = latest_checkpoint(ckpt_root, max_step=(epoch + 1) * steps - 1)
    if latest is None:
        if epoch != 0:
            raise FileNotFoundError(f"{ckpt_root}: no checkpoint to start epoch {epoch} from (train epoch 0 first)")
        init = reference.init_lora(engine.cfg, list(cfg.lora.targets), cfg.lora.r, cfg.train.seed, group=cfg.lora.group)
        engine.set_adapter({key: pair for key, pair in init.items() if key in engine.layout.slots})
        return 0, [], 0
    adapter, optim, state = load_checkpoint(latest)
    engine.set_adapter(adapter)
    engine.load_optimizer_state(optim, int(state["applied_steps"]))
    engine.skipped_steps = int(state.get("skipped_steps_total", 0))
    if state["epoch"] == epoch and not state.get("epoch_done"):
        return int(state["cursor"]), list(state.get("losses", [])), int(state.get("skipped", 0))
    if state["epoch"] == epoch - 1 and state.get("epoch_done"):
        return 0, [], 0
    raise ValueError(f"{latest}: checkpoint of epoch {state['epoch']} cannot start epoch {epoch}")


def _save(
    engine: Engine,
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
        "applied_steps": engine.applied_steps,
        "skipped_steps_total": engine.skipped_steps,
        "skipped": skipped,
        "losses": [float(x) for x in losses],
        "metrics": metrics or {},
    }
    return save_checkpoint(folder, engine.get_adapter(), engine.optimizer_state(), state, root=root)


def _manifest(folder: Path, root: Path, state: dict) -> CheckpointManifest:
    return CheckpointManifest(
        epoch=state["epoch"],
        step=state["step"],
        adapter=FileRef.of(folder / "adapter.safetensors", root=root),
        optimizer=FileRef.of(folder / "optimizer.safetensors", root=root),
        state=FileRef.of(folder / "checkpoint.json", root=root),
        metrics=state.get("metrics", {}),
    )
