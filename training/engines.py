"""The engines that train and evaluate a student (training.engine.Engine), built from the run config, and the
process-wide caches behind them: one GPU device and one uploaded model (the student, or the GPU teacher) per
process (GPU memory does not outlive a process), or one float32 copy in host memory for the numpy engine. An
engine is a trunk built from an EngineSpec with an objective plugged in (KD here, preference in
training/preference.py): objective_engine builds either on either backend.

train.backend picks the engine: gpu (gpu/student.py's GPUStudent, wgpu kernels), numpy (cpu.NumpyEngine, float32
through BLAS), or auto (numpy when the only adapter is a CPU, such as lavapipe, or there is none; else gpu).
gpu/ is imported lazily, so a numpy run neither imports wgpu's device code paths nor needs an adapter.
"""

from __future__ import annotations

import gc
import logging
import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.config import ModelConfig
from model.engine_spec import EngineSpec
from model.kd import LossConfig
from schemas.config import RunConfig
from schemas.optim import AdamWConfig
from training.engine import Engine

if TYPE_CHECKING:
    import numpy as np

    from gpu.device import Device
    from gpu.model import ModelWeights

log = logging.getLogger(__name__)

# ---- one device, one uploaded student per process ---------------------------------------------------------
_DEVICES: dict[str, Device] = {}
_GPU_WEIGHTS: dict[tuple, ModelWeights] = {}
_HOST_WEIGHTS: dict[tuple, tuple[Any, dict[str, np.ndarray]]] = {}
_UPLOAD_STATS: dict[str, float] = {}
_LOGGED: set[tuple[str, str, str]] = set()


def get_device(backend: str = "auto", probe: bool = False) -> Device:
    """The process's Device for `backend` (auto, wgpu, dawn), created once. `probe`: asked only to choose an
    engine, so a CPU adapter's slow-kernels warning is not shown (auto then picks numpy, not the kernels)."""
    from gpu.device import Device

    if backend not in _DEVICES:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            if probe:
                warnings.filterwarnings("ignore", "GPU: no discrete GPU", RuntimeWarning)
            _DEVICES[backend] = Device(None if backend == "auto" else backend)
    return _DEVICES[backend]


def _file_key(path: Path, *extra: object) -> tuple:
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, *extra)


def _record_upload(t0: float, nbytes: int) -> None:
    dt = time.perf_counter() - t0
    _UPLOAD_STATS.clear()
    _UPLOAD_STATS.update(
        seconds=dt,
        bytes=float(nbytes),
        gib_per_s=nbytes / dt / 2**30 if dt > 0 else 0.0,
        host_peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def load_gpu_weights(path: Path, backend: str = "auto", progress: Callable[[Any], None] | None = None) -> ModelWeights:
    """Stream the GGUF at `path` into GPU memory once per process (keyed by path, size, mtime, backend)."""
    from gpu.model import ModelWeights

    key = _file_key(path, backend)
    if key not in _GPU_WEIGHTS:
        dev = get_device(backend)
        t0 = time.perf_counter()
        weights = ModelWeights.from_gguf(dev, path, progress=progress)
        dev.sync()
        _record_upload(t0, weights.nbytes)
        _GPU_WEIGHTS.clear()  # one model resident at a time
        _GPU_WEIGHTS[key] = weights
    return _GPU_WEIGHTS[key]


def load_host_weights(path: Path, progress: Callable[[Any], None] | None = None) -> tuple[Any, dict[str, np.ndarray]]:
    """(ModelConfig, {GGUF name: float32 array}) of the GGUF at `path`, dequantized once per process (keyed by
    path, size, mtime): what the numpy engine trains on; progress(info) after each tensor."""
    from model.gguf import GGUFFile

    key = _file_key(path)
    if key not in _HOST_WEIGHTS:
        t0 = time.perf_counter()
        with GGUFFile(path) as f:
            cfg, weights = f.config(), {}
            for name, info in f.tensors.items():
                weights[name] = f.tensor_f32(name)
                if progress is not None:
                    progress(info)
        _record_upload(t0, sum(a.nbytes for a in weights.values()))
        _HOST_WEIGHTS.clear()  # one model resident at a time
        _HOST_WEIGHTS[key] = (cfg, weights)
    return _HOST_WEIGHTS[key]


def upload_stats() -> dict[str, float]:
    """Timing of the last student load (GPU upload or host dequantization): seconds, bytes, GiB/s, peak RSS."""
    return dict(_UPLOAD_STATS)


# ---- which engine ------------------------------------------------------------------------------------------
def resolve_backend(choice: str, gpu_backend: str = "auto", what: str = "train.backend") -> tuple[str, str]:
    """(gpu | numpy, why) for a backend setting `choice` (auto, gpu, numpy); auto asks wgpu for an adapter:
    numpy when there is none or it is a CPU (BLAS beats a CPU Vulkan driver), gpu otherwise."""
    if choice in ("gpu", "numpy"):
        return choice, f"{what}={choice}"
    if choice != "auto":
        raise ValueError(f"{what}: {choice!r}: expected auto, gpu or numpy")
    from gpu.device import DeviceError

    try:
        dev = get_device(gpu_backend, probe=True)
    except DeviceError as exc:
        return "numpy", f"{what}=auto and no GPU adapter ({exc})"
    if dev.is_cpu:
        return "numpy", f"{what}=auto and the only adapter is a CPU ({dev.adapter.summary}): numpy/BLAS is faster"
    return "gpu", f"{what}=auto and a GPU adapter ({dev.adapter.summary})"


def chosen_backend(cfg: RunConfig) -> str:
    """The engine backend of this run (gpu or numpy); the choice and its reason are logged once per process."""
    backend, why = resolve_backend(cfg.train.backend, cfg.run.gpu_backend)
    if (backend, why, "train") not in _LOGGED:
        _LOGGED.add((backend, why, "train"))
        log.info("engine: %s (%s)", "NumpyEngine (float32, BLAS)" if backend == "numpy" else "GPUStudent (wgpu)", why)
    return backend


def preload_student(cfg: RunConfig, path: Path, progress: Callable[[Any], None] | None = None) -> None:
    """Load the student where this run's engine reads it (GPU memory, or host float32 for numpy), once."""
    if chosen_backend(cfg) == "numpy":
        load_host_weights(path, progress)
    else:
        load_gpu_weights(path, cfg.run.gpu_backend, progress)


# ---- the engine of a run ------------------------------------------------------------------------------------
def loss_config(cfg: RunConfig, eval_mode: bool = False) -> LossConfig:
    """The model/kd.py loss an engine computes: the run's loss for training; forward KL at the teacher
    temperature with the tail bucket for evaluation (the metric every run is compared on: the eval split is
    top-k with tail in both stores)."""
    if eval_mode:
        return LossConfig("forward_kl", tau=cfg.teacher.temperature, use_tail=True)
    if cfg.teacher.store == "sampled":  # the sampled estimate of forward KL over the full vocabulary
        return LossConfig(
            "forward_kl", tau=cfg.teacher.temperature, ce_weight=cfg.loss.ce_weight, samples=cfg.teacher.samples
        )
    beta = cfg.loss.beta if cfg.loss.kind == "jsd" else 0.5
    return LossConfig(
        cfg.loss.kind, tau=cfg.loss.temperature, beta=beta, ce_weight=cfg.loss.ce_weight, use_tail=cfg.teacher.tail
    )


def teacher_width(cfg: RunConfig, split: str = "train") -> int:
    """Teacher ids per position of a KdBatch of split `split`: teacher.top_k, or teacher.samples for the sampled
    store's train split (its distinct ids padded to that width with count 0; its eval split is top-k)."""
    return cfg.teacher.samples if cfg.teacher.store == "sampled" and split == "train" else cfg.teacher.top_k


def adamw_config(cfg: RunConfig) -> AdamWConfig:
    """The optimizer settings every engine gets from the run's optim section."""
    o = cfg.optim
    return AdamWConfig(
        lr=o.lr, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.grad_clip
    )


def build_engine(
    cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool = False, start_layer: int = 0
) -> Engine:
    """The KD engine for `cfg` on the student at `student_gguf`, for batches of cfg.train.batch_size sequences of
    seq_len tokens; eval_mode builds it for evaluate_batch (evaluation loss, no gradient accumulation).
    start_layer > 0: the forward starts at that block from the residual stream given to write_batch (the
    frozen-prefix cache); it must not exceed the lowest adapted block. train.backend picks the engine."""
    field = "eval.precision" if eval_mode else "train.precision"
    precision = eval_precision(cfg) if eval_mode else train_precision(cfg)
    if chosen_backend(cfg) == "numpy" and precision in ("tensorcore", "int8"):
        raise ValueError(f"{field}: {precision} needs the GPU engine (train.backend=gpu); numpy computes in f32")
    loss, k = loss_config(cfg, eval_mode), teacher_width(cfg, "eval" if eval_mode else "train")
    grad_accum = 1 if eval_mode else None

    def spec(model_cfg: ModelConfig) -> EngineSpec:
        return EngineSpec.from_run(
            cfg, model_cfg, seq_len, grad_accum=grad_accum, start_layer=start_layer, precision=precision
        )

    return objective_engine(
        cfg,
        student_gguf,
        spec,
        numpy_objective=lambda: _cpu().NumpyKd(loss, k),
        gpu_objective=lambda: _gpu_objectives().GpuKd(loss, k),
    )


def train_precision(cfg: RunConfig) -> str:
    """The distillation student's training precision: train.precision, auto resolved on the GPU engine's device
    (gpu/model.py student_precision: int8 where the GPU has integer subgroup matrices); logged once."""
    if cfg.train.precision != "auto" or chosen_backend(cfg) == "numpy":
        return cfg.train.precision
    from gpu.model import student_precision

    precision = student_precision(get_device(cfg.run.gpu_backend), "auto")
    if ("precision", "auto", precision) not in _LOGGED:
        _LOGGED.add(("precision", "auto", precision))
        log.info("train.precision auto: %s on this GPU (the held-out evaluation: eval.precision)", precision)
    return precision


def eval_precision(cfg: RunConfig) -> str:
    """The held-out evaluation's precision (eval.precision): the training's (train: as trained, auto resolved),
    except that auto evaluates int8 training on the tensor cores (and auto training as auto: tensorcore)."""
    choice = cfg.eval.precision
    if choice == "train":
        return train_precision(cfg)
    if choice == "auto":
        return "tensorcore" if cfg.train.precision == "int8" else cfg.train.precision
    return choice


def objective_engine(
    cfg: RunConfig,
    gguf: Path,
    spec: Callable[[ModelConfig], EngineSpec],
    numpy_objective: Callable[[], Any],
    gpu_objective: Callable[[], Any],
    backend: str | None = None,
) -> Any:
    """The engine on the GGUF at `gguf` for the spec `spec(model config)`, with the objective of its backend:
    train.backend's (chosen_backend), or `backend` when given. The GPU engine refuses a batch whose buffers
    exceed the adapter's limits, naming the fields that size it."""
    if (backend or chosen_backend(cfg)) == "numpy":
        from cpu import NumpyEngine

        model_cfg, weights = load_host_weights(gguf)
        return NumpyEngine(weights, spec(model_cfg), numpy_objective(), adamw_config(cfg))
    from gpu.device import DeviceError
    from gpu.student import GPUStudent

    device, weights = get_device(cfg.run.gpu_backend), load_gpu_weights(gguf, cfg.run.gpu_backend)
    built = spec(weights.cfg)
    # an earlier engine's GPU buffers (its objective refers back to it: a cycle) are freed before this one sizes its
    # kept blocks from what the process holds
    gc.collect()
    try:
        engine = GPUStudent(
            device,
            weights,
            built,
            gpu_objective(),
            adamw_config(cfg),
            kept_blocks=cfg.train.kept_blocks,
            memory_share=cfg.scale.gpus_per_worker if cfg.train.workers > 1 else 1.0,
            int8_codes=cfg.train.int8_codes,
        )
    except DeviceError as exc:
        if "exceeds this adapter" not in str(exc):
            raise
        raise ValueError(
            f"train.batch_size: {built.batch} sequences of data.seq_len {built.seq_len} on {gguf}: "
            f"{exc}; lower train.batch_size or data.seq_len, or set train.backend=numpy"
        ) from None
    _log_kept_blocks(cfg, engine)
    return engine


def _log_kept_blocks(cfg: RunConfig, engine: Any) -> None:
    """Log, once per setting and outcome, how many blocks the GPU engine keeps and what they cost."""
    from gpu.kept_blocks import kept_bytes_per_token

    kept, setting = engine.kept_blocks, cfg.train.kept_blocks
    key = ("kept", str(setting), f"{kept} {engine.resident_codes}")
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    per_token = kept_bytes_per_token(engine.cfg)
    log.info(
        "train.kept_blocks=%s: a training backward keeps %d block(s)' intermediates (%.2f GB, %d bytes a token a "
        "block) and recomputes the other adapted blocks%s",
        setting,
        kept,
        kept * engine.kept_block_bytes() / 1e9,
        per_token,
        "; the int8 codes of every projection are resident (train.int8_codes)" if engine.resident_codes else "",
    )


def _cpu() -> Any:
    import cpu

    return cpu


def _gpu_objectives() -> Any:
    import gpu.objectives

    return gpu.objectives
