"""The frozen decoder forward on the GPU (llama, mistral, qwen2 with q/k/v biases, qwen3 with per-head q/k
RMSNorm; NORM or NEOX RoPE, Llama 3 frequency factors), shared by the student (training, gpu/student.py) and the teacher
(top-k, gpu/teacher.py): the weights uploaded still in their GGML types, and GPUModel, the forward over `batch`
sequences of `seq_len` tokens with optional LoRA on the 7 projections (parameters laid out by model/lora_layout.py).

Memory: each block's input is kept ([L+1, rows, H]) so a backward can recompute one block at a time from it
(or, for the blocks a GPUStudent keeps, read their intermediates from buffers of their own: `_use_block`); rows
are `batch * seq_len` tokens; only attention works per sequence (the tensor-core kernels take the whole batch in
one dispatch, the sequence in grid z; the f32 kernels one sequence at a time).
Names: `seq_len` is one sequence's tokens, `rows` all of the batch's; `target` a projection (q, k, ..., down);
`t` only LoRA's intermediate x Aᵀ [rows, r]; `k` only the key projection.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from gpu.codegen_attention_tc import ATTENTION_TC_HEAD_DIMS
from gpu.codegen_i8 import MMA_K
from gpu.device import BufferView, Device, DeviceError, Tape
from gpu.headroom import free_bytes
from gpu.ops import lora_i8
from gpu.ops.add import add, add_bias, scale_inplace
from gpu.ops.attention import attention_backward, attention_forward
from gpu.ops.attention_tc import RopeAt, attention_backward_tc, attention_forward_tc
from gpu.ops.embedding import embedding_forward
from gpu.ops.gated import geglu_forward, swiglu_forward
from gpu.ops.half import from_bf16, to_bf16, to_f16
from gpu.ops.lora import (
    lora_expand,
    lora_forward,
    lora_project,
    lora_project_group,
    lora_rank16,
    lora_term,
    view_span,
)
from gpu.ops.lora_i8 import LoraCodes, LoraGradCodes, lora_thin_i8, thin_covers
from gpu.ops.lora_matmul import HalfCopy
from gpu.ops.lora_mirror import LoraMirrors, mirrors_cover
from gpu.ops.matmul import linear, linear_input_grad
from gpu.ops.matmul_i8 import Int8Matrix, LoraTerm, gemm_i8, i8_buffers, int8_emulated, int8_problem
from gpu.ops.matmul_tc import has_tensor_cores, linear_input_grad_tc, linear_tc, tensor_core_problem
from gpu.ops.quantize_i8 import (
    FUSED_NORM_ROTATED_WIDTH,
    glu_i8,
    pair_bytes,
    quantize_i8_gpu,
    rmsnorm_i8,
    row_workgroup,
    weight_to_i8,
)
from gpu.ops.rmsnorm import rmsnorm_forward
from gpu.ops.rope import RopeTable, rope_forward
from gpu.weights import QuantTensor, upload_quant
from model.config import BIAS_TARGETS, LORA_TARGETS, ModelConfig
from model.engine_spec import PRECISIONS
from model.int8 import rotation_block
from model.lora_layout import LoraLayout, aligned_floats
from model.reference import LoraPair
from schemas.config import lora_scale

PREFETCH = 2  # tensors read ahead of the upload
INT8_CODES = ("auto", "resident", "per_block")  # GPUModel.keep_codes
# padded per-sequence attention slots (GPUModel.direct_attention False) and whether each holds q- or kv-width rows
_SLOT_KIND = {"aq": "q", "ak": "kv", "av": "kv", "ao": "q", "adq": "q", "adk": "kv", "adv": "kv", "ado": "q"}


# ---- frozen weights --------------------------------------------------------------------------------------
@dataclass
class ModelWeights:
    """A frozen model (the student, or the teacher) on the GPU: 2-D projections in their GGML types, lm_head as
    stored; norms (q/k norms included) and q/k/v biases in f32."""

    cfg: ModelConfig
    embed: QuantTensor
    lm_head: QuantTensor  # [V, H]; the tied token_embd when there is no output.weight
    norms: dict[str, Any]
    proj: dict[tuple[int, str], QuantTensor]
    nbytes: int = 0
    biases: dict[tuple[int, str], Any] = field(default_factory=dict)
    # the projections' int8 codes decoded once and kept, by (layer, target, rotation block): the resident codes of
    # GPUModel.keep_codes, shared by every model over these weights
    codes_i8: dict[tuple[int, str, int], Int8Matrix] = field(default_factory=dict)
    # their rows' scales alone (f32 [rows] buffers), for the decodes one block at a time (GPUModel.keep_codes)
    scales_i8: dict[tuple[int, str, int], Any] = field(default_factory=dict)

    @classmethod
    def upload(
        cls,
        dev: Device,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, np.ndarray, int, tuple[int, ...]]],
    ) -> ModelWeights:
        """Upload (name, raw GGML bytes or f32 array, ggml type, numpy shape) one tensor at a time."""
        from model.quant import dequantize

        stem_to_target = {v: k for k, v in LORA_TARGETS.items()}
        norms: dict[str, Any] = {}
        proj: dict[tuple[int, str], QuantTensor] = {}
        biases: dict[tuple[int, str], Any] = {}
        embed = lm_head = None
        total = 0
        for name, data, qtype, shape in tensors:
            parts = name.split(".")
            if name == "token_embd.weight":
                embed = upload_quant(dev, data, qtype, shape, name)
                total += embed.nbytes
                if cfg.tied_embeddings:
                    lm_head = embed
            elif name == "output.weight":
                lm_head = upload_quant(dev, data, qtype, shape, name)
                total += lm_head.nbytes
            elif name.endswith("_norm.weight"):
                norms[name] = _upload_f32(dev, dequantize(data, qtype, shape).reshape(-1), name)
            elif parts[0] == "blk" and parts[-1] == "bias" and parts[2] in stem_to_target:
                biases[(int(parts[1]), stem_to_target[parts[2]])] = _upload_f32(
                    dev, dequantize(data, qtype, shape).reshape(-1), name
                )
            elif parts[0] == "blk" and parts[2] in stem_to_target:
                weight = upload_quant(dev, data, qtype, shape, name)
                key = (int(parts[1]), stem_to_target[parts[2]])
                proj[key] = weight
                total += weight.nbytes
        missing = [
            f"blk.{i}.{LORA_TARGETS[target]}.weight"
            for i in range(cfg.n_layers)
            for target in LORA_TARGETS
            if (i, target) not in proj
        ]
        missing += [n for n, v in (("token_embd.weight", embed), ("lm_head", lm_head)) if v is None]
        for i in range(cfg.n_layers):
            if cfg.qkv_bias:
                absent = [target for target in BIAS_TARGETS if (i, target) not in biases]
                missing += [f"blk.{i}.{LORA_TARGETS[target]}.bias" for target in absent]
            if cfg.qk_norm:
                missing += [n for n in (f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight") if n not in norms]
            if cfg.post_norms:
                missing += [
                    n
                    for n in (f"blk.{i}.post_attention_norm.weight", f"blk.{i}.post_ffw_norm.weight")
                    if n not in norms
                ]
        if missing:
            raise DeviceError(f"student weights incomplete: missing {', '.join(missing[:5])}")
        return cls(cfg, embed, lm_head, norms, proj, total, biases if cfg.qkv_bias else {})

    @classmethod
    def from_arrays(
        cls, dev: Device, cfg: ModelConfig, weights: Mapping[str, np.ndarray], qtype: int = Q.F32
    ) -> ModelWeights:
        """Upload float weights (GGUF names), quantizing 2-D projections to `qtype` (tests, random models)."""
        from model.quant import quantize

        def items() -> Iterator[tuple[str, np.ndarray, int, tuple[int, ...]]]:
            for name, w in weights.items():
                w = np.asarray(w, np.float32)
                is_proj = w.ndim == 2 and name.startswith("blk.")
                wtype = qtype if is_proj else Q.F32
                yield name, quantize(w, wtype) if wtype != Q.F32 else w, wtype, w.shape

        return cls.upload(dev, cfg, items())

    @classmethod
    def from_gguf(cls, dev: Device, path: Any, progress: Callable[[Any], None] | None = None) -> ModelWeights:
        """Stream a GGUF tensor by tensor into GPU memory, still quantized.

        A background thread reads the next tensors from the memory map (at most `PREFETCH` in flight, so host
        memory stays bounded by a few tensors) while this thread uploads; `progress(info)` after each upload."""
        from model.gguf import GGUFFile

        with GGUFFile(path) as f:
            cfg = f.config()
            items: queue.Queue = queue.Queue(maxsize=PREFETCH)
            stop = threading.Event()

            def read_ahead() -> None:
                try:
                    for info, raw in f.iter_tensors():
                        if stop.is_set():
                            return
                        items.put((info, np.array(raw)))  # copy: pages the tensor in off the main thread
                    items.put(None)
                except BaseException as exc:  # surfaced on the main thread
                    items.put(exc)

            reader = threading.Thread(target=read_ahead, name="gguf-read-ahead", daemon=True)
            reader.start()

            def tensors() -> Iterator[tuple[str, np.ndarray, int, tuple[int, ...]]]:
                while (item := items.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    info, raw = item
                    yield info.name, raw, info.ggml_type, info.shape
                    if progress is not None:
                        progress(info)

            try:
                return cls.upload(dev, cfg, tensors())
            finally:
                stop.set()
                while reader.is_alive():  # unblock a reader waiting on a full queue
                    with contextlib.suppress(queue.Empty):
                        items.get_nowait()
                    reader.join(timeout=0.01)


def attention_settings(cfg: ModelConfig, layer: int | None = None) -> dict[str, Any]:
    """The f32 attention ops' window and scale for block `layer` (any block: None) of a model whose attention
    is not plain causal 1/sqrt(D) (gemma3); {} for the others."""
    if not any(cfg.attention_windows) and not cfg.query_pre_attn_scalar:
        return {}
    window = max(cfg.attention_windows, default=0) if layer is None else cfg.window(layer)
    return {"window": window, "scale": cfg.attention_scale}


def _upload_f32(dev: Device, a: np.ndarray, label: str) -> Any:
    return dev.upload(np.ascontiguousarray(a, dtype=np.float32), label=label)


# ---- activations -----------------------------------------------------------------------------------------
@dataclass
class _Buffers:
    """Every activation / gradient scratch for one (batch, seq_len) shape; built once, reused every step."""

    dev: Device
    cfg: ModelConfig
    batch: int
    seq_len: int
    r: int
    bufs: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.batch * self.seq_len

    def get(self, name: str, n_elems: int) -> Any:
        if name not in self.bufs:
            self.bufs[name] = self.dev.buffer(4 * max(n_elems, 1), label=f"student {name}")
        return self.bufs[name]


def resolve_precision(dev: Device, precision: str) -> str:
    """f32 (portable, strict parity), tensorcore (f16 operands, f32 accumulation), int8 (tensorcore with the
    frozen projections' forward on the integer tensor cores: int8 activations and weights with per-row scales,
    rotated in Walsh-Hadamard blocks), or auto (tensorcore when the device has subgroup matrices; a distillation
    student's: student_precision)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "tensorcore" if has_tensor_cores(dev) else "f32"
    if precision == "int8" and int8_emulated(dev):  # tests: the rest of the int8 path as f32
        return precision
    if precision in ("tensorcore", "int8") and not has_tensor_cores(dev):
        raise DeviceError(f"precision {precision!r} needs Dawn subgroup matrices: {tensor_core_problem(dev)}")
    if precision == "int8" and (problem := int8_problem(dev)) is not None:
        raise DeviceError(f"precision 'int8' needs integer subgroup matrices: {problem}")
    return precision


def student_precision(dev: Device, precision: str) -> str:
    """A distillation student's training precision: as resolve_precision, except that auto takes int8 where the
    device has integer subgroup matrices (the demo trained through it ends within 1 % of the f16 path's held-out
    KL on the H200: docs/benchmarks.md). The teacher, the held-out evaluation and preference training keep
    resolve_precision's auto (tensorcore)."""
    resolved = resolve_precision(dev, precision)
    if precision == "auto" and resolved == "tensorcore" and not int8_emulated(dev) and int8_problem(dev) is None:
        return "int8"
    return resolved


class GPUModel:
    """Forward of the frozen model (optionally with LoRA) over `batch` sequences of `seq_len` tokens."""

    keeps_block_inputs = True  # every block's input stays in xs (a backward recomputes from them)
    saves_lora_t = False  # one t = x A^T per adapted projection, kept for a backward (GPUStudent)
    shared_lora_inputs = True  # LoRA products over an input shared by projections as one (t = x A^T, dA = dt^T x)
    # int8: a projection's LoRA term (s t B^T forward, dt A R input gradient) in its integer GEMM's epilogue, on the
    # f16 tensor cores (off: passes of their own over y and dx; the Llama-3-8B step on an H100 4,702 vs 4,591
    # tokens/s, docs/benchmarks.md)
    lora_in_gemm_i8 = True
    # int8: both operands of the projections' integer GEMMs rotated along their inputs in Walsh-Hadamard blocks
    # (model/int8.py rotation_block): an outlier input spreads over its block, so per-row 8-bit scales fit (the
    # demo trained through int8: held-out KL +22 % over tensorcore's per row, +1.9 .. 2.7 % rotated;
    # docs/benchmarks.md)
    int8_rotation = True
    # int8: the block's RMSNorms and gated unit give their outputs' int8 codes in the same pass (gpu/ops/quantize_i8.py
    # rmsnorm_i8, glu_i8; bitwise the separate quantizer's) instead of a quantizer reading them back
    fused_codes_i8 = True
    # int8, no post-norms: the block's two residual adds (x + o, h + down) in the o and down projections' integer
    # GEMM epilogues (C = R + ..., the same sums bitwise) instead of add passes over their outputs (+0.4 % on the
    # Llama-3-8B step, H100 A/B 2026-12-06; bench --ab residual-pass)
    residual_in_gemm_i8 = True
    # tensor-core attention: q and k RoPE'd as they are packed to f16 (the same operands, bitwise) instead of a
    # RoPE pass writing f32 copies that the pack reads back
    rope_in_pack = True

    def __init__(
        self,
        dev: Device,
        weights: ModelWeights,
        *,
        batch: int,
        seq_len: int,
        targets: Iterable[str] = (),
        r: int = 1,
        alpha: float = 1.0,
        layers: Iterable[int] | None = None,
        precision: str = "f32",
        start_layer: int = 0,
    ) -> None:
        self.dev, self.w, self.cfg = dev, weights, weights.cfg
        cfg = self.cfg
        self.precision = resolve_precision(dev, precision)
        # f16 tensor cores: tensorcore, and int8 beside its integer GEMMs (f32 where those run emulated, in tests)
        self.tensor_cores = self.precision == "tensorcore" or (self.precision == "int8" and not int8_emulated(dev))
        self._linear, self._linear_grad = (
            (linear_tc, linear_input_grad_tc) if self.tensor_cores else (linear, linear_input_grad)
        )
        # attention on tensor cores for the head dims it is generated for (gpu/codegen_attention_tc.py) and plain
        # causal 1/sqrt(D) attention, else f32 (which also takes gemma3's sliding windows and score scale)
        tc_attention = self.tensor_cores and cfg.head_dim in ATTENTION_TC_HEAD_DIMS and not attention_settings(cfg)
        self._attention_fwd, self._attention_bwd = (
            (attention_forward_tc, attention_backward_tc) if tc_attention else (attention_forward, attention_backward)
        )
        if seq_len > cfg.context_length:
            raise ValueError(f"seq_len={seq_len} exceeds the model's context length {cfg.context_length}")
        # tensor cores: each projection's input is packed to f16 once (q/k/v and gate/up share it) and the
        # GEMMs read it with their f16-A kernels (the same rounding they apply to f32 A, at half the bytes)
        self._pack_inputs = self.tensor_cores
        self.layout = LoraLayout.build(cfg, targets, r, layers)
        if not 0 <= start_layer < cfg.n_layers or (self.layout.slots and start_layer > self.layout.lowest_layer):
            raise ValueError(
                f"start_layer={start_layer}: must be a block at or below the lowest adapted block "
                f"{self.layout.lowest_layer} (blocks below it carry no LoRA)"
            )
        self.start_layer = start_layer  # > 0: the forward starts here from a given residual stream (write_prefix)
        # int8: one block's projections at a time as per-row int8 codes (those whose rows are a multiple of one
        # integer step; the rest keep the f16 path), decoded from their GGML types when the block needs them
        self._w8_slots: dict[str, Int8Matrix] = {}
        if self.precision == "int8":
            for target in LORA_TARGETS:
                d_out, d_in = cfg.target_shape(target)
                if d_in % MMA_K == 0:
                    self._w8_slots[target] = i8_buffers(dev, d_out, d_in, d_in, f"int8 {target}")
        self._w8_block: int | None = None  # the block whose codes the slots hold when the commands so far have run
        self.resident_codes = False  # every projection's codes kept in self.w.codes_i8 instead (keep_codes)
        self.scale = lora_scale(alpha, r)
        self.batch, self.seq_len = batch, seq_len
        self.rows = batch * seq_len
        self.params = dev.buffer(4 * max(self.layout.n_params, 1), label="lora params")
        self.rope = RopeTable.for_model(dev, cfg, seq_len)
        # gemma3: the sliding-window blocks' own RoPE (rope_local_base, unscaled)
        local = next((i for i in range(cfg.n_layers) if cfg.rope_of(i) != cfg.rope_of()), None)
        self._local_rope = None if local is None else RopeTable.for_model(dev, cfg, seq_len, layer=local)
        self._gate_forward = geglu_forward if cfg.activation == "gelu_tanh" else swiglu_forward
        self._b = _Buffers(dev, cfg, batch, seq_len, r)
        self._alloc()
        self._tapes: dict[Hashable, Tape] = {}  # recorded steps by what shapes their commands (see _taped)

    def _taped(self, key: Hashable, record: Callable[[], None]) -> None:
        """Run record() inside the current step, keeping its commands as a tape; a later call with the same key
        replays the tape instead (a training step records 4,000-6,000 dispatches: replaying costs a fraction
        of recording them). The key must name everything the commands depend on besides buffer contents.
        With a profiler attached the step is recorded (its scopes classify the kernels) and not kept."""
        self._w8_block = None  # a tape's commands decode the int8 codes they need (see _int8_weight)
        try:
            if self.dev.profiler is not None:
                record()
                return
            tape = self._tapes.get(key)
            if tape is not None:
                self.dev.replay(tape)
                return
            with self.dev.taping() as tape:
                record()
            if tape.replayable:
                self._tapes[key] = tape
        finally:
            self._w8_block = None

    # ---- parameters ------------------------------------------------------------------------------------
    def set_adapter(self, adapter: Mapping[tuple[int, str], LoraPair]) -> None:
        self.dev.write(self.params, self.layout.pack(adapter))

    def get_adapter(self) -> dict[tuple[int, str], LoraPair]:
        return self.layout.unpack(self.dev.read(self.params, np.float32, (self.layout.n_params,)))

    def _view(self, buf: Any, off: int, n: int) -> BufferView:
        return BufferView(buf, 4 * off, 4 * n)

    def _lora(self, layer: int, target: str, buf: Any) -> tuple[BufferView, BufferView] | None:
        s = self.layout.slots.get((layer, target))
        if s is None:
            return None
        r = self.layout.r
        return self._view(buf, s.a_off, r * s.d_in), self._view(buf, s.b_off, s.d_out * r)

    # ---- buffers ---------------------------------------------------------------------------------------
    def _alloc(self) -> None:
        cfg, rows = self.cfg, self.rows
        h, f, qd, kvd = cfg.hidden, cfg.ffn, cfg.q_dim, cfg.kv_dim
        self.slot = aligned_floats(rows * h)
        b = self._b.get
        # the block inputs a backward recomputes from: all in f32, or (bf16 checkpoints) each in bf16 in xs16 and
        # only the two being worked on in f32, alternating like a forward-only model's
        self.bf16_checkpoints = self.keeps_block_inputs and self._wants_bf16_checkpoints()
        self._f32_inputs = self.keeps_block_inputs and not self.bf16_checkpoints
        self.xs = b("layer inputs", (cfg.n_layers + 1 if self._f32_inputs else 2) * self.slot)
        if self.bf16_checkpoints:  # blocks 0 .. L-2: the top block is never recomputed
            self.slot16 = aligned_floats(rows * h // 2)  # u32 words: two bf16 each
            self.xs16 = b("layer inputs bf16", max(cfg.n_layers - 1, 1) * self.slot16)
        for name in ("ids", "positions"):  # an objective's own inputs are its own (gpu/objectives.py)
            b(name, rows)
        sizes = {
            "n1": h,
            "q": qd,
            "k": kvd,
            "v": kvd,
            "qr": qd,
            "kr": kvd,
            "att": qd,
            "hres": h,
            "n2": h,
            "g": f,
            "u": f,
            "s": f,
            "tmp": h,
            "nf": h,
            **self._gradient_widths(),
        }
        if cfg.qk_norm:  # q and k after their per-head RMSNorm
            sizes.update({"qn": qd, "kn": kvd})
        if cfg.post_norms:  # the o and down projections' outputs before their post-norm (its backward reads them)
            sizes.update({"o": h, "down": h})
        self.a = {name: b(name, rows * n) for name, n in sizes.items()}
        self.seq_q = aligned_floats(self.seq_len * qd)
        self.seq_kv = aligned_floats(self.seq_len * kvd)
        self.seq_lse = aligned_floats(cfg.n_heads * self.seq_len)
        # attention tensors: the tensor-core kernels take the whole batch at once; the f32 kernels take one
        # sequence at a time, bound as views into the packed buffers, else padded slots rows are copied through
        self.batched_attention = self._attention_fwd is attention_forward_tc
        self.direct_attention = self.batched_attention or self._sequences_aligned()
        if not self.direct_attention:
            for name, kind in _SLOT_KIND.items():
                self.a[name] = b(name, self.batch * (self.seq_q if kind == "q" else self.seq_kv))
        self.a["lse"] = b("lse", self.batch * self.seq_lse)
        # the scratch above serves every block; a block that keeps its intermediates for the backward has its own
        # buffers in place of some (GPUStudent kept_blocks, gpu/kept_blocks.py), and self.a points at the set of
        # the block being worked on (_use_block)
        self._scratch = self.a
        self._kept: dict[int, dict[str, Any]] = {}
        self.delta = b("attention delta", cfg.n_heads * self.seq_len)
        r = self.layout.r
        if self.saves_lora_t:  # the forward's t of every adapted (layer, target), for the backward
            self._t_slot = aligned_floats(rows * r)
            self._t_index = {key: i for i, key in enumerate(self.layout.slots)}
            self.t_saved = b("lora t per projection", max(len(self._t_index), 1) * self._t_slot)
        else:  # one t per target, reused by every block
            self.t_lora = {target: b(f"lora t {target}", rows * r) for target in LORA_TARGETS}
        self._replay_lora_t = False  # set while a backward recomputes a block whose t the forward left
        self.dt = b("lora dt", rows * r)
        self._a16_second: int | None = None  # the byte offset of a second f16 operand in a16, where there is room
        if self._pack_inputs:  # f16 GEMM inputs, one at a time (2 bytes per element: half the f32 floats)
            one = rows * max(h, f, qd, kvd) * 2
            if self._f16_pair():  # room for a second at a binding offset (GPUStudent._gated_backward)
                self._a16_second = -(-one // self.dev.offset_alignment) * self.dev.offset_alignment
            self.a16 = b("gemm input f16", -(-((self._a16_second or 0) + one) // 4))
        if self._w8_slots:  # int8 GEMM inputs, one at a time: codes (4 per word) and a scale per row (room for two
            # at once: i8_pair, the gated unit's gradients); the input gradients' column scales (ones: W's row scales
            # are folded into dY)
            q_bytes, s_bytes = pair_bytes(rows, max(h, f, qd), self.dev.offset_alignment)
            self.a8 = b("gemm input int8", -(-q_bytes // 4)), b("gemm input int8 scales", -(-s_bytes // 4))
            self.ones = self.dev.upload(np.ones(max(h, f, qd), np.float32), label="int8 column scales")
            if r:  # the LoRA terms of the integer GEMMs' epilogues, one at a time (f16, rank padded to 16)
                lr = lora_rank16(r)
                self.lora16 = b("int8 lora t16", rows * lr // 2), b("int8 lora L16", max(h, f, qd, kvd) * lr // 2)
        # int8 with the LoRA terms in the epilogues: the parameters' f16 mirrors, and t16 beside each kept t
        self.mirrors: LoraMirrors | None = None
        if self._w8_slots and self.lora_in_gemm_i8 and self.layout.slots and mirrors_cover(r):
            self.mirrors = LoraMirrors(self.dev, self.layout.slots, r, self._mirror_rotation())
            self._t16_slot = -(-rows * r // (self.dev.offset_alignment // 2)) * (self.dev.offset_alignment // 2)
            n_t = len(self._t_index) if self.saves_lora_t else len(LORA_TARGETS)
            self.t16 = b("lora t16 per projection", n_t * self._t16_slot // 2)
        # int8: every adapter's A as int8 codes rotated like the weight codes, for t = x A^T from x's codes
        # (gpu/ops/lora_i8.py THIN_I8)
        self.lora_codes: LoraCodes | None = None
        if self._w8_slots and lora_i8.THIN_I8 and self.layout.slots:
            self.lora_codes = LoraCodes(self.dev, self.layout.slots, r, self._rotation)
        self.grad_codes: LoraGradCodes | None = None  # B / sW for dt from dY's codes (a GPUStudent's, THIN_DT)

    def _mirror_rotation(self) -> Callable[[int], int] | None:
        """The rotation block by input width of the A mirrors (the input gradients' LoRA terms); None: no A
        mirrors (a forward-only model)."""
        return None

    def _t16(self, layer: int, target: str) -> tuple[int, BufferView]:
        """Where t16 = f16(s t) of (layer, target) lives beside its t (_lora_t): (element offset in self.t16,
        its view)."""
        r = self.layout.r
        i = self._t_index[(layer, target)] if self.saves_lora_t else list(LORA_TARGETS).index(target)
        off = i * self._t16_slot
        return off, BufferView(self.t16, 2 * off, 2 * self.rows * r)

    def _t16_copy(self, keys: list[tuple[int, str]]) -> HalfCopy | None:
        """The f16 copies of the t's of `keys` (one product's column groups), written with them (mirrors only)."""
        if self.mirrors is None:
            return None
        return HalfCopy(self.t16, tuple(self._t16(*key)[0] for key in keys), self.layout.r, self.scale)

    def _gemm_input(self, x: Any, width: int) -> tuple[Any, dict[str, Any]]:
        """The A operand for a projection GEMM over x [rows, width] and the GEMM's extra arguments: x itself
        (f32), or with tensor cores its f16 copy packed into self.a16 (valid until the next f16 operand)."""
        x16 = self._half_copy(self.rows * width)
        if x16 is not None:
            to_f16(self.dev, x, x16, self.rows * width)
        return self._operand(x, x16)

    def _half_copy(self, n_elems: int) -> Any:
        """Where a producer kernel writes the f16 copy of its n_elems result for the next projection (self.a16,
        as _gemm_input would pack it), or None (f32 path, or a size to_f16 would not pack)."""
        return self.a16 if self._pack_inputs and n_elems % 4 == 0 else None

    @staticmethod
    def _operand(x: Any, x16: Any) -> tuple[Any, dict[str, Any]]:
        """A projection's A operand and GEMM arguments: x16 (f16) when the producer wrote one, else x."""
        return (x, {}) if x16 is None else (x16, {"a_dtype": "f16"})

    def _normed(
        self,
        x: Any,
        weight: str,
        y: Any,
        *,
        head: bool = False,
        codes: tuple[Any, Any] | None = None,
        store_y: bool = True,
    ) -> tuple[Any, dict[str, Any]]:
        """y = RMSNorm(x) with norm weight `weight` over the rows, and y's operand for the projections (head:
        for the LM head): its f16 copy from the same kernel with tensor cores, int8 codes with int8 (into `codes`,
        else self.a8; store_y=False: y itself may stay unwritten where the codes come from the same pass)."""
        rows, h = self.rows, self.cfg.hidden
        int8 = bool(self._w8_slots) and not head
        rot = self._rotation(h)
        if int8 and self.fused_codes_i8 and h % MMA_K == 0 and (rot == 0 or h <= FUSED_NORM_ROTATED_WIDTH):
            a = Int8Matrix(*(codes or self.a8), rows, h, h, "gemm input")
            rmsnorm_i8(self.dev, x, self.w.norms[weight], y, a, self.cfg.eps, rot, store_y=store_y)
            return a, {"int8": True}
        y16 = None if int8 else self._half_copy(rows * h)
        rmsnorm_forward(self.dev, x, self.w.norms[weight], y, rows, h, self.cfg.eps, y16=y16)
        return self._forward_input(y, h, codes) if int8 else self._operand(y, y16)

    def _forward_int8(self, width: int) -> bool:
        """Whether the frozen forward GEMMs over inputs of `width` run on the integer GEMM (widths that are no
        multiple of one integer step keep the f16 path)."""
        return bool(self._w8_slots) and width % MMA_K == 0

    def _forward_input(self, x: Any, width: int, codes: tuple[Any, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """The A operand of the frozen forward GEMMs over x [rows, width]: with int8, x's codes and per-row
        scales (into `codes`, else self.a8, valid until the next int8 operand; widths that are no multiple of one
        integer step keep the f16 path), else as _gemm_input."""
        if not self._forward_int8(width):
            return self._gemm_input(x, width)
        a = Int8Matrix(*(codes or self.a8), self.rows, width, width, "gemm input")
        quantize_i8_gpu(self.dev, x, a, rot=self._rotation(width))
        return a, {"int8": True}

    def _lora_in_gemm(self, cols: int) -> bool:
        """Whether an integer GEMM with `cols` output columns takes its LoRA term in the epilogue (lora_in_gemm_i8,
        and C in whole 16 x 16 blocks)."""
        return self.lora_in_gemm_i8 and self.rows % 16 == 0 and cols % 16 == 0

    def _rotation(self, width: int) -> int:
        """The Walsh-Hadamard block of the integer GEMMs over inputs of `width` (0: not rotated)."""
        return rotation_block(width) if self.int8_rotation else 0

    def _gradient_widths(self) -> dict[str, int]:
        """Per-row widths of the backward's scratch buffers (none for a forward-only model)."""
        return {}

    def _f16_pair(self) -> bool:
        """Whether self.a16 holds two f16 operands at once (a backward's gated-unit gradients; none forward-only)."""
        return False

    def _x_offset(self, layer: int) -> int:
        """Float offset of block `layer`'s input in xs (a forward-only model, or one with bf16 checkpoints, keeps
        two, alternating)."""
        return (layer if self._f32_inputs else layer % 2) * self.slot

    def _wants_bf16_checkpoints(self) -> bool:
        """Whether the block inputs kept for a backward are bf16 (GPUStudent: its `checkpoints` option)."""
        return False

    def _input_f32_needed(self, layer: int, name: str) -> bool:
        """Whether anything reads block `layer`'s projection input `name` (n1, n2, s) in f32 besides its int8 codes
        (GPUStudent: not where its adapters take t and dA from the codes)."""
        return True

    def _input_codes(self, layer: int, name: str) -> tuple[Any, Any] | None:
        """Where block `layer`'s forward puts the int8 codes of projection input `name` (n1, att, n2, s) when they
        must outlive the next int8 operand (GPUStudent: its backward's dA from them), else None (self.a8)."""
        return None

    def _recomputed(self, layer: int) -> bool:
        """Whether a backward recomputes block `layer` from its kept input: the adapted blocks but the top one,
        whose intermediates are still the forward's when the backward reaches it."""
        return self.layout.lowest_layer <= layer < self.cfg.n_layers - 1

    def _checkpoint(self, layer: int) -> None:
        """Keep block `layer`'s input (in xs) as its bf16 checkpoint when a backward will recompute from it;
        nothing with f32 checkpoints (xs keeps them all)."""
        if self.bf16_checkpoints and self._recomputed(layer):
            to_bf16(self.dev, self._x(layer), self._x16(layer), self.rows * self.cfg.hidden)

    def _restore(self, layer: int) -> None:
        """Block `layer`'s input back into xs from its bf16 checkpoint, for the backward's recompute."""
        if self.bf16_checkpoints:
            from_bf16(self.dev, self._x16(layer), self._x(layer), self.rows * self.cfg.hidden)

    def _x16(self, layer: int) -> BufferView:
        return self._view(self.xs16, layer * self.slot16, self.rows * self.cfg.hidden // 2)

    def _x(self, layer: int) -> BufferView:
        return self._view(self.xs, self._x_offset(layer), self.rows * self.cfg.hidden)

    # ---- one projection (frozen W + LoRA) ---------------------------------------------------------------
    def keep_codes(self, setting: str, share: float = 1.0) -> bool:
        """int8: whether every projection's codes stay decoded in self.w.codes_i8 (shared by the models over these
        weights; a byte a weight and a scale a row: 7.0 GB at the Llama-3-8B shape) instead of one block's at a time
        in the slots: setting "resident", or "auto" where the missing ones fit after what the process holds
        (gpu/headroom.py; none fit where the device reports no memory), never "per_block". Decodes the missing ones
        now; sets and returns self.resident_codes. share < 1: this model has that fraction of the GPU."""
        if setting not in INT8_CODES:
            raise ValueError(f"int8_codes={setting!r}: expected one of {', '.join(INT8_CODES)}")
        w = self.w
        keys = [
            (layer, t, self._rotation(s.k)) for layer in range(self.cfg.n_layers) for t, s in self._w8_slots.items()
        ]
        missing = [key for key in keys if key not in w.codes_i8]
        need = sum(w.proj[key[:2]].shape[0] * (w.proj[key[:2]].shape[1] + 4) for key in missing)
        fits = need <= free_bytes(self.dev.memory_bytes(), self.dev.live_bytes, share)
        self.resident_codes = bool(keys) and (setting == "resident" or (setting == "auto" and fits))
        if self.resident_codes and missing:
            with self.dev.step():
                for layer, target, rot in missing:
                    w.codes_i8[(layer, target, rot)] = weight_to_i8(self.dev, w.proj[(layer, target)], rot=rot)
        elif not self.resident_codes:
            self._row_scales(keys)
        return self.resident_codes

    def _row_scales(self, keys: list[tuple[int, str, int]]) -> None:
        """The row scales of the projections `keys` ((layer, target, rotation)) into self.w.scales_i8, where they are
        missing (a decode each, now): later decodes one block at a time then write the codes alone, without the
        absmax over each row and its workgroup reduction (weight_to_i8 fixed_scales; the same codes)."""
        missing = [key for key in keys if key not in self.w.scales_i8]
        if not missing:
            return
        with self.dev.step():
            for layer, target, rot in missing:
                slot = self._w8_slots[target]
                scales = self.dev.buffer(4 * slot.rows, label="int8 row scales")
                weight_to_i8(self.dev, self.w.proj[(layer, target)], replace(slot, scales=scales), rot=rot)
                self.w.scales_i8[(layer, target, rot)] = scales

    def _int8_weight(self, layer: int, target: str) -> Int8Matrix | None:
        """Projection `target` of block `layer` as int8 codes with per-row scales for the integer GEMMs (None:
        it keeps the f16 path): the resident ones (keep_codes), or the slots', which hold one block at a time: the
        block's first integer GEMM decodes all its projections from their GGML types (gpu/kernels/weight_i8.wgsl;
        6 % of the Llama-3-8B step on an H100)."""
        slot = self._w8_slots.get(target)
        if slot is None:
            return None
        if self.resident_codes:
            return self.w.codes_i8[(layer, target, self._rotation(slot.k))]
        if self._w8_block != layer:
            for other, out in self._w8_slots.items():
                rot = self._rotation(out.k)
                scales = self.w.scales_i8.get((layer, other, rot))
                fixed = scales is not None
                out = replace(out, scales=scales) if fixed else out
                weight_to_i8(self.dev, self.w.proj[(layer, other)], out, rot=rot, fixed_scales=fixed)
            self._w8_block = layer
        scales = self.fixed_row_scales(layer, target)
        return slot if scales is None else replace(slot, scales=scales)

    def fixed_row_scales(self, layer: int, target: str) -> Any:
        """The row scales of projection `target` of block `layer`'s int8 codes where they are fixed (the resident
        codes', or those kept by keep_codes), else None (each decode of its block computes them anew)."""
        slot = self._w8_slots.get(target)
        if slot is None:
            return None
        key = (layer, target, self._rotation(slot.k))
        codes = self.w.codes_i8.get(key) if self.resident_codes else None
        return codes.scales if codes is not None else self.w.scales_i8.get(key)

    def _lora_t_shared(
        self, x: Any, layer: int, targets: tuple[str, ...], operand: tuple[Any, dict] | None = None
    ) -> bool:
        """t = x A^T of the adapted projections among `targets` (which share the input x), in one product over x
        (lora_project_group, or lora_thin_i8 over x's int8 `operand`), when more than one is adapted and their t's
        are kept (saves_lora_t) and not already there (the backward's recompute replays them); returns whether it
        ran (their _proj then skip it)."""
        keys = [(layer, t) for t in targets if (layer, t) in self.layout.slots]
        if not (self.shared_lora_inputs and self.saves_lora_t and len(keys) > 1) or self._replay_lora_t:
            return False
        if self._thin_i8(operand, keys):
            span, offs = view_span([self._lora_t(*key) for key in keys], "t")
            lora_thin_i8(self.dev, operand[0], self.lora_codes, keys, span, offs, self._t16_copy(keys))
            return True
        a_views = [self._lora(*key, self.params)[0] for key in keys]
        t_views = [self._lora_t(*key) for key in keys]
        d_in = self.cfg.target_shape(targets[0])[1]
        lora_project_group(self.dev, x, a_views, t_views, self.rows, d_in, self.layout.r, half=self._t16_copy(keys))
        return True

    def _thin_i8(self, operand: tuple[Any, dict] | None, keys: list[tuple[int, str]]) -> bool:
        """Whether t = x A^T of the adapters `keys` comes from x's int8 codes (lora_thin_i8): THIN_I8's codes cover
        them and `operand` is x's int8 operand in a shape the kernel takes."""
        if self.lora_codes is None or operand is None or not operand[1].get("int8"):
            return False
        return self.lora_codes.covers(keys) and thin_covers(operand[0], self.layout.r * len(keys))

    def _proj(
        self,
        x: Any,
        layer: int,
        target: str,
        y: Any,
        gemm_input: tuple[Any, dict] | None = None,
        *,
        t_ready: bool = False,
        residual: Any = None,
    ) -> None:
        """y = x W^T (+ bias) (+ LoRA); gemm_input: x's GEMM operand when the caller has it (shared between
        projections, or written by x's producer), else packed here by _gemm_input. t_ready: the LoRA's t = x A^T
        is already in its slot (_lora_t_shared, or a recompute's replay). residual (an integer GEMM only): y =
        residual + that, added in the GEMM's epilogue."""
        t_ready = t_ready or self._replay_lora_t
        d_out, d_in = self.cfg.target_shape(target)
        a, kw = gemm_input or self._forward_input(x, d_in)
        if residual is not None and not kw.get("int8"):
            raise DeviceError(f"blk.{layer}.{target}: a residual in the epilogue needs the integer GEMM")
        ab = self._lora(layer, target, self.params)
        t, r = (self._lora_t(layer, target), self.layout.r) if ab is not None else (None, 0)
        if ab is not None and not t_ready and self._thin_i8((a, kw), [(layer, target)]):
            half = self._t16_copy([(layer, target)])
            lora_thin_i8(self.dev, a, self.lora_codes, [(layer, target)], t, [0], half)
            t_ready = True
        fused = None
        if kw.get("int8"):  # every projection whose input _forward_input quantizes has an int8 slot
            if ab is not None and self._lora_in_gemm(d_out):  # s t B^T written in the GEMM's epilogue
                half = self._t16_copy([(layer, target)])
                if not t_ready:
                    lora_project(self.dev, x, ab[0], t, self.rows, d_in, r, half=half)
                if self.mirrors is not None:  # t16 written with t (here, by the shared product, or the forward's)
                    fused = LoraTerm(self._t16(layer, target)[1], self.mirrors.b16((layer, target)), r, "rows")
                else:
                    fused = lora_term(self.dev, t, ab[1], self.rows, d_out, r, self.scale, "rows", *self.lora16)
            gemm_i8(self.dev, a, self._int8_weight(layer, target), y, lora=fused, residual=residual)
        else:
            self._linear(self.dev, a, self.w.proj[(layer, target)], y, self.rows, **kw)
        bias = self.w.biases.get((layer, target))
        if bias is not None:
            add_bias(self.dev, y, bias, self.rows, d_out)
        if ab is None or fused is not None:
            return
        if t_ready:  # t = x A^T is there (from the shared product, or the forward's: same x, same kernels)
            lora_expand(self.dev, t, ab[1], y, self.rows, d_out, r, self.scale)
        else:
            lora_forward(self.dev, x, *ab, t, y, self.rows, d_in, d_out, r, self.scale)

    def _lora_t(self, layer: int, target: str) -> Any:
        """Where the LoRA of (layer, target) keeps t = x A^T [rows, r]: its own slot when saves_lora_t, else
        the target's buffer shared by all blocks."""
        if not self.saves_lora_t:
            return self.t_lora[target]
        return self._view(self.t_saved, self._t_index[(layer, target)] * self._t_slot, self.rows * self.layout.r)

    # ---- attention over the batch, one sequence at a time ----------------------------------------------
    def _sequences_aligned(self) -> bool:
        """Whether every sequence's rows of a packed [rows, width] attention tensor start at a binding-aligned
        byte offset (T * width * 4 a multiple of the alignment, as at T = 1024), so attention binds views."""
        widths = (self.cfg.q_dim, self.cfg.kv_dim)
        return self.batch == 1 or all(4 * self.seq_len * w % self.dev.offset_alignment == 0 for w in widths)

    def _slot_dims(self, slot: str) -> tuple[int, int]:
        """(row width, padded floats per sequence) of an attention slot's tensor."""
        return (self.cfg.q_dim, self.seq_q) if _SLOT_KIND[slot] == "q" else (self.cfg.kv_dim, self.seq_kv)

    def _heads(self) -> tuple[int, int, int]:
        """(n_heads, n_kv_heads, head_dim): the attention ops' shape arguments after seq_len."""
        return self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim

    def _seq_view(self, packed: Any, slot: str, s: int) -> BufferView:
        """Sequence s's [T, width] rows of a packed attention tensor: a view into it, or into its padded slot."""
        width, per = self._slot_dims(slot)
        if self.direct_attention:
            return self._view(packed, s * self.seq_len * width, self.seq_len * width)
        return self._view(self.a[slot], s * per, self.seq_len * width)

    def _scatter(self, pairs: Iterable[tuple[Any, str]], to_slots: bool) -> None:
        """Copy (packed buffer, slot) rows between the packed layout and the padded slots (none when direct)."""
        if self.direct_attention:
            return
        for src, slot in pairs:
            width, per = self._slot_dims(slot)
            n = 4 * self.seq_len * width
            for s in range(self.batch):
                packed, at = 4 * s * self.seq_len * width, 4 * s * per
                if to_slots:
                    self.dev.copy(src, self.a[slot], n, packed, at)
                else:
                    self.dev.copy(self.a[slot], src, n, at, packed)

    def _rope_in_pack(self, layer: int) -> bool:
        """Whether block `layer`'s RoPE is applied as the tensor-core attention packs q and k (no f32 copy of the
        RoPE'd q and k): batched tensor-core attention, and not a kept block (whose backward packs them again)."""
        return self.rope_in_pack and self.batched_attention and layer not in self._kept

    def _rope_table(self, layer: int) -> RopeTable:
        """Block `layer`'s RoPE table: the sliding-window blocks' own (gemma3) or the model's."""
        return self._local_rope if self._local_rope is not None and self.cfg.window(layer) else self.rope

    def _attention(self, q: Any, k: Any, v: Any, out: Any, layer: int, rope: RopeAt | None = None) -> None:
        """out = attention of block `layer` over q, k, v (rope: q and k before RoPE, applied as the tensor-core
        kernels pack them; only where _rope_in_pack says so)."""
        cfg, seq_len = self.cfg, self.seq_len
        if self.batched_attention:
            self._attention_fwd(
                self.dev,
                q,
                k,
                v,
                out,
                self.a["lse"],
                seq_len,
                *self._heads(),
                n_seqs=self.batch,
                lse_stride=self.seq_lse,
                rope=rope,
            )
            return
        ins = ((q, "aq"), (k, "ak"), (v, "av"))
        self._scatter(ins, to_slots=True)
        for s in range(self.batch):
            self._attention_fwd(
                self.dev,
                *(self._seq_view(buf, slot, s) for buf, slot in ins),
                self._seq_view(out, "ao", s),
                self._view(self.a["lse"], s * self.seq_lse, cfg.n_heads * seq_len),
                seq_len,
                *self._heads(),
                **attention_settings(cfg, layer),
            )
        self._scatter(((out, "ao"),), to_slots=False)

    # ---- one block -------------------------------------------------------------------------------------
    def _block_forward(self, layer: int, for_backward: bool = False) -> None:
        """x_{l+1} = block(x_l), keeping this block's intermediates in the scratch buffers. for_backward: a
        backward's recompute, which stops at the down projection's input s when the model has no post-norms (its
        backward reads s, never the down projection's output or x_{l+1}: 28 % of a Llama block's GEMM work)."""
        self._use_block(layer)
        cfg, a, dev, rows = self.cfg, self.a, self.dev, self.rows
        f = cfg.ffn
        x, x_next = self._x(layer), self._x(layer + 1)
        pos = self._b.bufs["positions"]
        n1 = self._normed(
            x, f"blk.{layer}.attn_norm.weight", a["n1"], codes=self._input_codes(layer, "n1"),
            store_y=self._input_f32_needed(layer, "n1"),
        )  # fmt: skip
        ready = self._lora_t_shared(a["n1"], layer, ("q", "k", "v"), n1)
        self._proj(a["n1"], layer, "q", a["q"], n1, t_ready=ready)
        self._proj(a["n1"], layer, "k", a["k"], n1, t_ready=ready)
        self._proj(a["n1"], layer, "v", a["v"], n1, t_ready=ready)
        q, k = a["q"], a["k"]
        if cfg.qk_norm:  # per-head RMSNorm: rows of head_dim
            norm = self.w.norms
            rmsnorm_forward(
                dev, q, norm[f"blk.{layer}.attn_q_norm.weight"], a["qn"], rows * cfg.n_heads, cfg.head_dim, cfg.eps
            )
            rmsnorm_forward(
                dev, k, norm[f"blk.{layer}.attn_k_norm.weight"], a["kn"], rows * cfg.n_kv_heads, cfg.head_dim, cfg.eps
            )
            q, k = a["qn"], a["kn"]
        rope = self._rope_table(layer)
        if self._rope_in_pack(layer):
            self._attention(q, k, a["v"], a["att"], layer, rope=RopeAt(rope, pos))
        else:
            rope_forward(dev, rope, q, a["qr"], rows, cfg.n_heads, positions=pos)
            rope_forward(dev, rope, k, a["kr"], rows, cfg.n_kv_heads, positions=pos)
            self._attention(a["qr"], a["kr"], a["v"], a["att"], layer)
        att_codes = self._input_codes(layer, "att")
        o_input = None if att_codes is None else self._forward_input(a["att"], cfg.q_dim, att_codes)
        self._post_normed(layer, "o", "post_attention_norm", x, a["hres"], o_input)
        n2 = self._normed(
            a["hres"], f"blk.{layer}.ffn_norm.weight", a["n2"], codes=self._input_codes(layer, "n2"),
            store_y=self._input_f32_needed(layer, "n2"),
        )  # fmt: skip
        ready = self._lora_t_shared(a["n2"], layer, ("gate", "up"), n2)
        self._proj(a["n2"], layer, "gate", a["g"], n2, t_ready=ready)
        self._proj(a["n2"], layer, "up", a["u"], n2, t_ready=ready)
        stop = for_backward and not cfg.post_norms
        s_input = None  # the down projection's A operand, when given here
        fits = self._rotation(f) == 0 or f <= 64 * row_workgroup(f)  # glu_i8 holds a rotated row in registers
        s_codes = self._input_codes(layer, "s")  # kept: the recompute writes them too, for down's dA
        if "down" in self._w8_slots and self.fused_codes_i8 and (not stop or s_codes is not None) and fits:
            s_input = Int8Matrix(*(s_codes or self.a8), rows, f, f, "gemm input"), {"int8": True}
            glu_i8(dev, "geglu" if cfg.activation == "gelu_tanh" else "swiglu", a["g"], a["u"], a["s"], s_input[0],
                   self._rotation(f), store_y=self._input_f32_needed(layer, "s"))  # fmt: skip
        else:
            s16 = None if self._w8_slots or stop else self._half_copy(rows * f)
            self._gate_forward(dev, a["g"], a["u"], a["s"], rows * f, y16=s16)
            s_input = None if self._w8_slots else self._operand(a["s"], s16)
            if s_codes is not None:
                s_input = self._forward_input(a["s"], f, s_codes)
        if stop:
            return
        self._post_normed(layer, "down", "post_ffw_norm", a["hres"], x_next, s_input)

    def _use_block(self, layer: int) -> None:
        """Point self.a at block `layer`'s buffers: its kept set (the shared scratch with its own buffers in place
        of those it keeps) or the shared scratch."""
        self.a = self._kept.get(layer, self._scratch)

    def _post_normed(
        self, layer: int, target: str, norm: str, residual: Any, out: Any, gemm_input: tuple[Any, dict] | None = None
    ) -> None:
        """out = residual + the o / down projection's output (its input: att / s), through blk.N.<norm> when the
        model has post-norms (gemma3; the output before the norm stays in a[target] for the backward); the add in
        the integer GEMM's epilogue with residual_in_gemm_i8, else a pass of its own over a["tmp"]."""
        a, cfg = self.a, self.cfg
        x = a["att"] if target == "o" else a["s"]
        width = cfg.q_dim if target == "o" else cfg.ffn
        if not cfg.post_norms and self.residual_in_gemm_i8 and self._forward_int8(width):
            self._proj(x, layer, target, out, gemm_input, residual=residual)
            return
        if cfg.post_norms:  # the output before the norm stays in a[target]
            self._proj(x, layer, target, a[target], gemm_input)
            weight = self.w.norms[f"blk.{layer}.{norm}.weight"]
            rmsnorm_forward(self.dev, a[target], weight, a["tmp"], self.rows, cfg.hidden, cfg.eps)
        else:
            self._proj(x, layer, target, a["tmp"], gemm_input)
        add(self.dev, residual, a["tmp"], out, self.rows * cfg.hidden)

    # ---- whole model -----------------------------------------------------------------------------------
    def write_prefix(self, x: np.ndarray) -> None:
        """The residual stream entering block start_layer, [batch, seq_len, hidden] (the frozen-prefix cache)."""
        want = (self.batch, self.seq_len, self.cfg.hidden)
        x = np.asarray(x, np.float32)
        if x.shape != want:
            raise ValueError(f"prefix activations of shape {x.shape}, the model takes {want}")
        self.dev.write(self.xs, x.reshape(-1), offset=4 * self._x_offset(self.start_layer))

    def residual_stream(self, ids: np.ndarray, layer: int) -> np.ndarray:
        """The input of block `layer` for ids [batch, seq_len]: the embedding and blocks 0..layer-1 with this
        model's LoRA (none for a prefix cache), float32 [batch, seq_len, hidden]."""
        cfg, rows = self.cfg, self.rows
        ids = np.asarray(ids).reshape(self.batch, self.seq_len)
        if np.any(ids < 0) or np.any(ids >= cfg.vocab):
            raise ValueError(f"token ids outside the model's vocabulary [0, {cfg.vocab})")
        bufs = self._b.bufs
        self.dev.write(bufs["ids"], ids.astype(np.uint32).reshape(-1))
        self.dev.write(bufs["positions"], np.tile(np.arange(self.seq_len, dtype=np.uint32), self.batch))
        with self.dev.step():
            self._refresh_mirrors()
            self._embed(bufs["ids"])
            for block in range(layer):
                self._block_forward(block)
        out = self.dev.read(self.xs, np.float32, (rows * cfg.hidden,), offset=4 * self._x_offset(layer))
        return out.reshape(self.batch, self.seq_len, cfg.hidden)

    def _refresh_mirrors(self) -> None:
        """The LoRA parameters' f16 mirrors from the current parameters (at each forward: an optimizer step or
        set_adapter may have changed them since)."""
        if self.mirrors is not None:
            self.mirrors.refresh(self.dev, self.params)
        if self.lora_codes is not None:
            self.lora_codes.refresh(self.dev, self.params)
        if self.grad_codes is not None:
            self.grad_codes.refresh(self.dev, self.params)

    def _embed(self, ids: Any) -> None:
        """Block 0's input: the embedding rows of ids, times the model's embedding scale (gemma3: sqrt(hidden))."""
        x0, n = self._x(0), self.rows * self.cfg.hidden
        embedding_forward(self.dev, self.w.embed, ids, x0, self.rows)
        if self.cfg.embedding_scale != 1.0:
            scale_inplace(self.dev, x0, float(np.float32(self.cfg.embedding_scale)), n)

    def _forward_to_head(self, checkpoint: bool = False) -> Any:
        """The blocks and the final norm into a["nf"]; returns its f16 copy for tensor-core LM-head logits
        (gpu/ops/head.py; written by the norm itself, valid until the next f16 operand), else None. checkpoint:
        keep the block inputs a backward needs (bf16 checkpoints; f32 ones stay in xs anyway)."""
        cfg = self.cfg
        self._refresh_mirrors()
        if self.start_layer == 0:
            self._embed(self._b.bufs["ids"])
        for layer in range(self.start_layer, cfg.n_layers):
            if checkpoint:
                self._checkpoint(layer)
            self._block_forward(layer)
        nf, kw = self._normed(self._x(cfg.n_layers), "output_norm.weight", self.a["nf"], head=True)
        return nf if kw else None
