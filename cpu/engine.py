"""NumpyEngine: LoRA knowledge distillation on the CPU at BLAS speed, the training/evaluation API of GPUStudent.

The math is model/reference.py's op pairs (block_forward / block_backward, batched over [B, T] in float32: every
projection is one [B*T, in] x [in, out] GEMM) and model/kd.py's per-row loss pieces, with the lm_head chunked over
the vocabulary (cpu/head.py). Parameters, gradients and AdamW moments live in flat float32 arrays laid out like
GPUStudent's (model.lora_layout.LoraLayout), so adapters, gradients and optimizer state are interchangeable.

Memory: the per-block caches of the adapted blocks are kept from the forward for the backward when they fit in
`activation_budget` bytes; otherwise only each adapted block's input is kept and the block is recomputed from it
before its backward (layer-input checkpointing, as on the GPU). The backward stops at the lowest adapted block.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from cpu.adamw import NumpyAdamW
from cpu.head import VocabHead, VocabPass, head_backward, kd_rows
from cpu.weights import check_weights, load_gguf_f32
from model import reference as R
from model.config import ModelConfig
from model.kd import LossConfig
from model.lora_layout import LoraLayout
from schemas.optim import AdamWConfig, StepStats

ACTIVATION_BUDGET = 2 << 30  # bytes of block caches kept between forward and backward before recomputing


class NumpyEngine:
    """Training and evaluation of LoRA on a frozen float32 student held in host memory."""

    precision = "f32"

    def __init__(
        self,
        cfg: ModelConfig | None,
        weights: Mapping[str, np.ndarray] | str | Path,
        *,
        targets: Iterable[str],
        r: int,
        alpha: float,
        batch: int,
        seq_len: int,
        top_k: int,
        loss: LossConfig,
        optim: AdamWConfig | None = None,
        vocab_chunk: int = 4096,
        layers: Iterable[int] | None = None,
        grad_accum: int = 1,
        precision: str = "f32",
        activation_budget: int = ACTIVATION_BUDGET,
        start_layer: int = 0,
    ) -> None:
        if precision not in ("f32", "auto"):
            raise ValueError(
                f"precision {precision!r}: the numpy engine computes in f32 (train.precision: f32 or auto)"
            )
        if isinstance(weights, (str, Path)):
            source = str(weights)
            file_cfg, weights = load_gguf_f32(weights)
            if cfg is not None and cfg != file_cfg:
                raise ValueError(f"{source}: the GGUF's config {file_cfg} differs from the one given {cfg}")
            cfg = file_cfg
        else:
            source = "NumpyEngine weights"
        if cfg is None:
            raise ValueError("NumpyEngine: pass a ModelConfig with a weights dict (or a GGUF path)")
        if seq_len > cfg.context_length:
            raise ValueError(f"seq_len={seq_len} exceeds the model's context length {cfg.context_length}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum} must be >= 1")
        self.cfg, self.w = cfg, check_weights(cfg, weights, source)
        self.layout = LoraLayout.build(cfg, targets, r, layers)
        if self.layout.n_params == 0:
            raise ValueError("NumpyEngine needs at least one LoRA target")
        if not 0 <= start_layer <= self.layout.lowest_layer:
            raise ValueError(
                f"start_layer={start_layer}: must be a block at or below the lowest adapted block "
                f"{self.layout.lowest_layer} (blocks below it carry no LoRA)"
            )
        self.start_layer = start_layer  # > 0: the forward starts here from the prefix write_batch gets
        self.scale = alpha / r
        self.batch, self.seq_len, self.rows, self.k = batch, seq_len, batch * seq_len, top_k
        self.loss_cfg, self.grad_accum = loss, grad_accum
        self.head = VocabHead(R.lm_head_weight(self.w), vocab_chunk)
        self.params = np.zeros(self.layout.n_params, np.float32)
        self.grads = np.zeros(self.layout.n_params, np.float32)
        self.optim = NumpyAdamW(self.layout.n_params, optim or AdamWConfig())
        self._lora = self._views(self.params)  # LoraPairs viewing self.params: updates need no re-pack
        self.losses = np.zeros(grad_accum, np.float32)
        self.applied_steps = 0
        self.skipped_steps = 0
        adapted = cfg.n_layers - self.layout.lowest_layer
        self.keep_caches = adapted * self.rows * _cache_floats(cfg) * 4 <= activation_budget
        self._batch: dict[str, np.ndarray | None] | None = None

    @classmethod
    def from_gguf(cls, path: str | Path, **kwargs: object) -> NumpyEngine:
        """The engine on the GGUF at `path`, dequantized once to float32."""
        return cls(None, path, **kwargs)

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
        grads, losses = np.asarray(state["grads"], np.float32), np.asarray(state["losses"], np.float32)
        if grads.shape != self.grads.shape or losses.shape != self.losses.shape:
            raise ValueError(
                f"gradients {grads.shape}, losses {losses.shape}: expected {self.grads.shape}, {self.losses.shape}"
            )
        self.grads[:], self.losses[:] = grads, losses

    # ---- inputs ----------------------------------------------------------------------------------------
    def write_batch(
        self,
        ids: np.ndarray,
        targets: np.ndarray,
        mask: np.ndarray,
        teacher_ids: np.ndarray,
        teacher_logprobs: np.ndarray,
        teacher_tail: np.ndarray | None,
        prefix: np.ndarray | None = None,
    ) -> None:
        """Take one batch: ids/targets/mask [B, T], teacher top-k ids/logprobs [B, T, k], tail [B, T] or None;
        prefix [B, T, H]: the input of block start_layer (required when start_layer > 0, refused otherwise)."""
        bt, v = (self.batch, self.seq_len), self.cfg.vocab
        if (prefix is None) != (self.start_layer == 0):
            raise ValueError(f"prefix activations: given {prefix is not None}, start_layer is {self.start_layer}")
        if prefix is not None:
            prefix = np.asarray(prefix, np.float32)
            if prefix.shape != (*bt, self.cfg.hidden):
                raise ValueError(
                    f"prefix activations of shape {prefix.shape}, the engine takes {(*bt, self.cfg.hidden)}"
                )
        ids = np.asarray(ids).reshape(bt).astype(np.intp)
        tids = np.asarray(teacher_ids).reshape(self.rows, self.k).astype(np.intp)
        targets = np.asarray(targets).reshape(-1).astype(np.intp)
        for name, a in (("token ids", ids), ("teacher ids", tids), ("targets", targets)):
            if a.size and (a.min() < 0 or a.max() >= v):
                raise ValueError(f"{name} outside the student's vocabulary [0, {v})")
        self._batch = {
            "ids": ids,
            "targets": targets,
            "mask": np.asarray(mask).reshape(-1) != 0,
            "teacher_ids": tids,
            "teacher_logprobs": np.asarray(teacher_logprobs, np.float32).reshape(self.rows, self.k),
            "teacher_tail": None if teacher_tail is None else np.asarray(teacher_tail, np.float32).reshape(-1),
            "prefix": prefix,
        }

    def _inputs(self) -> dict[str, np.ndarray | None]:
        if self._batch is None:
            raise RuntimeError("NumpyEngine: call write_batch() before a step or an evaluation")
        return self._batch

    # ---- forward / backward ----------------------------------------------------------------------------
    def _forward(self, keep: bool) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray], dict[int, dict]]:
        """(final hidden x [B, T, H], normed [rows, H], adapted blocks' inputs, their caches when kept)."""
        cfg, w, b = self.cfg, self.w, self._inputs()
        x = b["prefix"] if self.start_layer else R.embedding_forward(w["token_embd.weight"], b["ids"])
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
        """Forward, then the KD head over the masked rows: (loss, dL/dh of those rows, rows, forward state)."""
        b = self._inputs()
        x, nf, inputs, caches = self._forward(keep=backward)
        rows = np.flatnonzero(b["mask"])
        count = len(rows)
        if count == 0:
            return 0.0, None, rows, (x, inputs, caches)
        c = self.loss_cfg
        weighted = ("tau+1" if c.ce_weight and c.tau != 1.0 else "tau") if backward else ""
        tids, targets = b["teacher_ids"][rows], b["targets"][rows]
        vp = self.head.vocab_pass(nf[rows], tids, targets, c.tau, weighted=weighted)
        tail = None if b["teacher_tail"] is None else b["teacher_tail"][rows]
        kd = kd_rows(vp, b["teacher_logprobs"][rows], tail, c, count, backward)
        loss = float(np.sum(kd.row_loss))
        dh = head_backward(self.head, vp, kd, tids, targets, c, count) if backward else None
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
        r = self.layout.r
        for key, (da, db) in grads.items():
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
        """Forward only: kd_loss (the batch's masked-mean loss, [1]), ce [rows] and the student's top-1 id
        [rows] (u32); rows with mask 0 are included (callers select masked rows)."""
        b, c = self._inputs(), self.loss_cfg
        _, nf, _, _ = self._forward(keep=False)
        vp = self.head.vocab_pass(nf, b["teacher_ids"], b["targets"], c.tau, top1=True)
        rows = np.flatnonzero(b["mask"])
        loss = 0.0
        if len(rows):
            sub = VocabPass(vp.lse_tau[rows], vp.lse_1[rows], vp.gathered[rows], None, None, None)
            tail = None if b["teacher_tail"] is None else b["teacher_tail"][rows]
            loss = float(np.sum(kd_rows(sub, b["teacher_logprobs"][rows], tail, c, len(rows), False).row_loss))
        return {
            "kd_loss": np.array([loss], np.float32),
            "ce": vp.lse_1 - vp.gathered[:, self.k].astype(np.float64),
            "top1": vp.top1.astype(np.uint32),
        }


def _cache_floats(cfg: ModelConfig) -> int:
    """Floats per row of one block_forward cache (x, n1, q, k, v, att, h, n2, g, u, act; q0, k0 with q/k norm)."""
    qk_norm_inputs = cfg.q_dim + cfg.kv_dim if cfg.qk_norm else 0
    return 4 * cfg.hidden + 2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn + qk_norm_inputs
