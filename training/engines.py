"""The engines that train and evaluate a student (training.engine.Engine), built from the run config, and the
process-wide caches behind the wgpu one: one device and one uploaded student per process (GPU memory does not
outlive a process)."""

from __future__ import annotations

import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu.device import Device
from gpu.model import StudentWeights
from gpu.ops.adamw import AdamWConfig
from gpu.student import GPUStudent
from model.kd import LossConfig
from schemas.config import RunConfig
from training.engine import Engine

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


# ---- the engine of a run ------------------------------------------------------------------------------------
def loss_config(cfg: RunConfig, eval_mode: bool = False) -> LossConfig:
    """The model/kd.py loss an engine computes: the run's loss for training; forward KL at the teacher
    temperature with the tail bucket for evaluation (the metric every run is compared on)."""
    if eval_mode:
        return LossConfig("forward_kl", tau=cfg.teacher.temperature, use_tail=True)
    beta = cfg.loss.beta if cfg.loss.kind == "jsd" else 0.5
    return LossConfig(
        cfg.loss.kind, tau=cfg.loss.temperature, beta=beta, ce_weight=cfg.loss.ce_weight, use_tail=cfg.teacher.tail
    )


def build_engine(cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool = False) -> Engine:
    """The engine for `cfg` on the student at `student_gguf`, for batches of cfg.train.batch_size sequences of
    seq_len tokens; eval_mode builds it for evaluate_batch (evaluation loss, no gradient accumulation).

    The one place a second engine plugs in (cpu.NumpyEngine, float32 numpy for CPUs, satisfies the same
    protocol): choose it here from the config; the loop and evaluation only see the Engine."""
    return _wgpu_engine(cfg, student_gguf, seq_len, eval_mode)


def _wgpu_engine(cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool) -> Engine:
    """gpu/student.py's GPUStudent on the process's device and uploaded student."""
    o = cfg.optim
    return GPUStudent(
        get_device(cfg.run.gpu_backend),
        load_student(student_gguf, cfg.run.gpu_backend),
        targets=cfg.lora.targets,
        r=cfg.lora.r,
        alpha=cfg.lora.alpha,
        batch=cfg.train.batch_size,
        seq_len=seq_len,
        top_k=cfg.teacher.top_k,
        loss=loss_config(cfg, eval_mode),
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
