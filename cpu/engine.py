"""NumpyEngine: LoRA training on the CPU at BLAS speed, the training/evaluation API of GPUStudent. It is the trunk
(forward, backward, parameters, AdamW); what it optimises is the objective plugged into it (cpu/objectives.py: KD
or a preference loss), built from an EngineSpec (model/engine_spec.py).

The math is model/reference.py's op pairs (block_forward / block_backward, batched over [B, T] in float32: every
projection is one [B*T, in] x [in, out] GEMM) and the objective's head, with the lm_head chunked over
the vocabulary (cpu/head.py). Parameters, gradients and AdamW moments live in flat float32 arrays laid out like
GPUStudent's (model.lora_layout.LoraLayout), so adapters, gradients and optimizer state are interchangeable.

Memory: the per-block caches of the adapted blocks are kept from the forward for the backward when they fit in
`activation_budget` bytes; otherwise only each adapted block's input is kept and the block is recomputed from it
before its backward (layer-input checkpointing, as on the GPU). The backward stops at the lowest adapted block.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cpu.adamw import NumpyAdamW
from cpu.head import VocabHead
from cpu.objectives import Batch, NumpyObjective
from cpu.weights import check_weights, load_gguf_f32
from model import reference as R
from model.config import ModelConfig
from model.engine_spec import EngineSpec, KdBatch, PairBatch, gradient_state
from schemas.optim import AdamWConfig, StepStats

ACTIVATION_BUDGET = 2 << 30  # bytes of block caches kept between forward and backward before recomputing


class NumpyEngine:
    """Training and evaluation of LoRA on a frozen float32 student held in host memory, for `spec`'s shapes,
    optimising `objective` (cpu/objectives.py) with AdamW (`optim`)."""

    precision = "f32"

    def __init__(
        self,
        weights: Mapping[str, np.ndarray],
        spec: EngineSpec,
        objective: NumpyObjective,
        optim: AdamWConfig | None = None,
        *,
        activation_budget: int = ACTIVATION_BUDGET,
        source: str = "NumpyEngine weights",
    ) -> None:
        if spec.precision not in ("f32", "auto"):
            raise ValueError(
                f"precision {spec.precision!r}: the numpy engine computes in f32 (train.precision: f32 or auto)"
            )
        cfg = spec.cfg
        self.spec, self.cfg, self.w = spec, cfg, check_weights(cfg, weights, source)
        self.layout = spec.layout()
        if self.layout.n_params == 0:
            raise ValueError("NumpyEngine needs at least one LoRA target")
        if not 0 <= spec.start_layer <= self.layout.lowest_layer:
            raise ValueError(
                f"start_layer={spec.start_layer}: must be a block at or below the lowest adapted block "
                f"{self.layout.lowest_layer} (blocks below it carry no LoRA)"
            )
        self.start_layer = spec.start_layer  # > 0: the forward starts here from the prefix write_batch gets
        self.scale = spec.scale
        self.batch, self.seq_len, self.rows, self.grad_accum = spec.batch, spec.seq_len, spec.rows, spec.grad_accum
        self.head = VocabHead(R.lm_head_weight(self.w), spec.vocab_chunk)
        self.params = np.zeros(self.layout.n_params, np.float32)
        self.grads = np.zeros(self.layout.n_params, np.float32)
        self.optim = NumpyAdamW(self.layout.n_params, optim or AdamWConfig())
        self._lora = self._views(self.params)  # LoraPairs viewing self.params: updates need no re-pack
        self.losses = np.zeros(spec.grad_accum, np.float32)
        self.applied_steps = 0
        self.skipped_steps = 0
        adapted = cfg.n_layers - self.layout.lowest_layer
        self.keep_caches = adapted * self.rows * _cache_floats(cfg) * 4 <= activation_budget
        self._batch: Batch | None = None
        self.objective = objective
        objective.bind(self)

    @classmethod
    def from_gguf(
        cls, path: str | Path, objective: NumpyObjective, optim: AdamWConfig | None = None, **spec: Any
    ) -> NumpyEngine:
        """The engine on the GGUF at `path`, dequantized once to float32; `spec`: EngineSpec's fields but cfg."""
        cfg, weights = load_gguf_f32(path)
        return cls(weights, EngineSpec(cfg, **spec), objective, optim, source=str(path))

    # ---- parameters ------------------------------------------------------------------------------------
    def _views(self, flat: np.ndarray) -> dict[tuple[int, str], R.LoraPair]:
        r = self.layout.r
        return {
            key: R.LoraPair(
                flat[s.a_off : s.a_off + r * s.d_in].reshape(r, s.d_in),
                flat[s.b_off : s.b_off + s.d_out * r].reshape(s.d_out, r),
            )
            for key, s in self.layout.slots.items()
        }

    def set_adapter(self, adapter: Mapping[tuple[int, str], R.LoraPair]) -> None:
        """Load an adapter (a mergeable engine refuses an A that is not group-constant)."""
        if self.spec.lora_group:
            for key, pair in adapter.items():
                R.check_group_constant(np.asarray(pair.A), self.spec.lora_group, f"adapter {key}")
        self.params[:] = self.layout.pack(adapter)

    def get_adapter(self) -> dict[tuple[int, str], R.LoraPair]:
        return self.layout.unpack(self.params)

    def get_grads(self) -> dict[tuple[int, str], R.LoraPair]:
        """The last step's gradients (dA, dB) per (layer, target), as LoraPair(A=dA, B=dB)."""
        return self.layout.unpack(self.grads)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {"m": self.optim.m.copy(), "v": self.optim.v.copy()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray], applied_steps: int) -> None:
        for name in ("m", "v"):
            value = np.asarray(state[name], np.float32).reshape(-1)
            if value.shape != (self.layout.n_params,):
                raise ValueError(
                    f"optimizer state {name!r}: {value.size} values, the layout has {self.layout.n_params}"
                )
            getattr(self.optim, name)[:] = value
        self.applied_steps = applied_steps

    def gradients(self) -> dict[str, np.ndarray]:
        return {"grads": self.grads.copy(), "losses": self.losses.copy()}

    def set_gradients(self, state: Mapping[str, np.ndarray]) -> None:
        self.grads[:], self.losses[:] = gradient_state(state, self.layout.n_params, self.grad_accum)

    # ---- inputs ----------------------------------------------------------------------------------------
    def write_batch(self, batch: KdBatch | PairBatch) -> None:
        """Take one batch of the objective's type (model/engine_spec.py); raises ValueError for ids outside the
        vocabulary or a prefix that does not fit the engine."""
        self._batch = self.objective.write(batch)

    def _inputs(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("NumpyEngine: call write_batch() before a step or an evaluation")
        return self._batch

    # ---- forward / backward ----------------------------------------------------------------------------
    def _forward(self, keep: bool) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray], dict[int, dict]]:
        """(final hidden x [B, T, H], normed [rows, H], adapted blocks' inputs, their caches when kept)."""
        cfg, w, b = self.cfg, self.w, self._inputs()
        x = b["prefix"] if self.start_layer else R.embed(w, cfg, b["ids"])
        inputs, caches = {}, {}
        for layer in range(self.start_layer, cfg.n_layers):
            adapted = keep and layer >= self.layout.lowest_layer
            if adapted:
                inputs[layer] = x
            x, cache = R.block_forward(x, w, cfg, layer, self._lora, self.scale)
            if adapted and self.keep_caches:
                caches[layer] = cache
        nf = R.rmsnorm_forward(x, w["output_norm.weight"], cfg.eps)
        return x, nf.reshape(self.rows, cfg.hidden), inputs, caches

    def _head_loss_rows(self, backward: bool):
        """Forward, then the objective's head: (loss, dL/dh of the rows that count, those rows, forward state)."""
        x, nf, inputs, caches = self._forward(keep=backward)
        loss, dh, rows = self.objective.head(self._inputs(), nf, backward)
        return loss, dh, rows, (x, inputs, caches)

    def _loss_and_grads(self, accumulate: bool) -> float:
        cfg, w = self.cfg, self.w
        loss, dh, rows, (x, inputs, caches) = self._head_loss_rows(backward=True)
        grads: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        if dh is not None:
            dnf = np.zeros((self.rows, cfg.hidden), np.float32)
            dnf[rows] = dh
            dx = R.rmsnorm_backward(dnf.reshape(x.shape), x, w["output_norm.weight"], cfg.eps)
            for layer in reversed(range(self.layout.lowest_layer, cfg.n_layers)):
                cache = caches.pop(layer, None)
                if cache is None:  # recompute from the checkpointed block input
                    cache = R.block_forward(inputs[layer], w, cfg, layer, self._lora, self.scale)[1]
                dx = R.block_backward(dx, cache, w, cfg, layer, self._lora, self.scale, grads)
                del cache
        if not accumulate:
            self.grads[:] = 0.0
        r, group = self.layout.r, self.spec.lora_group
        for key, (da, db) in grads.items():
            if group:  # a mergeable adapter: the gradient of A's group values (model/reference.py)
                da = R.lora_group_project(da, group)
            s = self.layout.slots[key]
            self.grads[s.a_off : s.a_off + r * s.d_in] += da.reshape(-1)
            self.grads[s.b_off : s.b_off + s.d_out * r] += db.reshape(-1)
        return loss

    def loss_and_grads(self) -> float:
        """Loss of the written batch; gradients land in self.grads (read them with get_grads())."""
        self.losses[0] = loss = self._loss_and_grads(accumulate=False)
        return loss

    def accumulate(self, micro: int) -> None:
        """Forward + backward of the written micro-batch `micro` (0-based), added into the gradients."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{self.grad_accum - 1}")
        self.losses[micro] = self._loss_and_grads(accumulate=micro > 0)

    def apply(self, lr: float) -> StepStats:
        """Average the accumulated gradients and take one AdamW step (skipped when a micro-batch loss or the
        grad norm is not finite); the returned loss is the mean over the micro-batches."""
        n = self.grad_accum
        if n > 1:
            self.grads *= np.float32(1.0 / n)
        losses = self.losses[:n]
        finite = bool(np.isfinite(losses).all())
        stats = self.optim.step(
            self.params, self.grads, self.applied_steps + 1, lr, float(losses[-1]) if finite else float("nan")
        )
        return self._count(StepStats(stats.grad_norm, stats.clip_scale, stats.skipped, float(losses.mean())))

    def train_step(self, lr: float) -> StepStats:
        """Forward, backward and one AdamW update on the written batch (grad_accum == 1)."""
        if self.grad_accum != 1:
            raise ValueError("train_step is for grad_accum=1: call accumulate() per micro-batch, then apply()")
        loss = self._loss_and_grads(accumulate=False)
        self.losses[0] = loss
        return self._count(self.optim.step(self.params, self.grads, self.applied_steps + 1, lr, float(self.losses[0])))

    def _count(self, stats: StepStats) -> StepStats:
        if stats.skipped:
            self.skipped_steps += 1
        else:
            self.applied_steps += 1
        return stats

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """Forward only: the objective's results of the written batch (NumpyKd: kd_loss [1], ce and top1 [rows];
        NumpyPreference: logps, counts and the loss terms)."""
        return self.objective.evaluate(self._inputs(), self.final_hidden())

    def final_hidden(self) -> np.ndarray:
        """Forward only: the normed final hidden states [rows, H] of the written batch (the LM head's input)."""
        return self._forward(keep=False)[1]


def _cache_floats(cfg: ModelConfig) -> int:
    """Floats per row of one block_forward cache (x, n1, q, k, v, att, h, n2, g, u, act; q0, k0 with q/k norm;
    o, down with post-norms)."""
    qk_norm_inputs = cfg.q_dim + cfg.kv_dim if cfg.qk_norm else 0
    post_norm_inputs = 2 * cfg.hidden if cfg.post_norms else 0
    return 4 * cfg.hidden + 2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn + qk_norm_inputs + post_norm_inputs
