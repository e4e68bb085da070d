"""train_epoch: one Prefect task per epoch over training.loop.train_epoch, resumable from its checkpoints.

Checkpoints live in <workdir>/train/<key>/, addressed by the training key (every input but the epoch), so a
rerun of a crashed epoch resumes from its newest complete checkpoint and ends with the same adapter bytes,
and a changed setting never resumes another setting's checkpoints. Each optimizer step is appended to
steps.jsonl there, logged live to MLflow, shown on a progress bar, and offered to the fault hook.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from schemas.config import RunConfig
from schemas.manifests import TokenizeManifest
from tasks import faults
from tasks.caching import StageCache, as_config, located, missing, relative, stage_dir, stage_options
from tasks.progress import bar
from tasks.student import student_path
from tasks.tracking import step_logger

STEPS_FILE = "steps.jsonl"


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    from training.loop import epoch_dir

    root = checkpoint_root(cfg, inputs["student"], inputs["tokens"], inputs["teacher"])
    return missing(epoch_dir(root, inputs["epoch"]) / "checkpoint.json")


POLICY = StageCache(
    stage="train",
    version="1",
    config_fields=(
        "lora",
        "optim",
        "loss",
        "teacher.tail",
        "train.epochs",
        "train.batch_size",
        "train.grad_accum",
        "train.seed",
        "train.precision",
        "train.max_steps_per_epoch",
    ),
    inputs=("student", "tokens", "teacher", "epoch"),
    outputs_problem=_outputs_problem,
)


def checkpoint_root(cfg: RunConfig, student: dict, tokens: dict, teacher: dict) -> Path:
    """<workdir>/train/<training key>: the checkpoints of every epoch of this training setting."""
    key = POLICY.key(cfg, {"student": student, "tokens": tokens, "teacher": teacher})
    return stage_dir(cfg, "train", key)


def _steps_per_epoch(cfg: RunConfig, tokens: dict) -> int:
    n = TokenizeManifest.model_validate(tokens["manifest"]).train.n_sequences
    steps = max(1, math.ceil(n / cfg.train.sequences_per_step))
    return min(steps, cfg.train.max_steps_per_epoch or steps)


@task(**stage_options(POLICY, task_run_name="train-epoch-{epoch}"))
def train_epoch(
    cfg: RunConfig,
    student: dict[str, Any],
    tokens: dict[str, Any],
    teacher: dict[str, Any],
    epoch: int,
    mlflow_run_id: str | None = None,
) -> dict[str, Any]:
    """Train epoch `epoch` (0-based).

    Returns {"dir": <the epoch-end checkpoint>, "manifest": CheckpointManifest as JSON}.
    """
    from training.engines import upload_stats
    from training.loop import epoch_dir
    from training.loop import train_epoch as gpu_train_epoch

    cfg = as_config(cfg)
    log = get_run_logger()
    root = checkpoint_root(cfg, student, tokens, teacher)
    root.mkdir(parents=True, exist_ok=True)
    steps_file = root / STEPS_FILE
    mlflow_steps = step_logger(cfg, mlflow_run_id)
    last_log = [time.monotonic()]
    with bar(f"train epoch {epoch}", _steps_per_epoch(cfg, tokens)) as b, open(steps_file, "a") as fh:

        def on_step(rec: Any) -> None:
            row = {k: getattr(rec, k) for k in rec.__dataclass_fields__}
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            mlflow_steps.log(row)
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
            faults.check("train.step", rec.step)

        try:
            manifest = gpu_train_epoch(
                cfg,
                student_gguf=student_path(cfg, student),
                token_dir=located(cfg, tokens["dir"]),
                topk_dir=located(cfg, teacher["dir"]),
                ckpt_root=root,
                epoch=epoch,
                on_step=on_step,
            )
        finally:
            mlflow_steps.flush()
    log.info("epoch %d done: %s; upload %s", epoch, manifest.metrics, upload_stats())
    return {"dir": relative(cfg, epoch_dir(root, epoch)), "manifest": manifest.model_dump(mode="json")}


def read_steps(cfg: RunConfig, checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The step records of a training setting (steps.jsonl next to its checkpoints), the last record of each
    step kept (a resumed run logs the steps after its checkpoint again)."""
    path = located(cfg, checkpoint["dir"]).parent / STEPS_FILE
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
