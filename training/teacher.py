"""The teacher function of the top-k stage: ids -> top-k ids, logprobs, tail (numpy or GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from schemas.config import RunConfig
from training.engines import get_device, load_student


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
