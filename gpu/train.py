"""Training and evaluation over token + top-k shards: epochs, LR schedule, checkpoints, bitwise resume.

Library code (no prefect / mlflow): tasks/ wraps these. One process holds one Device and uploads a student once
(the process-wide loader below); GPU memory does not outlive the process, so every task re-uploads on start.
"""

from __future__ import annotations

import math
import resource
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from data.tokens import read_token_split
from data.topk import TopkReader
from gpu.device import Device
from gpu.ops.adamw import AdamWConfig
from gpu.student import GPUStudent, StudentWeights
from model import reference
from model.kd import LossConfig
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest

# ---- one device, one uploaded student per process ---------------------------------------------------------
_DEVICES: dict[str, Device] = {}
_STUDENTS: dict[tuple, StudentWeights] = {}
_UPLOAD_STATS: dict[str, float] = {}


def get_device(backend: str = "auto") -> Device:
    """The process's Device for `backend` (auto, wgpu, dawn), created once."""
    if backend not in _DEVICES:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            _DEVICES[backend] = Device(None if backend == "auto" else backend)
    return _DEVICES[backend]


def load_student(path: Path, backend: str = "auto", progress: Callable[[Any], None] | None = None) -> StudentWeights:
    """Stream the GGUF at `path` into GPU memory once per process (keyed by path, size, mtime, backend)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, backend)
    if key not in _STUDENTS:
        dev = get_device(backend)
        t0 = time.perf_counter()
        weights = StudentWeights.from_gguf(dev, path, progress=progress)
        dev.sync()
        dt = time.perf_counter() - t0
        _UPLOAD_STATS.clear()
        _UPLOAD_STATS.update(
            seconds=dt,
            bytes=float(weights.nbytes),
            gib_per_s=weights.nbytes / dt / 2**30 if dt > 0 else 0.0,
            host_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
        _STUDENTS.clear()  # one student resident at a time
        _STUDENTS[key] = weights
    return _STUDENTS[key]


def upload_stats() -> dict[str, float]:
    """Timing of the last student upload: seconds, bytes, GiB/s, host peak RSS (MiB)."""
    return dict(_UPLOAD_STATS)


# ---- teacher ----------------------------------------------------------------------------------------------
def make_teacher_fn(cfg: RunConfig, teacher_gguf: Path) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    """ids [T] -> (top-k ids [T, k], logprobs [T, k], tail [T]) at cfg.teacher.temperature.

    numpy (BLAS) or the GPU per cfg.teacher.backend; auto picks numpy when the only adapter is a CPU."""
    k, tau = cfg.teacher.top_k, cfg.teacher.temperature
    backend = cfg.teacher.backend
    if backend == "auto":
        backend = "numpy" if get_device(cfg.run.gpu_backend).is_cpu else "gpu"
    if backend == "numpy":
        from model.gguf import GGUFFile
        from model.teacher_cpu import reference_topk

        with GGUFFile(teacher_gguf) as f:
            mcfg = f.config()
            weights = {name: f.tensor_f32(name) for name in f.tensors}
        return lambda ids: reference_topk(weights, mcfg, np.asarray(ids), k, tau)
    from gpu.teacher import GPUTeacher

    weights = load_student(teacher_gguf, cfg.run.gpu_backend)
    dev = get_device(cfg.run.gpu_backend)
    teachers: dict[int, GPUTeacher] = {}

    def run(ids: np.ndarray) -> tuple[np.ndarray, ...]:
        t = len(ids)
        if t not in teachers:
            teachers[t] = GPUTeacher(dev, weights, batch=1, seq_len=t, top_k=k, tau=tau, precision=cfg.train.precision)
        out_ids, lp, tail = teachers[t].topk(np.asarray(ids)[None])
        return out_ids[0].astype(np.int64), lp[0], tail[0]

    return run


# ---- data -------------------------------------------------------------------------------------------------
@dataclass
class _Split:
    seq_ids: np.ndarray  # [N]
    ids: np.ndarray  # [N, T]
    mask: np.ndarray  # [N, T]


def _read_split(token_dir: Path, split: str) -> _Split:
    ds = read_token_split(token_dir, split).with_format("numpy")
    ids = np.stack(ds["input_ids"]) if len(ds) else np.zeros((0, 0), np.int64)
    mask = np.stack(ds["loss_mask"]) if len(ds) else np.zeros((0, 0), np.uint8)
    return _Split(np.asarray(ds["seq_id"]), ids.astype(np.int64), mask.astype(np.uint8))


def _batch_arrays(split: _Split, rows: np.ndarray, batch: int, reader: TopkReader, k: int) -> tuple[np.ndarray, ...]:
    """Dense [B, T] inputs for GPUStudent.write_batch; missing rows (the last partial batch) are masked out."""
    t = split.ids.shape[1]
    ids = np.zeros((batch, t), np.int64)
    mask = np.zeros((batch, t), np.uint8)
    ids[: len(rows)] = split.ids[rows]
    mask[: len(rows)] = split.mask[rows]
    targets = np.zeros((batch, t), np.int64)
    targets[:, :-1] = ids[:, 1:]
    tids = np.zeros((batch, t, k), np.int64)
    tlp = np.zeros((batch, t, k), np.float32)
    tail = np.zeros((batch, t), np.float32)
    if len(rows):
        top = reader.read(split.seq_ids[rows].tolist(), masks=list(split.mask[rows]))
        b_idx, t_idx = np.nonzero(mask)
        tids[b_idx, t_idx] = top.ids
        tlp[b_idx, t_idx] = top.logprobs
        tail[b_idx, t_idx] = top.tail
    return ids, targets, mask, tids, tlp, tail


# ---- schedule ---------------------------------------------------------------------------------------------
def learning_rate(cfg: RunConfig, step: int, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based): linear warmup, then cosine / linear / constant to min_lr_ratio."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    if o.schedule == "constant":
        return o.lr
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if o.schedule == "cosine" else 1 - frac
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * decay)


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


def _student(cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool = False) -> GPUStudent:
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
    train = _read_split(token_dir, "train")
    if len(train.seq_ids) == 0:
        raise ValueError(f"{token_dir}: the train split is empty: nothing to train on")
    reader = TopkReader(topk_dir)
    st = _student(cfg, student_gguf, train.ids.shape[1])
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
            batch = _batch_arrays(train, part, cfg.train.batch_size, reader, cfg.teacher.top_k)
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


# ---- evaluation -------------------------------------------------------------------------------------------
def _eval_batches(cfg: RunConfig, split: _Split) -> Iterator[np.ndarray]:
    b = cfg.train.batch_size
    n_batches = math.ceil(len(split.seq_ids) / b)
    if cfg.eval.eval_batches:
        n_batches = min(n_batches, cfg.eval.eval_batches)
    for i in range(n_batches):
        yield np.arange(i * b, min((i + 1) * b, len(split.seq_ids)))


def evaluate(
    cfg: RunConfig, *, student_gguf: Path, token_dir: Path, topk_dir: Path, checkpoint: Path | None
) -> dict[str, float]:
    """Held-out forward KL(teacher || student) over the top-k + tail, top-1 agreement, CE and perplexity.

    checkpoint None evaluates the student without an adapter (the baseline)."""
    split = _read_split(token_dir, "eval")
    if len(split.seq_ids) == 0:
        raise ValueError(f"{token_dir}: the eval split is empty (raise data.eval_fraction)")
    reader = TopkReader(topk_dir)
    st = _student(cfg, student_gguf, split.ids.shape[1], eval_mode=True)
    if checkpoint is None:
        st.set_adapter(
            {
                key: reference.LoraPair(
                    np.zeros((st.layout.r, s.d_in), np.float32), np.zeros((s.d_out, st.layout.r), np.float32)
                )
                for key, s in st.layout.slots.items()
            }
        )
    else:
        st.set_adapter(load_checkpoint(checkpoint)[0])
    tau2 = cfg.teacher.temperature**2
    kl_sum = ce_sum = top1 = n = 0.0
    for rows in _eval_batches(cfg, split):
        ids, targets, mask, tids, tlp, tail = _batch_arrays(
            split, rows, cfg.train.batch_size, reader, cfg.teacher.top_k
        )
        st.write_batch(ids, targets, mask, tids, tlp, tail)
        out = st.evaluate_batch()
        m = mask.reshape(-1) != 0
        count = int(m.sum())
        kl_sum += float(out["kd_loss"][0]) * count / tau2
        ce_sum += float(out["ce"][m].sum())
        top1 += float((out["top1"][m] == tids.reshape(-1, cfg.teacher.top_k)[m, 0]).sum())
        n += count
    if n == 0:
        raise ValueError(f"{token_dir}: the eval split has no trained positions")
    ce = ce_sum / n
    return {"kl": kl_sum / n, "top1": top1 / n, "ce": ce, "ppl": float(math.exp(min(ce, 50.0))), "tokens": n}
