"""Data-parallel LoRA training on Ray actors (train.workers = N > 1): DataParallelEngine, an Engine whose
micro-batches run on N workers, so training/loop.py drives it as it drives one engine.

Workers: N TrainWorker actors (one GPU each where the cluster has GPUs and train.backend may use one, else one
CPU), each building its own engine with training.engines.build_engine and the run's config: its own device and
student upload (or float32 host copy for numpy). Split: the global batch of a step is its grad_accum micro-batches
of batch_size sequences, as in the 1-worker loop; micro-batch m goes to worker m mod N (N <= grad_accum), which
runs it as accumulate(0) and returns its LoRA gradients (Engine.gradients(): n_params float32, small) and loss.

All-reduce: the driver gathers the per-micro-batch gradients with ray.get and sums them in micro-batch order
(the same float32 additions in the same order as one engine accumulating them), puts the sum in Ray's object
store once, and every worker set_gradients + apply: the same AdamW step on the same state everywhere. Where a
micro-batch's gradient is computed the same way alone as accumulated (NumpyEngine; GPUStudent's f32 path on
lavapipe, tested), the run is bitwise the 1-worker run; checkpoints are interchangeable (resume with any N).
Cost per step: each micro-batch's gradient to the driver and the sum to each worker (n_params * 4 bytes each;
zero-copy reads on one node). Why not ray.util.collective: it needs a gloo/NCCL group per run (pygloo / cupy are
not installed here) and an all-reduce's order of additions is the library's; a fixed-order sum in one process is
what makes the result exact, and for LoRA gradients of a few MB the gather is not the bottleneck.

Failures: a worker that dies (ray.kill, a lost node) is replaced by a new actor that takes the state (adapter,
AdamW moments, applied-step count) of a live worker; the dead worker's micro-batches of the step are rerun on its
replacement. The step's result is unchanged. When no worker survives, the step fails; a rerun resumes from the
newest checkpoint (training/loop.py), as after any crash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig
from model.engine_spec import KdBatch, PairBatch, gradient_state
from model.lora_layout import LoraLayout
from model.reference import LoraPair
from schemas.config import RunConfig
from schemas.optim import StepStats
from training.cluster import absolute_config, connect, resources

log = logging.getLogger(__name__)

MAX_REPLACEMENTS = 8  # workers replaced per run before the run gives up (a cluster that keeps losing them)


class TrainWorker:
    """One data-parallel worker (a Ray actor): its own engine; runs micro-batches and applies summed gradients."""

    def __init__(self, cfg_json: str, student_gguf: str, seq_len: int, start_layer: int) -> None:
        from training.cluster import pin_assigned_gpu
        from training.engines import build_engine

        pin_assigned_gpu()
        cfg = RunConfig.model_validate_json(cfg_json)
        self.engine = build_engine(cfg, Path(student_gguf), seq_len, start_layer=start_layer)
        self.layout = self.engine.layout

    def pid(self) -> int:
        return os.getpid()

    def micro(self, batch: KdBatch) -> tuple[np.ndarray, float, float, float]:
        """Forward + backward of one micro-batch on its own: (gradients [n_params] float32, loss, start, end) with
        start/end the time.time() around it (the driver's timings)."""
        t0 = time.time()
        self.engine.write_batch(batch)
        self.engine.accumulate(0)
        grads = self.engine.gradients()
        return grads["grads"], float(grads["losses"][0]), t0, time.time()

    def evaluate(self, batch: KdBatch) -> dict[str, np.ndarray]:
        """Forward only on `batch`: the engine's evaluate_batch."""
        self.engine.write_batch(batch)
        return self.engine.evaluate_batch()

    def apply(self, summed: Mapping[str, np.ndarray], lr: float) -> tuple[tuple[float, float, bool, float], float]:
        """set_gradients(summed) and one AdamW step: ((grad_norm, clip_scale, skipped, loss), start time)."""
        t0 = time.time()
        self.engine.set_gradients(summed)
        s = self.engine.apply(lr)
        return (float(s.grad_norm), float(getattr(s, "clip_scale", 1.0)), bool(s.skipped), float(s.loss)), t0

    def set_state(self, params: np.ndarray | None, m: np.ndarray | None, v: np.ndarray | None, applied: int) -> None:
        """Load the adapter (flat, the layout's order) and/or the AdamW moments with their applied-step count."""
        if params is not None:
            self.engine.set_adapter(self.layout.unpack(np.asarray(params, np.float32)))
        if m is not None and v is not None:
            self.engine.load_optimizer_state({"m": m, "v": v}, applied)

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(flat adapter, AdamW m, v, applied steps)."""
        optim = self.engine.optimizer_state()
        flat = self.layout.pack(self.engine.get_adapter())
        return flat, optim["m"], optim["v"], int(self.engine.applied_steps)

    def digest(self) -> str:
        """sha256 of the adapter and moments: equal on every worker when their states agree."""
        h = hashlib.sha256()
        for part in self.state()[:3]:
            h.update(np.ascontiguousarray(part, np.float32).tobytes())
        return h.hexdigest()


@dataclass
class _Micro:
    index: int
    batch: KdBatch
    worker: int
    actor: Any  # the worker handle it was sent to (a replaced worker's other micro-batches are only resent)
    ref: Any


class DataParallelEngine:
    """The training Engine of train.workers = N > 1 (see the module docstring); evaluate_batch runs on worker 0."""

    def __init__(self, cfg: RunConfig, student_gguf: Path, seq_len: int, start_layer: int = 0) -> None:
        from model.gguf import GGUFFile

        self.ray = connect(cfg)
        self.n = cfg.train.workers
        self.grad_accum = cfg.train.grad_accum
        with GGUFFile(student_gguf) as f:
            self._cfg: ModelConfig = f.config()
        self._layout = LoraLayout.build(self._cfg, cfg.lora.targets, cfg.lora.r, cfg.lora.layers)
        options = resources(cfg.train.backend, "train.backend", cfg.scale.gpus_per_worker)
        self._actor = self.ray.remote(max_restarts=0, max_task_retries=0, **options)(TrainWorker)
        self._args = (absolute_config(cfg).model_dump_json(), str(Path(student_gguf).resolve()), seq_len, start_layer)
        self.workers = [self._actor.remote(*self._args) for _ in range(self.n)]
        self.pids = self.ray.get([w.pid.remote() for w in self.workers])  # built: fails here, not at step 1
        log.info("data-parallel: %d workers (%s each), pids %s", self.n, options, self.pids)
        self.applied_steps = 0
        self.skipped_steps = 0
        self.replaced = 0
        self._batch: KdBatch | None = None
        self._summed: dict[str, np.ndarray] | None = None  # the step's gathered (or given) gradient sum
        self._gathered: dict[str, float] = {}  # the timings of its gather
        self._step: list[_Micro] = []
        self._t_step = 0.0
        self.timings: list[dict[str, float]] = []  # per step: where the time went (the all-reduce cost)

    # ---- Engine: model and adapter state -----------------------------------------------------------------
    @property
    def cfg(self) -> ModelConfig:
        return self._cfg

    @property
    def layout(self) -> LoraLayout:
        return self._layout

    def _each(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker and return the results in worker order. A worker that died is replaced
        by one holding the state of a live worker after the call, and gets that worker's result."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        results: list[Any] = [None] * self.n
        dead = []
        for i, ref in enumerate(refs):
            try:
                results[i] = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None
            except self.ray.exceptions.RayError as exc:
                dead.append((i, exc))
        live = [i for i in range(self.n) if all(i != j for j, _ in dead)]
        for i, exc in dead:
            self._replace(i, exc, source=live[0] if live else None)
            results[i] = results[live[0]]
        return results

    def set_adapter(self, adapter: Mapping[tuple[int, str], LoraPair]) -> None:
        self._each("set_state", self.ray.put(self._layout.pack(adapter)), None, None, 0)

    def get_adapter(self) -> dict[tuple[int, str], LoraPair]:
        return self._layout.unpack(np.array(self._state()[0]))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        _, m, v, _ = self._state()
        return {"m": np.array(m), "v": np.array(v)}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray], applied_steps: int) -> None:
        m, v = (np.asarray(state[k], np.float32).reshape(-1) for k in ("m", "v"))
        self._each("set_state", None, m, v, applied_steps)
        self.applied_steps = applied_steps

    def _state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The state of the first live worker (all agree: checked by digests here)."""
        digests = self._each("digest")
        if len(set(digests)) != 1:
            raise RuntimeError(f"data-parallel workers disagree on the adapter/optimizer state: {digests}")
        return self.ray.get(self.workers[0].state.remote())

    # ---- Engine: a step --------------------------------------------------------------------------------------
    def write_batch(self, batch: KdBatch | PairBatch) -> None:
        """Keep the micro-batch for the worker accumulate() sends it to (the KD objective: a KdBatch)."""
        if not isinstance(batch, KdBatch):
            raise TypeError(f"DataParallelEngine trains KD: it takes a KdBatch, not {type(batch).__name__}")
        self._batch = batch

    def accumulate(self, micro: int) -> None:
        """Send the written micro-batch to worker micro mod N (it starts at once; the loop prepares the next)."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{self.grad_accum - 1}")
        if self._batch is None:
            raise RuntimeError("DataParallelEngine: call write_batch() before accumulate()")
        if micro == 0:
            self._step = []
            self._t_step = time.time()
        batch = self._batch
        w = micro % self.n
        actor = self.workers[w]
        self._step.append(_Micro(micro, batch, w, actor, actor.micro.remote(batch)))
        self._batch = None

    def _gather(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The step's micro-batch gradients gathered in micro-batch order (the order one engine accumulates in)
        and summed, with their losses; and the timings of the gather."""
        if len(self._step) != self.grad_accum:
            raise RuntimeError(f"apply after {len(self._step)} of {self.grad_accum} micro-batches")
        total: np.ndarray | None = None
        losses = np.zeros(self.grad_accum, np.float32)
        t_start, gather, compute, reduce = time.time(), 0.0, 0.0, 0.0
        for m in self._step:
            grads, loss, t0, t1 = self._micro_result(m)
            t_got = time.time()
            gather += max(0.0, t_got - max(t1, t_start))  # result ready -> here: its transfer to the driver
            compute = max(compute, t1 - t0)
            if total is None:
                total = np.array(grads, np.float32)  # a writable copy of micro-batch 0's gradients
            else:
                total += grads
            losses[m.index] = loss
            reduce += time.time() - t_got
        return {"grads": total, "losses": losses}, {"gather": gather, "compute": compute, "reduce": reduce}

    def gradients(self) -> dict[str, np.ndarray]:
        """The step's gradients summed over its micro-batches (gathered from the workers) and their losses."""
        if self._summed is None:
            self._summed, self._gathered = self._gather()
        return {name: value.copy() for name, value in self._summed.items()}

    def set_gradients(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the step's summed gradients and losses: apply(lr) then steps every worker on them."""
        grads, losses = gradient_state(state, self.layout.n_params, self.grad_accum)
        self._summed, self._gathered = {"grads": grads.copy(), "losses": losses.copy()}, {}

    def apply(self, lr: float) -> StepStats:
        """Gather the step's micro-batch gradients in order, sum them, and have every worker take the AdamW step."""
        if self._summed is None:
            self._summed, self._gathered = self._gather()
        state, timing = self._summed, self._gathered
        self._summed = None
        t_put = time.time()
        summed = self.ray.put(state)
        t_sent = time.time()
        applied = self._each("apply", summed, lr)
        results = [r for r, _ in applied]
        if len({repr(r) for r in results}) != 1:  # repr: a skipped step's NaN norm equals itself
            raise RuntimeError(f"data-parallel workers took different steps: {results}")
        self.timings.append(
            {
                "gather_s": timing.get("gather", 0.0),  # micro-batch gradients to the driver (beyond their computation)
                "sum_s": timing.get("reduce", 0.0) + (t_sent - t_put),  # the ordered sum and its put into the store
                "broadcast_s": max(0.0, max(t0 for _, t0 in applied) - t_sent),  # the sum to the last worker
                "micro_compute_s": timing.get("compute", 0.0),
                "step_s": time.time() - self._t_step,  # accumulate(0) -> every worker stepped
            }
        )
        grad_norm, clip_scale, skipped, loss = results[0]
        if skipped:
            self.skipped_steps += 1
        else:
            self.applied_steps += 1
        self._step = []
        return StepStats(grad_norm, clip_scale, skipped, loss)

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """Forward only on the written batch, on worker 0's engine: a training engine, so kd_loss is the run's
        training loss (held-out evaluation builds an evaluation engine of its own, training/evaluation.py)."""
        if self._batch is None:
            raise RuntimeError("DataParallelEngine: call write_batch() before evaluate_batch()")
        return self.ray.get(self.workers[0].evaluate.remote(self._batch))

    # ---- failures ----------------------------------------------------------------------------------------------
    def _micro_result(self, m: _Micro) -> tuple[np.ndarray, float, float, float]:
        while True:
            try:
                return self.ray.get(m.ref)
            except self.ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None
            except self.ray.exceptions.RayError as exc:  # the worker died: replace it, rerun the micro-batch
                if self.workers[m.worker] is m.actor:  # not yet replaced (by an earlier micro-batch's failure)
                    self._replace(m.worker, exc)
                m.actor = self.workers[m.worker]
                m.ref = m.actor.micro.remote(m.batch)

    def _replace(self, i: int, exc: Exception, source: int | None = -1) -> None:
        """Replace dead worker i by a new actor holding the state of live worker `source` (-1: any live one)."""
        self.replaced += 1
        if self.replaced > MAX_REPLACEMENTS:
            raise RuntimeError(f"data-parallel: {self.replaced} workers lost in this run; giving up ({exc})")
        if source == -1:
            source = next((j for j in range(self.n) if j != i and self._alive(j)), None)
        if source is None:
            raise RuntimeError(
                f"data-parallel: every worker died ({exc}); rerun: training resumes from the newest checkpoint"
            )
        log.warning("data-parallel worker %d died (%s): replaced, state from worker %d", i, type(exc).__name__, source)
        params, m, v, applied = self.ray.get(self.workers[source].state.remote())
        self.ray.kill(self.workers[i], no_restart=True)
        self.workers[i] = self._actor.remote(*self._args)
        self.ray.get(self.workers[i].set_state.remote(params, m, v, applied))

    def _alive(self, j: int) -> bool:
        try:
            self.ray.get(self.workers[j].pid.remote(), timeout=60)
            return True
        except self.ray.exceptions.RayError:
            return False

    def close(self) -> None:
        """End the workers (their engines and devices)."""
        for w in self.workers:
            self.ray.kill(w, no_restart=True)
        self.workers = []


def _cause(exc: Any) -> Exception:
    """What a worker method raised (e.g. TrainingDiverged, a ValueError naming a config field)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else RuntimeError(str(exc))


def build(cfg: RunConfig, student_gguf: Path, seq_len: int, start_layer: int = 0) -> DataParallelEngine:
    """The data-parallel engine of cfg (train.workers workers on the cluster of scale.ray_address)."""
    return DataParallelEngine(cfg, student_gguf, seq_len, start_layer)
