"""train: LoRA epochs through training.loop.train_epoch, resumable from their checkpoints, with a step log.

Checkpoints live in <workdir>/train/<key>/, addressed by the training key (every input but the epoch), so a
rerun of a crashed epoch resumes from its newest complete checkpoint and ends with the same adapter bytes, and
a changed setting never resumes another setting's checkpoints. Each optimizer step is appended to steps.jsonl
there (read_steps reads it back) before the caller's on_step sees it. With a frozen-prefix cache
(stages/prefix.py: lora.layers leaves out block 0) every step starts its forward at the lowest adapted block.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.checkpoint import ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, StudentManifest, TeacherManifest, TokenizeManifest
from stages.inputs import InputError
from stages.keys import StageKey
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar
from training import schedule

if TYPE_CHECKING:
    from training.loop import StepRecord

log = logging.getLogger(__name__)

FOLDER = "train"
STEPS_FILE = "steps.jsonl"
# What every epoch stage's key reads (distillation and preference): the adapter, the optimizer, the loop.
EPOCH_FIELDS = (
    "lora",
    "optim",
    "train.epochs",
    "train.batch_size",
    "train.grad_accum",
    "train.seed",
    "train.precision",
    "train.backend",
    "train.max_steps_per_epoch",
)
KEY = StageKey(
    stage="train",
    version="2",  # 2: train.precision auto trains on the integer tensor cores where the GPU has them (was tensorcore)
    config_fields=(*EPOCH_FIELDS, "loss", "teacher.tail", "train.prefix_cache"),
    inputs=("student", "tokens", "teacher", "epoch"),
)


def checkpoint_root(
    cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, teacher: TeacherManifest
) -> Path:
    """<workdir>/train/<training key>: the checkpoints of every epoch of this training setting."""
    return stage_dir(cfg, FOLDER, KEY.key(cfg, {"student": student, "tokens": tokens, "teacher": teacher}))


def epoch_folder(
    cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, teacher: TeacherManifest, epoch: int
) -> Path:
    """Where the end-of-epoch checkpoint of epoch `epoch` is written."""
    from training.loop import epoch_dir

    return epoch_dir(checkpoint_root(cfg, student, tokens, teacher), epoch)


def steps_per_epoch(cfg: RunConfig, tokens: TokenizeManifest) -> int:
    """Optimizer steps in one epoch over the train split."""
    return schedule.steps_per_epoch(cfg, tokens.train.n_sequences)


def warn_small_split(cfg: RunConfig, tokens: TokenizeManifest) -> None:
    """Warn when the train split does not fill one optimizer step (each epoch is then one partial step)."""
    n, per_step = tokens.train.n_sequences, cfg.train.sequences_per_step
    if n < per_step:
        log.warning(
            "train: the train split has %d sequences (%d trained positions), fewer than one optimizer step's %d "
            "(train.batch_size %d x train.grad_accum %d): each epoch is one partial step; give more data or lower "
            "train.batch_size",
            n,
            tokens.train.n_positions,
            per_step,
            cfg.train.batch_size,
            cfg.train.grad_accum,
        )


def run_epoch(
    cfg: RunConfig,
    student: StudentManifest,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    epoch: int,
    on_step: Callable[[StepRecord], None] | None = None,
    bar: BarFactory = no_bar,
) -> CheckpointManifest:
    """Train epoch `epoch` (0-based), resuming from the newest checkpoint; returns the epoch-end checkpoint."""
    import stages.prefix
    from training.engines import upload_stats
    from training.loop import epoch_dir, train_epoch

    if epoch == 0:
        warn_small_split(cfg, tokens)
    root = workdir(cfg)
    prefix = stages.prefix.cache(cfg, student, tokens)
    ckpt_root = checkpoint_root(cfg, student, tokens, teacher)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    last_log = [time.monotonic()]
    with bar(f"train epoch {epoch}", steps_per_epoch(cfg, tokens)) as b, open(ckpt_root / STEPS_FILE, "a") as fh:

        def step(rec: StepRecord) -> None:
            fh.write(json.dumps(dataclasses.asdict(rec)) + "\n")
            fh.flush()
            b.advance(1, loss=f"{rec.loss:.4f}", lr=f"{rec.lr:.2e}", tok_s=f"{rec.tokens_per_s:.0f}")
            now = time.monotonic()
            if rec.step % 10 == 0 or rec.skipped or now - last_log[0] > 10:  # slow devices: every step
                last_log[0] = now
                log.info(
                    "step %d loss %.4f grad norm %.3f lr %.2e, %.0f tokens/s%s",
                    rec.step,
                    rec.loss,
                    rec.grad_norm,
                    rec.lr,
                    rec.tokens_per_s,
                    " (skipped: not finite)" if rec.skipped else "",
                )
            if on_step is not None:
                on_step(rec)

        try:
            manifest = train_epoch(
                cfg,
                student_gguf=student.path_in(root),
                token_dir=tokens.path_in(root),
                topk_dir=teacher.path_in(root),
                ckpt_root=ckpt_root,
                epoch=epoch,
                on_step=step,
                prefix_dir=None if prefix is None else prefix.path_in(root),
            )
        except MemoryError as exc:
            raise InputError(
                f"train.batch_size: {cfg.train.batch_size} sequences of data.seq_len {cfg.data.seq_len} "
                f"(teacher.top_k {cfg.teacher.top_k}) do not fit in memory ({exc}); lower train.batch_size"
            ) from None
    log.info("epoch %d done: %s; upload %s", epoch, manifest.metrics, upload_stats())
    return relocated(manifest, epoch_dir(ckpt_root, epoch), root)


def relocated(manifest: CheckpointManifest, folder: Path, root: Path) -> CheckpointManifest:
    """An epoch checkpoint's manifest with its folder and files relative to the workdir `root`."""
    return manifest.at(folder, root).model_copy(
        update={
            "adapter": manifest.adapter.moved(folder / ADAPTER_FILE, root),
            "optimizer": manifest.optimizer.moved(folder / OPTIMIZER_FILE, root),
            "state": manifest.state.moved(folder / STATE_FILE, root),
        }
    )


def run(
    cfg: RunConfig,
    student: StudentManifest,
    tokens: TokenizeManifest,
    teacher: TeacherManifest,
    on_step: Callable[[StepRecord], None] | None = None,
    bar: BarFactory = no_bar,
) -> list[CheckpointManifest]:
    """Every epoch in order: one epoch-end checkpoint per epoch."""
    return [run_epoch(cfg, student, tokens, teacher, e, on_step, bar) for e in range(cfg.train.epochs)]


def read_steps(cfg: RunConfig, checkpoint: CheckpointManifest) -> list[dict[str, Any]]:
    """The step records of a training setting (steps.jsonl next to its checkpoints), the last record of each
    step kept (a resumed run logs the steps after its checkpoint again)."""
    path = checkpoint.path_in(workdir(cfg)).parent / STEPS_FILE
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash
    return [by_step[s] for s in sorted(by_step)]
