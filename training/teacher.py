"""The teacher function of the top-k stage: [N, T] token batches -> top-k ids, logprobs, tail (numpy or GPU).

teacher.backend picks where it runs (auto: numpy when the only adapter is a CPU, as train.backend does). Both
take many sequences per call: the numpy teacher is model.teacher_cpu.reference_topk_batch (float32 forward,
lm_head + top-k over vocabulary chunks, the head skipped where the loss mask is 0), the GPU teacher
gpu.teacher.GPUTeacher over train.batch_size sequences per dispatch (the activation memory of a training step).
teacher.store sampled: model.teacher_cpu.reference_sampled_batch or GPUTeacher.sampled (gpu/ops/sampled.py), the
same rows up to f32 rounding at CDF boundaries (docs/architecture.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.topk import TeacherFn
from schemas.config import RunConfig
from training.engines import get_device, load_gpu_weights, resolve_backend

log = logging.getLogger(__name__)

# Positions per numpy teacher call: ~5 s on 2 cores for SmolLM2-135M (a progress line per call), and a
# [rows, vocab_chunk] float32 logits chunk of 32 MiB.
NUMPY_ROWS_PER_CALL = 1024


@dataclass(frozen=True)
class Teacher:
    """A batched teacher: fn(ids [N, T], mask [N, T]) -> (ids [N, T, k], logprobs [N, T, k], tail [N, T]) at
    cfg.teacher.temperature (rows whose mask is 0 hold anything), best called with about rows_per_call
    positions (N * T) at a time; engine says what computes it (backend: numpy or gpu)."""

    fn: TeacherFn
    rows_per_call: int
    engine: str  # teacher_engine's name of what computes the rows (the plan records and checks it)
    store: str = "topk"  # sampled: fn(ids, mask, seq_ids) -> (ids, logp codes, counts) [N, T, n] (data.topk)

    @property
    def backend(self) -> str:
        """numpy or gpu."""
        return self.engine.split("/", 1)[0]

    def __call__(self, ids: np.ndarray, mask: np.ndarray, *seq_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.fn(ids, mask, *seq_ids)


def teacher_engine(cfg: RunConfig) -> str:
    """What computes this run's teacher rows on this machine, as the teacher plan records and keys it: "numpy"
    (float32 BLAS, whatever train.precision), or "gpu/<wgpu backend>/<precision>" (train.precision resolved on the
    adapter: auto takes tensorcore where Dawn has subgroup matrices). Each writes its own bytes. Where the GPU
    cannot run it, the settings as written: the teacher itself then says why, when it starts."""
    backend, _ = resolve_backend(cfg.teacher.backend, cfg.run.gpu_backend, "teacher.backend")
    if backend == "numpy":
        return "numpy"
    from gpu.device import DeviceError
    from gpu.model import resolve_precision

    try:
        dev = get_device(cfg.run.gpu_backend)
        return f"gpu/{dev.backend}/{resolve_precision(dev, cfg.train.precision)}"
    except DeviceError:
        return f"gpu/{cfg.run.gpu_backend}/{cfg.train.precision}"


def make_teacher_fn(cfg: RunConfig, teacher_gguf: Path, store: str | None = None) -> Teacher:
    """The teacher of cfg.teacher writing store `store` (None: teacher.store; the sampled store's eval split is
    written top-k), numpy or GPU per teacher.backend (the choice is logged)."""
    k, tau = cfg.teacher.top_k, cfg.teacher.temperature
    store = store or cfg.teacher.store
    backend, why = resolve_backend(cfg.teacher.backend, cfg.run.gpu_backend, "teacher.backend")
    log.info("teacher: %s (%s)", backend, why)
    if backend == "numpy":
        from model.teacher_cpu import reference_topk_batch

        mcfg, weights = _numpy_weights(teacher_gguf)
        if store == "sampled":
            from model.teacher_cpu import reference_sampled_batch

            n, seed = cfg.teacher.samples, cfg.teacher.seed

            def sampled_fn(ids: np.ndarray, mask: np.ndarray, seq_ids: np.ndarray) -> tuple[np.ndarray, ...]:
                return reference_sampled_batch(weights, mcfg, np.asarray(ids), n, tau, seed, seq_ids, mask=mask)

            return Teacher(sampled_fn, NUMPY_ROWS_PER_CALL, "numpy", "sampled")  # type: ignore[arg-type]

        def numpy_fn(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return reference_topk_batch(weights, mcfg, np.asarray(ids), k, tau, mask=mask)

        return Teacher(numpy_fn, NUMPY_ROWS_PER_CALL, "numpy")
    from gpu.teacher import GPUTeacher

    weights = load_gpu_weights(teacher_gguf, cfg.run.gpu_backend)
    dev = get_device(cfg.run.gpu_backend)
    batch = cfg.train.batch_size
    engine = teacher_engine(cfg)
    teachers: dict[int, GPUTeacher] = {}

    def gpu_teacher(t: int) -> GPUTeacher:
        if t not in teachers:
            teachers[t] = GPUTeacher(
                dev,
                weights,
                batch=batch,
                seq_len=t,
                top_k=k,
                tau=tau,
                precision=cfg.train.precision,
                int8_codes=cfg.train.int8_codes,
            )
            if teachers[t].resident_codes and len(teachers) == 1:
                gb = sum(m.rows * (m.k + 4) for m in weights.codes_i8.values()) / 1e9
                log.info("teacher: its projections' int8 codes decoded once and kept (%.2f GB, train.int8_codes)", gb)
        return teachers[t]

    def groups(ids: np.ndarray, *per_seq: np.ndarray):
        """The teacher's batches of ids (and of per-sequence arrays): the last padded with zeros, then cut."""
        n, t = ids.shape
        for s in range(0, n, batch):
            m = min(batch, n - s)
            group = np.zeros((batch, t), np.int64)
            group[:m] = ids[s : s + batch]
            extra = [np.zeros(batch, a.dtype) for a in per_seq]
            for e, a in zip(extra, per_seq, strict=True):
                e[:m] = a[s : s + batch]
            yield m, group, extra

    if store == "sampled":
        n_samples, seed = cfg.teacher.samples, cfg.teacher.seed

        def gpu_sampled_fn(ids: np.ndarray, mask: np.ndarray, seq_ids: np.ndarray) -> tuple[np.ndarray, ...]:
            """reference_sampled_batch's rows on the GPU (gpu/ops/sampled.py): positions with mask 0 as zeros."""
            ids = np.asarray(ids)
            teacher = gpu_teacher(ids.shape[1])
            seq_ids = np.asarray(seq_ids, np.int64).reshape(len(ids))
            parts = [
                tuple(a[:m] for a in teacher.sampled(group, seq, n_samples, seed))
                for m, group, (seq,) in groups(ids, seq_ids)
            ]
            out = [np.concatenate(p) for p in zip(*parts, strict=True)]
            dropped = np.asarray(mask).reshape(ids.shape) == 0
            for a in out:
                a[dropped] = 0
            return tuple(out)

        return Teacher(gpu_sampled_fn, batch * cfg.data.seq_len, engine, "sampled")  # type: ignore[arg-type]

    def gpu_fn(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.asarray(ids)
        teacher = gpu_teacher(ids.shape[1])
        parts = []
        for m, group, _ in groups(ids):
            out_ids, lp, tail = teacher.topk(group)
            parts.append((out_ids[:m].astype(np.int64), lp[:m], tail[:m]))
        return tuple(np.concatenate(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]

    return Teacher(gpu_fn, batch * cfg.data.seq_len, engine)


# One teacher per process and store, kept across the shards of a run (loading it is the expensive part); the
# numpy teacher's float32 weights are loaded once for both stores of a sampled run (train sampled, eval top-k).
_TEACHER: dict[tuple, Teacher] = {}
_WEIGHTS: dict[tuple, tuple] = {}


def _numpy_weights(path: Path) -> tuple:
    """(ModelConfig, float32 weights by name) of the GGUF at `path`, loaded once per process (release_teacher)."""
    from model.gguf import GGUFFile

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        with GGUFFile(path) as f:
            _WEIGHTS[key] = (f.config(), {name: f.tensor_f32(name) for name in f.tensors})
    return _WEIGHTS[key]


def teacher_fn(cfg: RunConfig, store: str | None = None) -> Teacher:
    """The process's batched teacher for cfg writing store `store` (None: teacher.store), numpy or GPU per
    teacher.backend, loaded once."""
    path = Path(cfg.model.teacher).resolve()
    st = path.stat()
    t = cfg.teacher
    store = store or t.store
    key = (str(path), st.st_size, st.st_mtime_ns, t.top_k, t.temperature, t.backend, cfg.train.batch_size)
    key += (cfg.train.precision, cfg.train.int8_codes, cfg.run.gpu_backend, store, t.samples, t.seed)
    if key not in _TEACHER:
        if any(k[:-3] != key[:-3] for k in _TEACHER):  # another teacher: drop the old one
            _TEACHER.clear()
        _TEACHER[key] = make_teacher_fn(cfg, path, store)
    return _TEACHER[key]


def release_teacher() -> None:
    """Drop the process's teacher (its weights) once the shards are done."""
    _TEACHER.clear()
    _WEIGHTS.clear()
