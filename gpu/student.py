"""The student on the GPU: LoRA training on the frozen quantized model of gpu/model.py. One training step
(forward, the objective's loss, complete backward, AdamW) is recorded into one command encoder. GPUStudent is the
trunk; what it optimises is the objective plugged into it (gpu/objectives.py: KD or a preference loss), built
from an EngineSpec (model/engine_spec.py).

Memory: each block's input is kept ([L+1, rows, H]); the backward recomputes one block at a time from its
input, up to the down projection's input (layer-input checkpointing), and then runs the block backward,
mirroring model/reference.py's block_forward / block_backward. `kept_blocks` (gpu/kept_blocks.py) trades memory
for speed: those blocks keep their GEMM and attention outputs from the forward in buffers of their own (allocated
with the first backward) and skip the recompute but for their norms and gated activation (_refresh).
`checkpoints`: the block inputs in f32, or in bf16 (model/bf16.py: half the bytes, f32's range; the forward
itself stays f32, only the recompute starts from the rounded input); "auto" takes bf16 with tensor cores and f32
on the f32 path, the parity oracle. Besides, each adapted projection's
t = x A^T ([rows, r]: 2 MiB per projection at B4 x T1024, r16) stays from the forward: the recompute adds only
(s t) B^T, and the LoRA backward reads it.

GPUStudent is the wgpu training engine: it satisfies training.engine.Engine structurally (training/engines.py
builds it); train_step, loss_and_grads and get_grads are extras for tests and benches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gpu.codegen_i8 import MMA_K
from gpu.device import BufferView, Device, DeviceError
from gpu.kept_blocks import kept_count, kept_widths
from gpu.model import GPUModel, ModelWeights, attention_settings
from gpu.objectives import GpuObjective
from gpu.ops import lora_da_i8, lora_db_i8, lora_i8
from gpu.ops.adamw import AdamW, AdamWConfig, StepStats
from gpu.ops.add import scale_inplace
from gpu.ops.common import nbytes
from gpu.ops.gated import geglu_backward, swiglu_backward
from gpu.ops.lora import lora_backward, lora_da_group, lora_group_sum, lora_term
from gpu.ops.lora_da_i8 import INPUTS, InputCodes, da_covers
from gpu.ops.lora_db_i8 import db_covers, row_chunk, shape_covered
from gpu.ops.lora_i8 import LoraGradCodes, lora_thin_i8, thin_covers
from gpu.ops.lora_matmul import HalfCopy
from gpu.ops.matmul_i8 import Int8Matrix, LoraTerm, gemm_i8, i8_buffers
from gpu.ops.quantize_i8 import (
    glu_back_workgroup,
    glu_backward_i8,
    i8_pair,
    quantize_i8_gpu,
    rmsnorm_backward_i8,
    rotate_rows,
    rotated_back,
    transpose_i8,
)
from gpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gpu.ops.rope import rope_backward
from model.config import LORA_TARGETS
from model.engine_spec import EngineSpec, KdBatch, PairBatch, gradient_state
from model.int8 import NORM_TURNED_MAX
from model.lora_layout import aligned_floats
from model.reference import LoraPair, check_group_constant

MAX_SKIPS_IN_A_ROW = 8  # consecutive non-finite steps before training stops (a diverged or overflowing run)


class TrainingDiverged(ValueError):
    """Too many consecutive steps skipped for a non-finite loss or gradient norm."""


CHECKPOINTS = ("auto", "f32", "bf16")  # the block inputs kept for the backward (see the module docstring)


class GPUStudent(GPUModel):
    """Training and evaluation of LoRA on a frozen quantized student, one step = one command encoder, for
    `spec`'s shapes, optimising `objective` (gpu/objectives.py) with AdamW (`optim`)."""

    saves_lora_t = True  # the forward's t = x A^T serves the backward's recompute and the LoRA gradients
    int8_input_grads = True  # with precision int8, the projections' input gradients on the integer GEMM too
    transposed_input_grads = True  # ... on the forward's ("nt") GEMM over W's transposed codes (else "nn")
    # int8: the backward's RMSNorms and gated unit give the next input-gradient GEMMs' operands (dX times W's row
    # scales, int8) in the same pass (rmsnorm_backward_i8, glu_backward_i8; bitwise the separate quantizers'). Off:
    # on an H100 (2026-12-06, docs/benchmarks.md) those row kernels cost more than the passes they replace (the
    # 8B step 5,118 tokens/s with them off against 4,808 on; rmsnorm_back_i8 59 ms against ~25)
    fused_grad_codes_i8 = False
    # ... the gated unit's alone (glu_backward_i8 on rows held in registers, one read of dY, G and U; its f32
    # gradients left unwritten where every reader takes the codes: _glu_grads_f32_needed), whatever
    # fused_grad_codes_i8 says. On: the H100's 8B step 6,744 against 6,630 tokens/s (+1.7 %, 2026-12-07; bench --ab
    # glu-grad-codes-off for swiglu_backward and the two scaled quantizers)
    glu_grad_codes_i8 = True
    # ... and turns the down projection's input gradient dL/ds R back as it reads it (the rotation pass over ds gone;
    # bitwise): opt-in until timed (bench --ab glu-turns-back)
    glu_turns_back = False
    # ... and with them, the RMSNorm backward turns the summed input gradients of q/k/v and gate/up (dX R) back
    # itself (rmsnorm_backward_i8 dy_rot; bitwise) instead of a rotation pass over them (H100: 4,808 against 4,995
    # tokens/s with the pass, fused_grad_codes_i8 on): off
    norm_turns_back = False

    def __init__(
        self,
        dev: Device,
        weights: ModelWeights,
        spec: EngineSpec,
        objective: GpuObjective,
        optim: AdamWConfig | None = None,
        *,
        max_skips_in_a_row: int = MAX_SKIPS_IN_A_ROW,
        checkpoints: str = "auto",
        kept_blocks: int | str = 0,
        memory_share: float = 1.0,
        int8_codes: str = "per_block",
    ) -> None:
        if checkpoints not in CHECKPOINTS:
            raise ValueError(f"checkpoints={checkpoints!r}: expected one of {', '.join(CHECKPOINTS)}")
        if spec.cfg != weights.cfg:
            raise ValueError(f"the spec's model config {spec.cfg} differs from the weights' {weights.cfg}")
        self.spec, self._checkpoints = spec, checkpoints
        super().__init__(
            dev,
            weights,
            batch=spec.batch,
            seq_len=spec.seq_len,
            targets=spec.targets,
            r=spec.r,
            alpha=spec.alpha,
            layers=spec.layers,
            precision=spec.precision,
            start_layer=spec.start_layer,
        )
        self.grad_accum = spec.grad_accum
        self.losses = dev.buffer(4 * spec.grad_accum, label="micro-batch losses")
        if self.layout.n_params == 0:
            raise ValueError("GPUStudent needs at least one LoRA target")
        self.grads = dev.buffer(4 * self.layout.n_params, label="lora grads")
        self.lora_group = spec.lora_group  # > 0: a mergeable adapter, dA projected (gpu/ops/lora.py lora_group_sum)
        d_in_max = max((s.d_in for s in self.layout.slots.values()), default=1)
        self.da_scratch = (
            dev.buffer(4 * self.layout.r * d_in_max, label="dA before its group sums") if spec.lora_group else None
        )
        w8_bytes = max((w.rows * w.k for w in self._w8_slots.values()), default=0)
        if w8_bytes and self.int8_input_grads and self.transposed_input_grads:  # one projection's codes at a time
            self.w8t = dev.buffer(w8_bytes, label="int8 weight transposed")
        self._dx_rotated: Any = None  # see _rotated_dx
        self._dx_codes: Int8Matrix | None = None  # see _norm_backward
        self._dt_slots: Any = None  # see _dt_slot
        self._down_operand: Int8Matrix | None = None  # dL/dx_{l+1} times block l's down scales, from _norm_backward
        self._a_rotated: Any = None  # see _lora_term_back
        self._widest_input = max((self.cfg.target_shape(t)[1] for t in LORA_TARGETS), default=0)
        self.optim = AdamW(dev, self.layout.n_params, optim or AdamWConfig())
        self.applied_steps = 0
        self.skipped_steps = 0
        self.skips_in_a_row = 0  # TrainingDiverged when it reaches max_skips_in_a_row
        self.max_skips_in_a_row = max_skips_in_a_row
        self._acc_grads = False
        self.objective = objective
        objective.bind(self)
        self.keep_codes(int8_codes, memory_share)  # before the kept blocks: auto spends the memory on the codes first
        self.grad_codes = self._grad_codes() if lora_i8.THIN_DT else None  # the row scales are fixed from here
        self.input_codes = self._kept_input_codes()  # before the kept blocks, which count the memory left
        self.kept_blocks = self._count_kept(kept_blocks, memory_share)  # their buffers come with the first backward
        if self.input_codes is not None:  # a kept block's backward is not preceded by its recompute
            self.input_codes.layers -= set(self._kept_layers())

    def _wants_bf16_checkpoints(self) -> bool:
        return self.tensor_cores if self._checkpoints == "auto" else self._checkpoints == "bf16"

    def _recomputed_blocks(self) -> list[int]:
        return [layer for layer in range(self.layout.lowest_layer, self.cfg.n_layers) if self._recomputed(layer)]

    def kept_block_bytes(self) -> int:
        """GPU bytes of one kept block's own buffers at this engine's batch (gpu/kept_blocks.py)."""
        return 4 * (self.rows * sum(kept_widths(self.cfg).values()) + self.batch * self.seq_lse)

    def _count_kept(self, setting: int | str, share: float) -> int:
        """How many of the recomputed blocks keep their intermediates (gpu/kept_blocks.py kept_count: `setting`,
        or auto from the device's memory and what this process holds now)."""
        recomputed = len(self._recomputed_blocks())
        device = self.dev.memory_bytes()
        return kept_count(setting, recomputed, self.kept_block_bytes(), device, self.dev.live_bytes, share)

    def _kept_layers(self) -> list[int]:
        """The blocks that keep their intermediates: the highest kept_blocks recomputed ones."""
        blocks = self._recomputed_blocks()
        return blocks[len(blocks) - self.kept_blocks :] if self.kept_blocks else []

    def _keep_blocks(self) -> None:
        """Give the highest kept_blocks recomputed blocks buffers of their own for what their backward reads (once,
        before the first backward: an engine that only evaluates never holds them)."""
        if len(self._kept) == self.kept_blocks:
            return
        widths = kept_widths(self.cfg)
        for layer in self._kept_layers():
            own = {name: self.dev.buffer(4 * self.rows * w, label="kept activations") for name, w in widths.items()}
            own["lse"] = self.dev.buffer(4 * self.batch * self.seq_lse, label="kept activations")
            self._kept[layer] = {**self._scratch, **own}

    def _kept_input_codes(self) -> InputCodes | None:
        """Buffers for the int8 codes of the projection inputs whose adapters take dA from them (gpu/ops/lora_da_i8.py
        THIN_DA: integer forward GEMMs, one scale a row), or None."""
        if not (lora_da_i8.THIN_DA and self._w8_slots and row_chunk(self.rows) > 0):
            return None
        cfg, widths = self.cfg, {}
        for name, targets in INPUTS.items():
            adapted = [t for t in targets if any(key[1] == t for key in self.layout.slots)]
            width = cfg.target_shape(targets[0])[1]
            if adapted and self._forward_int8(width) and shape_covered(self.rows, width, self.layout.r):
                widths[name] = width
        layers = {layer for layer, _ in self.layout.slots}
        return InputCodes(self.dev, self.rows, widths, layers) if widths else None

    def _input_codes(self, layer: int, name: str) -> tuple[Any, Any] | None:
        codes = self._x_codes(layer, name)
        return None if codes is None else (codes.codes, codes.scales)

    def _input_f32_needed(self, layer: int, name: str) -> bool:
        """False where the input feeds no adapter, or where its adapters take t (lora_thin_i8) and dA (lora_da_i8)
        from its kept codes however they are grouped (the projections' GEMMs take the codes too)."""
        keys = [(layer, t) for t in INPUTS[name] if (layer, t) in self.layout.slots]
        if not keys:
            return False
        x8, r, n = self._x_codes(layer, name), self.layout.r, len(keys)
        if x8 is None or not (lora_i8.THIN_I8 and self.lora_codes is not None and self.lora_codes.covers(keys)):
            return True
        return not all(thin_covers(x8, r * c) and da_covers(x8, r, c) for c in {1, n})

    def _x_codes(self, layer: int, name: str) -> Int8Matrix | None:
        """Block `layer`'s kept int8 codes of projection input `name` for its adapters' dA, or None."""
        return None if self.input_codes is None else self.input_codes.at(layer, name)

    def _f16_pair(self) -> bool:
        """The gated unit's gradients as the gate and up projections' f16 operands, where their input gradients
        run on the f16 tensor cores (not on integer GEMMs)."""
        return not ("gate" in self._w8_slots and self.int8_input_grads)

    def _gradient_widths(self) -> dict[str, int]:
        cfg = self.cfg
        h, f, qd, kvd = cfg.hidden, cfg.ffn, cfg.q_dim, cfg.kv_dim
        # dL/dgate goes into "s", dL/dup over "u"; without per-head q/k norms dL/dq and dL/dk go over q and k
        widths = {"dx": h, "dh": h, "ds": f, "dn": h, "datt": qd, "dqr": qd, "dkr": kvd, "dv": kvd}
        if cfg.qk_norm:  # q and k are read by the norms' backward; gradients at the normed q / k too
            widths.update({"dq": qd, "dk": kvd, "dqn": qd, "dkn": kvd})
        if cfg.post_norms:  # dL/d(o or down output), before the post-norm
            widths["dpost"] = h
        return widths

    def set_adapter(self, adapter: Mapping[tuple[int, str], LoraPair]) -> None:
        """Upload an adapter (a mergeable engine refuses an A that is not group-constant)."""
        if self.lora_group:
            for key, pair in adapter.items():
                check_group_constant(np.asarray(pair.A), self.lora_group, f"adapter {key}")
        super().set_adapter(adapter)

    def get_grads(self) -> dict[tuple[int, str], LoraPair]:
        """The last step's gradients (dA, dB) per (layer, target), as LoraPair(A=dA, B=dB)."""
        return self.layout.unpack(self.dev.read(self.grads, np.float32, (self.layout.n_params,)))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The AdamW moments m and v, flat f32 [n_params] in the layout's order (padding included)."""
        n = self.layout.n_params
        return {"m": self.dev.read(self.optim.m, np.float32, (n,)), "v": self.dev.read(self.optim.v, np.float32, (n,))}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray], applied_steps: int) -> None:
        """Restore the AdamW moments and the applied-step count of the checkpoint they came from."""
        self.dev.write(self.optim.m, np.asarray(state["m"], np.float32))
        self.dev.write(self.optim.v, np.asarray(state["v"], np.float32))
        self.applied_steps = applied_steps

    def gradients(self) -> dict[str, np.ndarray]:
        """The accumulated gradients (flat f32 [n_params]) and micro-batch losses (f32 [grad_accum])."""
        n = self.layout.n_params
        return {
            "grads": self.dev.read(self.grads, np.float32, (n,)),
            "losses": self.dev.read(self.losses, np.float32, (self.grad_accum,)),
        }

    def set_gradients(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the accumulated gradients and micro-batch losses (e.g. with their sum over workers)."""
        grads, losses = gradient_state(state, self.layout.n_params, self.grad_accum)
        self.dev.write(self.grads, grads)
        self.dev.write(self.losses, losses)

    # ---- backward -------------------------------------------------------------------------------------
    def _glu_codes(self, layer: int) -> bool:
        """Whether block `layer`'s gated-unit backward gives the gate and up projections' dY codes itself
        (glu_backward_i8: integer input gradients, glu_grad_codes_i8 or fused_grad_codes_i8)."""
        wg, wu = (self._int8_back(layer, target)[0] for target in ("gate", "up"))
        fused = self.fused_grad_codes_i8 or self.glu_grad_codes_i8
        return fused and wg is not None and wu is not None and glu_back_workgroup(self.dev, self.cfg.ffn) is not None

    def _ds_rotation(self, layer: int) -> int:
        """The rotation block that the down projection's input gradient (dL/ds) of block `layer` is left in for the
        gated unit's backward to turn back as it reads it (glu_turns_back, with _glu_codes, the GEMM over rotated
        codes with the LoRA term in its epilogue), else 0: turned back by a pass of its own."""
        if not (self.glu_turns_back and self._glu_codes(layer)):
            return 0
        w8, in_gemm = self._int8_back(layer, "down")
        return self._rotation(self.cfg.ffn) if w8 is not None and in_gemm else 0

    def _gated_backward(self, layer: int, ds_rot: int = 0) -> dict[str, Any]:
        """The gated unit's backward: dL/dgate into a["s"], dL/dup over a["u"], and where the projections' input
        gradients take them, both gradients as their GEMMs' operands from the same pass, by target: integer
        (_glu_codes: glu_backward_i8, the two in self.a8, the f32 gradients written only where
        _glu_grads_f32_needed; a["ds"] holding dL/ds R for ds_rot > 0), or f16 (tensor cores: the two in self.a16);
        else none ({})."""
        cfg, a, dev, rows = self.cfg, self.a, self.dev, self.rows
        wg, wu = (self._int8_back(layer, target)[0] for target in ("gate", "up"))
        if self._glu_codes(layer):
            pair = i8_pair(*self.a8, rows, cfg.ffn, dev.offset_alignment, "gated unit gradients")
            operands = {"gate": pair[0], "up": pair[1]}
            act = "geglu" if cfg.activation == "gelu_tanh" else "swiglu"
            store = self._glu_grads_f32_needed(layer, operands)
            glu_backward_i8(
                dev, act, a["ds"], a["g"], a["u"], a["s"], wg.scales, wu.scales, *pair, store_grads=store, dy_rot=ds_rot
            )
            return operands
        if ds_rot:
            raise DeviceError(f"block {layer}: dL/ds left rotated for a gated-unit backward that cannot turn it back")
        gate_backward = geglu_backward if cfg.activation == "gelu_tanh" else swiglu_backward
        n = rows * cfg.ffn
        if wg is None and wu is None and self._a16_second is not None and self._half_copy(n) is not None:
            halves = BufferView(self.a16, 0, 2 * n), BufferView(self.a16, self._a16_second, 2 * n)
            gate_backward(dev, a["ds"], a["g"], a["u"], a["s"], n, *halves)
            return {"gate": halves[0], "up": halves[1]}
        gate_backward(dev, a["ds"], a["g"], a["u"], a["s"], n)
        return {}

    def _proj_back_sum(
        self,
        grads: tuple[tuple[Any, str], ...],
        x: Any,
        layer: int,
        dx: Any,
        operands: Mapping[str, Any] | None = None,
        x_codes: Int8Matrix | None = None,
    ) -> int:
        """dx = the sum of the input gradients of projections sharing the input x ((dY, target) each; operands:
        dY's GEMM operands by target where its producer gave them, integer or f16). Where each runs on the integer
        GEMM over rotated codes with its LoRA term in the epilogue, the GEMMs sum dX R in dx, left so (the
        rotation's block returned: the caller's _norm_backward turns it back) where norm_turns_back allows, else
        turned back by one pass over dx (instead of one per projection, each adding from a scratch); else one
        _proj_back after the other. x_codes: x's int8 codes kept from the forward, the adapters' dA from them
        (lora_da_i8). Returns the rotation dx is left in (0: none)."""
        d_in = self.cfg.target_shape(grads[0][1])[1]
        rot = self._rotation(d_in)
        summed = rot > 0 and all(self._int8_back(layer, target)[1] for _, target in grads)
        keys = [(layer, target) for _, target in grads if (layer, target) in self.layout.slots]
        shared = self.shared_lora_inputs and not self.lora_group and len(keys) > 1  # the LoRA dA's in one product
        for i, (dy, target) in enumerate(grads):
            operand = (operands or {}).get(target)
            slot = i if shared else None
            self._proj_back(
                dy, x, layer, target, dx, i > 0, rotated=summed, dy_operand=operand, dt_slot=slot, x_codes=x_codes
            )
        if shared:
            dts = [self._dt_slot(i) for i, (_, target) in enumerate(grads) if (layer, target) in self.layout.slots]
            das = [self._lora(*key, self.grads)[0] for key in keys]
            if x_codes is not None and da_covers(x_codes, self.layout.r, len(das)):
                lora_da_i8.lora_da_i8(self.dev, x_codes, dts, das, self.layout.r, rot, accumulate=self._acc_grads)
            else:
                lora_da_group(self.dev, x, dts, das, self.rows, d_in, self.layout.r, accumulate=self._acc_grads)
        if not summed:
            return 0
        if not self.norm_turns_back:
            rotate_rows(self.dev, dx, self.rows, d_in, rot)
            return 0
        return rot

    def _dt_slot(self, i: int) -> Any:
        """The i-th of three [rows, r] slots for dt = s dY B, kept until the dA of projections sharing an input run
        together (_proj_back_sum; allocated on first use)."""
        size = aligned_floats(self.rows * self.layout.r)
        if self._dt_slots is None:
            self._dt_slots = self.dev.buffer(4 * 3 * size, label="lora dt of projections sharing an input")
        return BufferView(self._dt_slots, 4 * i * size, 4 * self.rows * self.layout.r)

    def _int8_back(self, layer: int, target: str) -> tuple[Int8Matrix | None, bool]:
        """(W's int8 codes when the input gradient of (layer, target) runs on the integer GEMM, else None; whether
        the LoRA term dt A is then added in the GEMM's epilogue)."""
        d_out, d_in = self.cfg.target_shape(target)
        w8 = self._int8_weight(layer, target) if self.int8_input_grads else None
        int8 = w8 is not None and d_out % MMA_K == 0 and d_in % 16 == 0
        lora = (layer, target) in self.layout.slots
        return (w8 if int8 else None), int8 and self.transposed_input_grads and (not lora or self._lora_in_gemm(d_in))

    def _grad_codes(self) -> LoraGradCodes | None:
        """B / sW of every adapter whose projection's input gradient runs on the integer GEMM with its LoRA term in the
        epilogue and whose weight row scales sW are fixed (resident codes, or the kept row scales): dt = s dY B from
        the GEMM's own dY codes (gpu/ops/lora_i8.py THIN_DT)."""
        if not (self._w8_slots and self.int8_input_grads and self.transposed_input_grads and self.layout.slots):
            return None
        fixed = {key: self.fixed_row_scales(*key) for key in self.layout.slots}
        row_scales = {key: scales for key, scales in fixed.items() if scales is not None}
        return LoraGradCodes(self.dev, self.layout.slots, self.layout.r, self.scale, row_scales)

    def _thin_dt(self, key: tuple[int, str], dy_codes: Int8Matrix) -> bool:
        """Whether dt = s dY B of adapter `key` comes from the input gradient's dY codes (lora_thin_i8)."""
        return self.grad_codes is not None and self.grad_codes.covers([key]) and thin_covers(dy_codes, self.layout.r)

    def _db_from_codes(self, dy_codes: Int8Matrix) -> bool:
        """Whether dB = s dY^T t comes from the input gradient's dY codes where dt does (gpu/ops/lora_db_i8.py)."""
        return lora_db_i8.THIN_DB and self.grad_codes is not None and db_covers(dy_codes, self.layout.r)

    def _glu_grads_f32_needed(self, layer: int, operands: Mapping[str, Int8Matrix]) -> bool:
        """Whether anything reads the gated unit's f32 gradients (dg, du) besides their codes `operands` (by target):
        an adapter of gate or up whose dt or dB does not come from the codes, or whose term is not in the GEMM."""
        for target, codes in operands.items():
            key = (layer, target)
            if key in self.layout.slots and not (
                self._int8_back(*key)[1] and self._thin_dt(key, codes) and self._db_from_codes(codes)
            ):
                return True
        return False

    def _thin_db(self, key: tuple[int, str], dy_codes: Int8Matrix) -> bool:
        """dB = s dY^T t of adapter `key` from the input gradient's dY codes (gpu/ops/lora_db_i8.py THIN_DB, where dt
        comes from them: their sW is at hand), into the gradients; whether it ran."""
        if not self._db_from_codes(dy_codes):
            return False
        codes, s = self.grad_codes, self.layout.slots[key]
        lora_db_i8.lora_db_i8(
            self.dev, dy_codes, self._lora_t(*key), self.layout.r, codes.sw, codes.sw_offset(key), self.scale,
            self.grads, s.b_off, accumulate=self._acc_grads,
        )  # fmt: skip
        return True

    def _proj_back(
        self,
        dy: Any,
        x: Any,
        layer: int,
        target: str,
        dx: Any,
        accumulate: bool,
        *,
        rotated: bool = False,
        dy_operand: Any = None,
        dt_slot: int | None = None,
        x_codes: Int8Matrix | None = None,
    ) -> None:
        """dx (+)= dY W for projection `target` of block `layer` (+ its LoRA's input gradient, and its LoRA
        gradients). rotated: leave dX R in dx (the caller rotates the sum back; integer GEMM over rotated codes, LoRA
        term in its epilogue). dy_operand: dY as its GEMM takes it, when its producer gave it: the integer operand
        (an Int8Matrix: dY times W's row scales, as quantized here) or dY in f16 (the tensor cores). dt_slot: dt
        goes to that _dt_slot and the LoRA's dA is left to the caller (lora_da_group). x_codes: x's int8 codes kept
        from the forward: dA from them (lora_da_i8) where it covers them."""
        d_out, d_in = self.cfg.target_shape(target)
        dt = self.dt if dt_slot is None else self._dt_slot(dt_slot)
        if dt_slot is not None or (x_codes is not None and not da_covers(x_codes, self.layout.r, 1)):
            x_codes = None
        w8, _ = self._int8_back(layer, target)
        ab = self._lora(layer, target, self.params)
        int8 = w8 is not None
        # int8 over W's transposed codes: dx += dt A in the GEMM's epilogue, so the LoRA products come first; over
        # rotated codes the GEMM gives dX R, so the term is dt (A R), turned back with it
        rot = self._rotation(d_in) if int8 else 0
        in_gemm = int8 and self.transposed_input_grads and self._lora_in_gemm(d_in)
        a = None
        if int8:
            # dX = dY . W = (dY * sw) . codes: W's row scales folded into dY before its 8-bit rounding; over
            # rotated codes (W R) the GEMM gives dX R, rotated back (R^T) in place or from a scratch added to dx
            a = dy_operand
            if a is None:
                a = Int8Matrix(*self.a8, self.rows, d_out, d_out, "input gradient")
                quantize_i8_gpu(self.dev, dy, a, col_scales=w8.scales)
        if ab is not None and in_gemm:
            if self._thin_dt((layer, target), a):  # dt = s dY B from those codes (and dB), then dB and dA
                lora_thin_i8(self.dev, a, self.grad_codes, [(layer, target)], dt, [0], self._dt16_copy())
                db_ready = self._thin_db((layer, target), a)
                self._lora_back(dy, x, layer, target, ab, None, dt, dt_ready=True, db_ready=db_ready, x_codes=x_codes)
            else:
                self._lora_back(dy, x, layer, target, ab, None, dt, dt16=self._dt16_copy(), x_codes=x_codes)
        if int8:
            wt = term = None
            if self.transposed_input_grads:  # W's codes as rows of d_out: the forward's GEMM (faster staging)
                wt = transpose_i8(self.dev, w8, self.w8t, self.ones, f"int8 {target} transposed")
                if ab is not None and in_gemm:
                    term = self._lora_term_back((layer, target), ab[0], d_in, rot, dt)

            def gemm(out: Any, acc: bool) -> None:
                if wt is not None:
                    gemm_i8(self.dev, a, wt, out, accumulate=acc, lora=term)
                else:
                    gemm_i8(self.dev, a, w8, out, orient="nn", col_scales=self.ones, accumulate=acc)

            if rotated:
                gemm(dx, accumulate)
            else:
                rotated_back(self.dev, gemm, dx, self.rows, d_in, rot, accumulate, lambda: self._rotated_dx(d_in))
        else:
            a, kw = self._gemm_input(dy, d_out) if dy_operand is None else (dy_operand, {"a_dtype": "f16"})
            self._linear_grad(self.dev, a, self.w.proj[(layer, target)], dx, self.rows, accumulate=accumulate, **kw)
        if ab is not None and not in_gemm:
            self._lora_back(dy, x, layer, target, ab, dx, dt, x_codes=x_codes)

    def _mirror_rotation(self) -> Callable[[int], int] | None:
        """The A mirrors' rotation by input width, where the input gradients' integer GEMMs take LoRA terms."""
        return self._rotation if self.int8_input_grads and self.transposed_input_grads else None

    def _dt16_copy(self) -> HalfCopy | None:
        """dt's f16 copy for the input gradient's LoRA term (into the t16 scratch; mirrors only)."""
        return None if self.mirrors is None else HalfCopy(self.lora16[0], (0,), self.layout.r, 1.0)

    def _lora_term_back(self, key: tuple[int, str], a: Any, d_in: int, rot: int, dt: Any) -> LoraTerm:
        """The input gradient's LoRA term dt . A for the integer GEMM's epilogue (dt = s dY B, from _lora_back), with
        A rotated like the weight codes (A R) when they are: from the mirrors (dt16 written with dt), else packed
        here (A R into a scratch first)."""
        r = self.layout.r
        if self.mirrors is not None:
            return LoraTerm(BufferView(self.lora16[0], 0, 2 * self.rows * r), self.mirrors.a16(key), r, "cols")
        if rot:
            if self._a_rotated is None:
                self._a_rotated = self.dev.buffer(4 * r * self._widest_input, label="lora A rotated")
            rotate_rows(self.dev, a, r, d_in, rot, out=self._a_rotated, forward=True)
            a = self._a_rotated
        return lora_term(self.dev, dt, a, self.rows, d_in, r, 1.0, "cols", *self.lora16)

    def _rotated_dx(self, d_in: int) -> Any:
        """Scratch for an accumulated input gradient dX R of rows x d_in before its rotation back (allocated on
        first use: rows x the widest such input)."""
        need = 4 * self.rows * d_in
        if self._dx_rotated is None or nbytes(self._dx_rotated) < need:
            self._dx_rotated = self.dev.buffer(need, label="int8 input gradient, rotated")
        return self._dx_rotated

    def _lora_back(
        self,
        dy: Any,
        x: Any,
        layer: int,
        target: str,
        ab: tuple[Any, Any],
        dx: Any,
        dt: Any,
        *,
        dt16: HalfCopy | None = None,
        dt_ready: bool = False,
        db_ready: bool = False,
        x_codes: Int8Matrix | None = None,
    ) -> None:
        """The LoRA gradients of (layer, target) (dA unless dt is a _dt_slot: lora_da_group) and dt = s dY B into
        dt (and its f16 copy into dt16 where given; dt_ready: dt is there already; db_ready: so is dB); dx += dt A
        unless dx is None. x_codes: dA from x's int8 codes (lora_da_i8) instead of f32 x."""
        d_out, d_in = self.cfg.target_shape(target)
        da, db = self._lora(layer, target, self.grads)
        lora_backward(
            self.dev,
            dy,
            x,
            *ab,
            self._lora_t(layer, target),
            da,
            db,
            dx,
            dt,
            self.rows,
            d_in,
            d_out,
            self.layout.r,
            self.scale,
            accumulate_grads=self._acc_grads,
            group=self.lora_group,
            da_scratch=self.da_scratch,
            with_da=dt is self.dt and x_codes is None,
            dt16=dt16,
            dt_ready=dt_ready,
            db_ready=db_ready,
        )
        if x_codes is not None and dt is self.dt:  # a mergeable adapter's dA: the group sums of dt^T x
            r, rot, group = self.layout.r, self._rotation(d_in), self.lora_group
            out = self.da_scratch if group else da
            lora_da_i8.lora_da_i8(self.dev, x_codes, [dt], [out], r, rot, accumulate=self._acc_grads and not group)
            if group:
                lora_group_sum(self.dev, out, da, r * d_in, group, accumulate=self._acc_grads)

    def _attention_back(
        self, dout: Any, q: Any, k: Any, v: Any, out: Any, dq: Any, dk: Any, dv: Any, layer: int
    ) -> None:
        cfg, t = self.cfg, self.seq_len
        if self.batched_attention:  # tensor cores: a recomputed block's (or the top one's) q, k, v are still packed
            self._attention_bwd(
                self.dev,
                dout,
                q,
                k,
                v,
                out,
                self.a["lse"],
                dq,
                dk,
                dv,
                t,
                *self._heads(),
                n_seqs=self.batch,
                lse_stride=self.seq_lse,
                packed=layer not in self._kept,
            )
            return
        # without direct views, q, k, v, out are already in their slots from the forward or recompute just run,
        # except for a kept block's
        ins = ((dout, "ado"), (q, "aq"), (k, "ak"), (v, "av"), (out, "ao"))
        grads = ((dq, "adq"), (dk, "adk"), (dv, "adv"))
        self._scatter(ins if layer in self._kept else ins[:1], to_slots=True)
        for s in range(self.batch):
            self._attention_bwd(
                self.dev,
                *(self._seq_view(buf, slot, s) for buf, slot in ins),
                self._view(self.a["lse"], s * self.seq_lse, cfg.n_heads * t),
                *(self._seq_view(buf, slot, s) for buf, slot in grads),
                t,
                *self._heads(),
                delta=self.delta,
                **attention_settings(cfg, layer),
            )
        self._scatter(grads, to_slots=False)

    def _block_backward(self, layer: int) -> None:
        """Given dx = dL/dx_{l+1} in a["dx"] and the block's intermediates (recomputed, or kept), leave dL/dx_l in
        a["dx"]."""
        self._use_block(layer)
        cfg, a, dev, rows = self.cfg, self.a, self.dev, self.rows
        x = self._x(layer)
        pos = self._b.bufs["positions"]
        # out = hres + pf(down(gate_act(gate(n2), up(n2)))), pf: the post-norm (gemma3) or none
        down_operand, self._down_operand = self._down_operand, None
        ds_rot = self._ds_rotation(layer)
        self._proj_back(
            self._post_norm_back(layer, "down", "post_ffw_norm", a["dx"]),
            a["s"],
            layer,
            "down",
            a["ds"],
            False,
            rotated=ds_rot > 0,
            dy_operand=down_operand,
            x_codes=self._x_codes(layer, "s"),
        )
        # dL/dgate into s (the down projection's input, dead once its backward above has read it), dL/dup over u
        dg, du = a["s"], a["u"]
        operands = self._gated_backward(layer, ds_rot)
        n2 = self._x_codes(layer, "n2")
        rot = self._proj_back_sum(((dg, "gate"), (du, "up")), a["n2"], layer, a["dn"], operands, x_codes=n2)
        o_operand = self._norm_backward(
            a["dn"], a["hres"], f"blk.{layer}.ffn_norm.weight", a["dh"], a["dx"], (layer, "o"), dy_rot=rot
        )
        # hres = x + pa(o(attn(rope(qn(q(n1))), rope(kn(k(n1))), v(n1)))), qn / kn: per-head RMSNorm (qwen3, gemma3)
        # or none, pa: the post-norm (gemma3) or none
        self._proj_back(
            self._post_norm_back(layer, "o", "post_attention_norm", a["dh"]),
            a["att"],
            layer,
            "o",
            a["datt"],
            False,
            dy_operand=o_operand,
            x_codes=self._x_codes(layer, "att"),
        )
        self._attention_back(a["datt"], a["qr"], a["kr"], a["v"], a["att"], a["dqr"], a["dkr"], a["dv"], layer)
        rope = self._rope_table(layer)
        if cfg.qk_norm:  # rope back to the normed q/k, then through the per-head RMSNorm to the projections
            dq, dk = a["dq"], a["dk"]
            norm, d, eps = self.w.norms, cfg.head_dim, cfg.eps
            rope_backward(dev, rope, a["dqr"], a["dqn"], rows, cfg.n_heads, positions=pos)
            rope_backward(dev, rope, a["dkr"], a["dkn"], rows, cfg.n_kv_heads, positions=pos)
            rmsnorm_backward(
                dev, a["dqn"], a["q"], norm[f"blk.{layer}.attn_q_norm.weight"], a["dq"], rows * cfg.n_heads, d, eps
            )
            rmsnorm_backward(
                dev, a["dkn"], a["k"], norm[f"blk.{layer}.attn_k_norm.weight"], a["dk"], rows * cfg.n_kv_heads, d, eps
            )
        else:  # q and k (before RoPE) are not read by the backward: their gradients go over them
            dq, dk = a["q"], a["k"]
            rope_backward(dev, rope, a["dqr"], dq, rows, cfg.n_heads, positions=pos)
            rope_backward(dev, rope, a["dkr"], dk, rows, cfg.n_kv_heads, positions=pos)
        n1 = self._x_codes(layer, "n1")
        rot = self._proj_back_sum(((dq, "q"), (dk, "k"), (a["dv"], "v")), a["n1"], layer, a["dn"], x_codes=n1)
        below = (layer - 1, "down") if layer > self.layout.lowest_layer else None
        self._down_operand = self._norm_backward(
            a["dn"], x, f"blk.{layer}.attn_norm.weight", a["dx"], a["dh"], below, dy_rot=rot
        )

    def _norm_backward(
        self,
        dy: Any,
        x: Any,
        weight: str,
        dx: Any,
        residual: Any,
        consumer: tuple[int, str] | None,
        *,
        dy_rot: int = 0,
    ) -> Int8Matrix | None:
        """dx = residual + the RMSNorm `weight`'s input gradient of dy (rstd from x; residual None: none). dx is dY of
        projection consumer = (layer, "o" or "down") when given: where its input gradient runs on the integer GEMM
        with fused codes, dx's operand for it (dx times W's row scales) comes from the same pass and is returned, in
        self.a8 for o, for down in a buffer of its own (it outlives the recompute of the block below). dy_rot: dy
        holds dY R (rotated in blocks of dy_rot, _proj_back_sum's sum): turned back in that pass where it runs, else
        by a pass of its own first."""
        cfg, dev, rows, h = self.cfg, self.dev, self.rows, self.cfg.hidden
        norm = self.w.norms[weight]
        w8 = None
        if consumer is not None and self.fused_grad_codes_i8 and not cfg.post_norms:
            w8 = self._int8_back(*consumer)[0]
        if dy_rot and (w8 is None or h > NORM_TURNED_MAX):
            rotate_rows(dev, dy, rows, h, dy_rot)
            dy_rot = 0
        if w8 is None:
            if residual is not None:
                dev.copy(residual, dx, 4 * rows * h)
            rmsnorm_backward(dev, dy, x, norm, dx, rows, h, cfg.eps, accumulate=residual is not None)
            return None
        if consumer[1] == "o":
            out = Int8Matrix(*self.a8, rows, h, h, "input gradient")
        else:
            if self._dx_codes is None:
                self._dx_codes = i8_buffers(dev, rows, h, h, "int8 input gradient of down")
            out = self._dx_codes
        rmsnorm_backward_i8(dev, dy, x, norm, dx, out, w8.scales, cfg.eps, residual=residual, dy_rot=dy_rot)
        return out

    def _post_norm_back(self, layer: int, target: str, norm: str, dy: Any) -> Any:
        """dL/d(the o / down projection's output) given dy at the post-norm's output: dy itself without
        post-norms, else its RMSNorm backward into a["dpost"] (the norm's input is a[target], kept by the forward)."""
        if not self.cfg.post_norms:
            return dy
        weight = self.w.norms[f"blk.{layer}.{norm}.weight"]
        rmsnorm_backward(
            self.dev, dy, self.a[target], weight, self.a["dpost"], self.rows, self.cfg.hidden, self.cfg.eps
        )
        return self.a["dpost"]

    # ---- inputs ----------------------------------------------------------------------------------------
    def write_batch(self, batch: KdBatch | PairBatch) -> None:
        """Upload one batch of the objective's type (model/engine_spec.py); raises ValueError for ids outside the
        vocabulary or a prefix that does not fit the model."""
        self.objective.write(batch)

    def _record_loss_and_grads(self, micro: int) -> None:
        self._keep_blocks()
        self._acc_grads = micro > 0
        key = ("loss_and_grads", micro, self.objective.tape_key())
        self._taped(key, lambda: self._record_forward_backward(micro))

    def _record_forward_backward(self, micro: int) -> None:
        cfg = self.cfg
        h16 = self._forward_to_head(checkpoint=True)
        self.objective.head(micro, backward=True, h16=h16)
        top = cfg.n_layers - 1
        self._down_operand = self._norm_backward(
            self.a["tmp"], self._x(cfg.n_layers), "output_norm.weight", self.a["dx"], None, (top, "down")
        )
        for layer in reversed(range(self.layout.lowest_layer, cfg.n_layers)):
            # not the top block: its intermediates are still the forward's (the head writes only nf, tmp, dx and
            # its own scratch; its input x_{L-1} is still in xs)
            if layer in self._kept:
                self._refresh(layer)
            elif self._recomputed(layer):
                self._restore(layer)  # from its bf16 checkpoint (f32 checkpoints are still in place)
                self._replay_lora_t = True  # the LoRA products reuse the forward's t
                try:
                    self._block_forward(layer, for_backward=True)  # recompute from the checkpointed block input
                finally:
                    self._replay_lora_t = False
            self._block_backward(layer)

    def _refresh(self, layer: int) -> None:
        """A kept block's intermediates that live in the shared scratch, from its kept ones before its backward:
        n1 and n2 (the RMSNorms of its input and of hres) and s (the gated activation of g and u)."""
        cfg, dev, rows, norms = self.cfg, self.dev, self.rows, self.w.norms
        self._restore(layer)  # its input, read by n1 here and by the attention norm's backward
        self._use_block(layer)
        a, h = self.a, cfg.hidden
        rmsnorm_forward(dev, self._x(layer), norms[f"blk.{layer}.attn_norm.weight"], a["n1"], rows, h, cfg.eps)
        rmsnorm_forward(dev, a["hres"], norms[f"blk.{layer}.ffn_norm.weight"], a["n2"], rows, h, cfg.eps)
        self._gate_forward(dev, a["g"], a["u"], a["s"], rows * cfg.ffn)

    def _record_step(self, micro: int, then: Callable[[], None] | None = None) -> None:
        """Record micro-batch `micro`'s forward + backward (and `then`) in one step, between the objective's
        prepare and finish."""
        self.objective.prepare(micro)
        try:
            with self.dev.step():
                self._record_loss_and_grads(micro)
                if then is not None:
                    then()
        finally:
            self.objective.finish()

    def loss_and_grads(self) -> float:
        """Loss of the uploaded batch; gradients land in self.grads (read them with get_grads())."""
        self._record_step(0)
        return self.objective.micro_loss(0)

    def accumulate(self, micro: int) -> None:
        """Record forward + backward of the uploaded micro-batch `micro` (0-based) into the gradients."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{self.grad_accum - 1}")
        self._record_step(micro)

    def apply(self, lr: float) -> StepStats:
        """Average the accumulated gradients and take one AdamW step (skipped when any micro-batch's loss or the
        grad norm is not finite); the returned loss is the mean over the micro-batches."""
        n = self.grad_accum
        with self.dev.step():
            if n > 1:
                scale_inplace(self.dev, self.grads, 1.0 / n, self.layout.n_params)
            self.optim.step(self.params, self.grads, self.applied_steps + 1, lr=lr, loss=self.losses, loss_index=n - 1)
        stats = self.optim.read_stats()
        losses = self.dev.read(self.losses, np.float32, (n,))
        skipped = stats.skipped or not np.isfinite(losses).all()
        return self._count(StepStats(stats.grad_norm, stats.clip_scale, skipped, float(losses.mean())))

    def train_step(self, lr: float) -> StepStats:
        """Forward, backward and one AdamW update on the uploaded batch (grad_accum == 1), one encoder (an
        objective with a host pass: accumulate, then apply)."""
        if self.grad_accum != 1:
            raise ValueError("train_step is for grad_accum=1: call accumulate() per micro-batch, then apply()")
        if self.objective.host_pass:
            self.accumulate(0)
            return self.apply(lr)
        step = self.applied_steps + 1
        self._record_step(0, lambda: self.optim.step(self.params, self.grads, step, lr=lr, loss=self.losses))
        return self._count(self.optim.read_stats())

    def _count(self, stats: StepStats) -> StepStats:
        """Count the step as applied or skipped; raise TrainingDiverged after max_skips_in_a_row skips in a row
        (parameters and moments are those of the last applied step)."""
        if not stats.skipped:
            self.applied_steps += 1
            self.skips_in_a_row = 0
            return stats
        self.skipped_steps += 1
        self.skips_in_a_row += 1
        if self.skips_in_a_row >= self.max_skips_in_a_row:
            hint = (
                "the tensor-core path rounds matmul operands to f16 (|x| > 65504 overflows): "
                "set train.precision=f32, or lower optim.lr"
                if self.tensor_cores
                else "lower optim.lr or check the teacher's top-k shards"
            )
            raise TrainingDiverged(
                f"{self.skips_in_a_row} training steps in a row skipped: the loss or gradient norm was not finite "
                f"(last loss {stats.loss}, grad norm {stats.grad_norm}); {hint}"
            )
        return stats

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """Forward only: the objective's results of the uploaded batch (GpuKd: kd_loss [1], ce and top1 [rows];
        GpuPreference: logps, counts and the loss terms)."""
        return self.objective.evaluate()
