"""The student on the GPU: frozen weights kept in their GGML types, LoRA on the 7 projections, one training
step (forward, KD loss, complete backward, AdamW) recorded into one command encoder.

Memory: only each block's input is kept ([L+1, rows, H]); the backward recomputes one block at a time from
its input (layer-input checkpointing) and then runs the block backward, mirroring model/reference.py's
block_forward / block_backward. Rows are `batch * seq_len` tokens; only attention works per sequence.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from gpu.device import BufferView, Device, DeviceError
from gpu.ops.adamw import AdamW, AdamWConfig, StepStats
from gpu.ops.add import add, scale_inplace
from gpu.ops.attention import attention_backward, attention_forward
from gpu.ops.embedding import embedding_forward
from gpu.ops.kd import KdScratch, kd_head_forward_backward
from gpu.ops.lora import lora_backward, lora_forward
from gpu.ops.matmul import linear, linear_input_grad
from gpu.ops.matmul_tc import has_tensor_cores, linear_input_grad_tc, linear_tc, tensor_core_problem
from gpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gpu.ops.rope import RopeTable, rope_backward, rope_forward
from gpu.ops.swiglu import swiglu_backward, swiglu_forward
from gpu.ops.topk import TopKState, hidden_topk
from gpu.weights import QuantTensor, upload_quant
from model.config import LORA_TARGETS, ModelConfig
from model.kd import LossConfig
from model.reference import LoraPair

FLOATS_PER_SLOT_ALIGN = 64  # 256-byte storage offset alignment, in f32 elements
PREFETCH = 2  # tensors read ahead of the upload


def _pad(n: int, align: int = FLOATS_PER_SLOT_ALIGN) -> int:
    return -(-n // align) * align


# ---- LoRA parameters: one flat f32 buffer (AdamW runs over it), each tensor at an aligned offset ----------
@dataclass(frozen=True)
class LoraSlot:
    layer: int
    target: str
    d_in: int
    d_out: int
    a_off: int  # element offset of A [r, d_in]
    b_off: int  # element offset of B [d_out, r]


@dataclass(frozen=True)
class LoraLayout:
    """Where each (layer, target) A and B live in the flat parameter / gradient buffers."""

    r: int
    slots: dict[tuple[int, str], LoraSlot]
    n_params: int  # including alignment padding (padding stays zero: zero grads, zero updates)

    @classmethod
    def build(cls, cfg: ModelConfig, targets: Iterable[str], r: int, layers: Iterable[int] | None = None) -> LoraLayout:
        targets = [t for t in LORA_TARGETS if t in set(targets)]
        layers = sorted(set(range(cfg.n_layers) if layers is None else layers))
        if layers and not 0 <= layers[0] <= layers[-1] < cfg.n_layers:
            raise ValueError(f"lora layers {layers} outside the model's blocks 0..{cfg.n_layers - 1}")
        slots, off = {}, 0
        for layer in layers:
            for t in targets:
                d_out, d_in = cfg.target_shape(t)
                a_off, off = off, off + _pad(r * d_in)
                b_off, off = off, off + _pad(d_out * r)
                slots[(layer, t)] = LoraSlot(layer, t, d_in, d_out, a_off, b_off)
        return cls(r, slots, off)

    @property
    def lowest_layer(self) -> int:
        """The lowest adapted block: the backward stops there."""
        return min((layer for layer, _ in self.slots), default=0)

    def pack(self, adapter: Mapping[tuple[int, str], LoraPair]) -> np.ndarray:
        flat = np.zeros(self.n_params, np.float32)
        for key, s in self.slots.items():
            pair = adapter[key]
            flat[s.a_off : s.a_off + self.r * s.d_in] = np.asarray(pair.A, np.float32).reshape(-1)
            flat[s.b_off : s.b_off + s.d_out * self.r] = np.asarray(pair.B, np.float32).reshape(-1)
        return flat

    def unpack(self, flat: np.ndarray) -> dict[tuple[int, str], LoraPair]:
        r = self.r
        return {
            key: LoraPair(
                flat[s.a_off : s.a_off + r * s.d_in].reshape(r, s.d_in).copy(),
                flat[s.b_off : s.b_off + s.d_out * r].reshape(s.d_out, r).copy(),
            )
            for key, s in self.slots.items()
        }


# ---- frozen weights --------------------------------------------------------------------------------------
@dataclass
class StudentWeights:
    """The frozen student on the GPU: 2-D projections in their GGML types, norms and lm_head in f32."""

    cfg: ModelConfig
    embed: QuantTensor
    lm_head: QuantTensor  # [V, H]; the tied token_embd when there is no output.weight
    norms: dict[str, Any]
    proj: dict[tuple[int, str], QuantTensor]
    nbytes: int = 0

    @classmethod
    def upload(
        cls, dev: Device, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray, int, tuple[int, ...]]]
    ) -> StudentWeights:
        """Upload (name, raw GGML bytes or f32 array, ggml type, numpy shape) one tensor at a time."""
        from model.quant import dequantize

        stem_to_target = {v: k for k, v in LORA_TARGETS.items()}
        norms: dict[str, Any] = {}
        proj: dict[tuple[int, str], QuantTensor] = {}
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
            elif parts[0] == "blk" and parts[2] in stem_to_target:
                t = upload_quant(dev, data, qtype, shape, name)
                proj[(int(parts[1]), stem_to_target[parts[2]])] = t
                total += t.nbytes
        missing = [
            f"blk.{i}.{LORA_TARGETS[t]}.weight" for i in range(cfg.n_layers) for t in LORA_TARGETS if (i, t) not in proj
        ]
        missing += [n for n, v in (("token_embd.weight", embed), ("lm_head", lm_head)) if v is None]
        if missing:
            raise DeviceError(f"student weights incomplete: missing {', '.join(missing[:5])}")
        return cls(cfg, embed, lm_head, norms, proj, total)

    @classmethod
    def from_arrays(cls, dev: Device, cfg: ModelConfig, weights: Mapping[str, np.ndarray], qtype: int = Q.F32):
        """Upload float weights (GGUF names), quantizing 2-D projections to `qtype` (tests, random models)."""
        from model.quant import quantize

        def items() -> Iterator[tuple[str, np.ndarray, int, tuple[int, ...]]]:
            for name, w in weights.items():
                w = np.asarray(w, np.float32)
                is_proj = w.ndim == 2 and name.startswith("blk.")
                t = qtype if is_proj else Q.F32
                yield name, quantize(w, t) if t != Q.F32 else w, t, w.shape

        return cls.upload(dev, cfg, items())

    @classmethod
    def from_gguf(cls, dev: Device, path: Any, progress: Callable[[Any], None] | None = None) -> StudentWeights:
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
    k: int
    bufs: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.batch * self.seq_len

    def get(self, name: str, n_elems: int) -> Any:
        if name not in self.bufs:
            self.bufs[name] = self.dev.buffer(4 * max(n_elems, 1), label=f"student {name}")
        return self.bufs[name]


def _resolve_precision(dev: Device, precision: str) -> str:
    """f32 (portable, strict parity), tensorcore (f16 operands, f32 accumulation), or auto (tensorcore when the
    device has subgroup matrices)."""
    if precision == "auto":
        return "tensorcore" if has_tensor_cores(dev) else "f32"
    if precision == "tensorcore" and not has_tensor_cores(dev):
        raise DeviceError(f"precision 'tensorcore' needs Dawn subgroup matrices: {tensor_core_problem(dev)}")
    if precision not in ("f32", "tensorcore"):
        raise ValueError(f"precision {precision!r}: expected f32, tensorcore or auto")
    return precision


class GPUModel:
    """Forward of the frozen model (optionally with LoRA) over `batch` sequences of `seq_len` tokens."""

    def __init__(
        self,
        dev: Device,
        weights: StudentWeights,
        *,
        batch: int,
        seq_len: int,
        targets: Iterable[str] = (),
        r: int = 1,
        alpha: float = 1.0,
        layers: Iterable[int] | None = None,
        precision: str = "f32",
    ) -> None:
        self.dev, self.w, self.cfg = dev, weights, weights.cfg
        cfg = self.cfg
        self.precision = _resolve_precision(dev, precision)
        self._linear, self._linear_grad = (
            (linear_tc, linear_input_grad_tc) if self.precision == "tensorcore" else (linear, linear_input_grad)
        )
        if seq_len > cfg.context_length:
            raise ValueError(f"seq_len={seq_len} exceeds the model's context length {cfg.context_length}")
        self.layout = LoraLayout.build(cfg, targets, r, layers)
        self.scale = alpha / r
        self.batch, self.seq_len = batch, seq_len
        self.rows = batch * seq_len
        self.params = dev.buffer(4 * max(self.layout.n_params, 1), label="lora params")
        self.rope = RopeTable.build(dev, cfg.head_dim, cfg.rope_base, seq_len)
        self._b = _Buffers(dev, cfg, batch, seq_len, r, 0)
        self._alloc()

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
        cfg, rows, k = self.cfg, self.rows, max(getattr(self, "k", 0), 1)
        h, f, qd, kvd = cfg.hidden, cfg.ffn, cfg.q_dim, cfg.kv_dim
        self.slot = _pad(rows * h)
        b = self._b.get
        self.xs = b("layer inputs", (cfg.n_layers + 1) * self.slot)
        for name, n in (
            ("ids", rows),
            ("positions", rows),
            ("targets", rows),
            ("mask", rows),
            ("teacher_ids", rows * k),
            ("teacher_logprobs", rows * k),
            ("teacher_tail", rows),
            ("loss", 4),
        ):
            b(name, n)
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
            "dx": h,
            "dh": h,
            "ds": f,
            "dg": f,
            "du": f,
            "dn": h,
            "datt": qd,
            "dqr": qd,
            "dq": qd,
            "dkr": kvd,
            "dk": kvd,
            "dv": kvd,
        }
        self.a = {name: b(name, rows * n) for name, n in sizes.items()}
        self.seq_q = _pad(self.seq_len * qd)
        self.seq_kv = _pad(self.seq_len * kvd)
        self.seq_lse = _pad(cfg.n_heads * self.seq_len)
        # per-sequence attention tensors live in padded slots so each sequence's view is offset-aligned
        for name, per in (
            ("aq", self.seq_q),
            ("ak", self.seq_kv),
            ("av", self.seq_kv),
            ("ao", self.seq_q),
            ("adq", self.seq_q),
            ("adk", self.seq_kv),
            ("adv", self.seq_kv),
            ("ado", self.seq_q),
        ):
            self.a[name] = b(name, self.batch * per)
        self.lse = b("lse", self.batch * self.seq_lse)
        self.delta = b("attention delta", cfg.n_heads * self.seq_len)
        r = self.layout.r
        self.t_lora = {t: b(f"lora t {t}", rows * r) for t in LORA_TARGETS}
        self.dt = b("lora dt", rows * r)

    def _x(self, layer: int) -> BufferView:
        return self._view(self.xs, layer * self.slot, self.rows * self.cfg.hidden)

    # ---- one projection (frozen W + LoRA) ---------------------------------------------------------------
    def _proj(self, x: Any, layer: int, target: str, y: Any) -> None:
        d_out, d_in = self.cfg.target_shape(target)
        self._linear(self.dev, x, self.w.proj[(layer, target)], y, self.rows)
        ab = self._lora(layer, target, self.params)
        if ab is not None:
            lora_forward(self.dev, x, *ab, self.t_lora[target], y, self.rows, d_in, d_out, self.layout.r, self.scale)

    # ---- attention over the batch, one sequence at a time ----------------------------------------------
    def _scatter(self, src: Any, dst: str, width: int, per: int, to_slots: bool) -> None:
        """Copy rows between the packed [rows, width] layout and the per-sequence padded slots."""
        n = 4 * self.seq_len * width
        for s in range(self.batch):
            packed, slot = 4 * s * self.seq_len * width, 4 * s * per
            if to_slots:
                self.dev.copy(src, self.a[dst], n, packed, slot)
            else:
                self.dev.copy(self.a[dst], src, n, slot, packed)

    def _attention(self, q: Any, k: Any, v: Any, out: Any) -> None:
        cfg, t = self.cfg, self.seq_len
        qd, kvd = cfg.q_dim, cfg.kv_dim
        if self.batch == 1:
            attention_forward(self.dev, q, k, v, out, self.lse, t, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            return
        self._scatter(q, "aq", qd, self.seq_q, True)
        self._scatter(k, "ak", kvd, self.seq_kv, True)
        self._scatter(v, "av", kvd, self.seq_kv, True)
        for s in range(self.batch):
            attention_forward(
                self.dev,
                self._view(self.a["aq"], s * self.seq_q, t * qd),
                self._view(self.a["ak"], s * self.seq_kv, t * kvd),
                self._view(self.a["av"], s * self.seq_kv, t * kvd),
                self._view(self.a["ao"], s * self.seq_q, t * qd),
                self._view(self.lse, s * self.seq_lse, cfg.n_heads * t),
                t,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
            )
        self._scatter(out, "ao", qd, self.seq_q, False)

    # ---- one block -------------------------------------------------------------------------------------
    def _block_forward(self, layer: int) -> None:
        """x_{l+1} = block(x_l), keeping this block's intermediates in the scratch buffers."""
        cfg, a, dev, rows = self.cfg, self.a, self.dev, self.rows
        h, f = cfg.hidden, cfg.ffn
        x, x_next = self._x(layer), self._x(layer + 1)
        pos = self._b.bufs["positions"]
        rmsnorm_forward(dev, x, self.w.norms[f"blk.{layer}.attn_norm.weight"], a["n1"], rows, h, cfg.eps)
        self._proj(a["n1"], layer, "q", a["q"])
        self._proj(a["n1"], layer, "k", a["k"])
        self._proj(a["n1"], layer, "v", a["v"])
        rope_forward(dev, self.rope, a["q"], a["qr"], rows, cfg.n_heads, positions=pos)
        rope_forward(dev, self.rope, a["k"], a["kr"], rows, cfg.n_kv_heads, positions=pos)
        self._attention(a["qr"], a["kr"], a["v"], a["att"])
        self._proj(a["att"], layer, "o", a["tmp"])
        add(dev, x, a["tmp"], a["hres"], rows * h)
        rmsnorm_forward(dev, a["hres"], self.w.norms[f"blk.{layer}.ffn_norm.weight"], a["n2"], rows, h, cfg.eps)
        self._proj(a["n2"], layer, "gate", a["g"])
        self._proj(a["n2"], layer, "up", a["u"])
        swiglu_forward(dev, a["g"], a["u"], a["s"], rows * f)
        self._proj(a["s"], layer, "down", a["tmp"])
        add(dev, a["hres"], a["tmp"], x_next, rows * h)

    # ---- whole model -----------------------------------------------------------------------------------
    def _forward_to_head(self) -> None:
        cfg, dev = self.cfg, self.dev
        embedding_forward(dev, self.w.embed, self._b.bufs["ids"], self._x(0), self.rows)
        for layer in range(cfg.n_layers):
            self._block_forward(layer)
        rmsnorm_forward(
            dev, self._x(cfg.n_layers), self.w.norms["output_norm.weight"], self.a["nf"], self.rows, cfg.hidden, cfg.eps
        )


class GPUStudent(GPUModel):
    """Training and evaluation of LoRA on a frozen quantized student, one step = one command encoder."""

    def __init__(
        self,
        dev: Device,
        weights: StudentWeights,
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
    ) -> None:
        self.k, self.loss_cfg = top_k, loss
        super().__init__(
            dev,
            weights,
            batch=batch,
            seq_len=seq_len,
            targets=targets,
            r=r,
            alpha=alpha,
            layers=layers,
            precision=precision,
        )
        self.grad_accum = grad_accum
        self.losses = dev.buffer(4 * grad_accum, label="micro-batch losses")
        if self.layout.n_params == 0:
            raise ValueError("GPUStudent needs at least one LoRA target")
        self.grads = dev.buffer(4 * self.layout.n_params, label="lora grads")
        self.optim = AdamW(dev, self.layout.n_params, optim or AdamWConfig())
        self.kd = KdScratch.build(dev, self.rows, top_k, min(vocab_chunk, self.cfg.vocab))
        self.top1 = TopKState.build(dev, self.rows, 1)
        self.top1_lp = dev.buffer(4 * self.rows, label="student top-1 logprob")
        self.top1_tail = dev.buffer(4 * self.rows, label="student top-1 tail")
        self.applied_steps = 0
        self.skipped_steps = 0
        self._acc_grads = False
        self._has_tail = False

    def get_grads(self) -> dict[tuple[int, str], LoraPair]:
        """The last step's gradients (dA, dB) per (layer, target), as LoraPair(A=dA, B=dB)."""
        return self.layout.unpack(self.dev.read(self.grads, np.float32, (self.layout.n_params,)))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        n = self.layout.n_params
        return {"m": self.dev.read(self.optim.m, np.float32, (n,)), "v": self.dev.read(self.optim.v, np.float32, (n,))}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray], applied_steps: int) -> None:
        self.dev.write(self.optim.m, np.asarray(state["m"], np.float32))
        self.dev.write(self.optim.v, np.asarray(state["v"], np.float32))
        self.applied_steps = applied_steps

    # ---- backward -------------------------------------------------------------------------------------
    def _proj_back(self, dy: Any, x: Any, layer: int, target: str, dx: Any, accumulate: bool) -> None:
        d_out, d_in = self.cfg.target_shape(target)
        self._linear_grad(self.dev, dy, self.w.proj[(layer, target)], dx, self.rows, accumulate=accumulate)
        ab = self._lora(layer, target, self.params)
        if ab is not None:
            da, db = self._lora(layer, target, self.grads)
            lora_backward(
                self.dev,
                dy,
                x,
                *ab,
                self.t_lora[target],
                da,
                db,
                dx,
                self.dt,
                self.rows,
                d_in,
                d_out,
                self.layout.r,
                self.scale,
                accumulate_grads=self._acc_grads,
            )

    def _attention_back(self, dout: Any, q: Any, k: Any, v: Any, out: Any, dq: Any, dk: Any, dv: Any) -> None:
        cfg, t = self.cfg, self.seq_len
        qd, kvd = cfg.q_dim, cfg.kv_dim
        if self.batch == 1:
            attention_backward(
                self.dev,
                dout,
                q,
                k,
                v,
                out,
                self.lse,
                dq,
                dk,
                dv,
                t,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                delta=self.delta,
            )
            return
        # q, k, v, out are already in their slots from the recomputed forward
        self._scatter(dout, "ado", qd, self.seq_q, True)
        for s in range(self.batch):
            attention_backward(
                self.dev,
                self._view(self.a["ado"], s * self.seq_q, t * qd),
                self._view(self.a["aq"], s * self.seq_q, t * qd),
                self._view(self.a["ak"], s * self.seq_kv, t * kvd),
                self._view(self.a["av"], s * self.seq_kv, t * kvd),
                self._view(self.a["ao"], s * self.seq_q, t * qd),
                self._view(self.lse, s * self.seq_lse, cfg.n_heads * t),
                self._view(self.a["adq"], s * self.seq_q, t * qd),
                self._view(self.a["adk"], s * self.seq_kv, t * kvd),
                self._view(self.a["adv"], s * self.seq_kv, t * kvd),
                t,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                delta=self.delta,
            )
        self._scatter(dq, "adq", qd, self.seq_q, False)
        self._scatter(dk, "adk", kvd, self.seq_kv, False)
        self._scatter(dv, "adv", kvd, self.seq_kv, False)

    def _block_backward(self, layer: int) -> None:
        """Given dx = dL/dx_{l+1} in a["dx"] and the recomputed intermediates, leave dL/dx_l in a["dx"]."""
        cfg, a, dev, rows = self.cfg, self.a, self.dev, self.rows
        h, f = cfg.hidden, cfg.ffn
        x = self._x(layer)
        pos = self._b.bufs["positions"]
        # out = hres + down(swiglu(gate(n2), up(n2)))
        self._proj_back(a["dx"], a["s"], layer, "down", a["ds"], False)
        swiglu_backward(dev, a["ds"], a["g"], a["u"], a["dg"], a["du"], rows * f)
        self._proj_back(a["dg"], a["n2"], layer, "gate", a["dn"], False)
        self._proj_back(a["du"], a["n2"], layer, "up", a["dn"], True)
        dev.copy(a["dx"], a["dh"], 4 * rows * h)
        rmsnorm_backward(
            dev,
            a["dn"],
            a["hres"],
            self.w.norms[f"blk.{layer}.ffn_norm.weight"],
            a["dh"],
            rows,
            h,
            cfg.eps,
            accumulate=True,
        )
        # hres = x + o(attn(rope(q(n1)), rope(k(n1)), v(n1)))
        self._proj_back(a["dh"], a["att"], layer, "o", a["datt"], False)
        self._attention_back(a["datt"], a["qr"], a["kr"], a["v"], a["att"], a["dqr"], a["dkr"], a["dv"])
        rope_backward(dev, self.rope, a["dqr"], a["dq"], rows, cfg.n_heads, positions=pos)
        rope_backward(dev, self.rope, a["dkr"], a["dk"], rows, cfg.n_kv_heads, positions=pos)
        self._proj_back(a["dq"], a["n1"], layer, "q", a["dn"], False)
        self._proj_back(a["dk"], a["n1"], layer, "k", a["dn"], True)
        self._proj_back(a["dv"], a["n1"], layer, "v", a["dn"], True)
        dev.copy(a["dh"], a["dx"], 4 * rows * h)
        rmsnorm_backward(
            dev, a["dn"], x, self.w.norms[f"blk.{layer}.attn_norm.weight"], a["dx"], rows, h, cfg.eps, accumulate=True
        )

    # ---- inputs ----------------------------------------------------------------------------------------
    def write_batch(
        self,
        ids: np.ndarray,
        targets: np.ndarray,
        mask: np.ndarray,
        teacher_ids: np.ndarray,
        teacher_logprobs: np.ndarray,
        teacher_tail: np.ndarray | None,
    ) -> None:
        """Upload one batch: ids/targets/mask [B, T], teacher top-k ids/logprobs [B, T, k], tail [B, T]."""
        bt = (self.batch, self.seq_len)
        ids = np.asarray(ids).reshape(bt)
        if np.any(ids < 0) or np.any(ids >= self.cfg.vocab):
            raise ValueError(f"token ids outside the student's vocabulary [0, {self.cfg.vocab})")
        w = self.dev.write
        bufs = self._b.bufs
        w(bufs["ids"], ids.astype(np.uint32).reshape(-1))
        w(bufs["positions"], np.tile(np.arange(self.seq_len, dtype=np.uint32), self.batch))
        w(bufs["targets"], np.asarray(targets).reshape(bt).astype(np.uint32).reshape(-1))
        w(bufs["mask"], (np.asarray(mask).reshape(bt) != 0).astype(np.uint32).reshape(-1))
        w(bufs["teacher_ids"], np.asarray(teacher_ids).reshape(*bt, self.k).astype(np.uint32).reshape(-1))
        w(bufs["teacher_logprobs"], np.asarray(teacher_logprobs, np.float32).reshape(-1))
        tail = np.zeros(bt, np.float32) if teacher_tail is None else np.asarray(teacher_tail, np.float32)
        w(bufs["teacher_tail"], tail.reshape(-1))
        self._has_tail = teacher_tail is not None

    def _kd_head(self, loss_index: int, backward: bool) -> None:
        """lm_head + KD loss of the uploaded batch into losses[loss_index]; with backward, dL/dh into a["tmp"]."""
        cfg, bufs = self.cfg, self._b.bufs
        tail = bufs["teacher_tail"] if self._has_tail else None
        kd_head_forward_backward(
            self.dev, self.a["nf"], self.w.lm_head, bufs["teacher_ids"], bufs["teacher_logprobs"], tail,
            bufs["targets"], bufs["mask"], self.loss_cfg, self.a["tmp"], self.losses, self.rows, cfg.hidden,
            cfg.vocab, self.k, scratch=self.kd, loss_index=loss_index, backward=backward,
        )  # fmt: skip

    def _record_loss_and_grads(self, micro: int) -> None:
        cfg, dev = self.cfg, self.dev
        self._acc_grads = micro > 0
        self._forward_to_head()
        self._kd_head(micro, backward=True)
        rmsnorm_backward(
            dev,
            self.a["tmp"],
            self._x(cfg.n_layers),
            self.w.norms["output_norm.weight"],
            self.a["dx"],
            self.rows,
            cfg.hidden,
            cfg.eps,
        )
        for layer in reversed(range(self.layout.lowest_layer, cfg.n_layers)):
            self._block_forward(layer)  # recompute from the checkpointed block input
            self._block_backward(layer)

    def loss_and_grads(self) -> float:
        """Loss of the uploaded batch; gradients land in self.grads (read them with get_grads())."""
        with self.dev.step():
            self._record_loss_and_grads(0)
        return float(self.dev.read(self.losses, np.float32, (1,))[0])

    def accumulate(self, micro: int) -> None:
        """Record forward + backward of the uploaded micro-batch `micro` (0-based) into the gradients."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro-batch {micro} outside 0..{self.grad_accum - 1}")
        with self.dev.step():
            self._record_loss_and_grads(micro)

    def apply(self, lr: float) -> StepStats:
        """Average the accumulated gradients and take one AdamW step (skipped when the loss or grad norm is not
        finite); the returned loss is the mean over the micro-batches."""
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
        """Forward, backward and one AdamW update on the uploaded batch (grad_accum == 1), one encoder."""
        if self.grad_accum != 1:
            raise ValueError("train_step is for grad_accum=1: call accumulate() per micro-batch, then apply()")
        with self.dev.step():
            self._record_loss_and_grads(0)
            self.optim.step(self.params, self.grads, self.applied_steps + 1, lr=lr, loss=self.losses)
        return self._count(self.optim.read_stats())

    def _count(self, stats: StepStats) -> StepStats:
        if stats.skipped:
            self.skipped_steps += 1
        else:
            self.applied_steps += 1
        return stats

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """Forward only: per masked row the KD loss share, the CE on the target and the student's top-1 id.

        Returns kd_loss (the batch's masked-mean loss, [1]), ce [rows], top1 [rows] (u32); rows with mask 0 are
        included (callers select masked rows).
        """
        cfg, dev = self.cfg, self.dev
        with dev.step():
            self._forward_to_head()
            self._kd_head(0, backward=False)
            hidden_topk(
                dev,
                self.a["nf"],
                self.w.lm_head,
                self.top1,
                self.top1_lp,
                self.top1_tail,
                cfg.hidden,
                cfg.vocab,
                1.0,
                logits_scratch=self.kd.logits,
                chunk=self.kd.chunk,
            )
        lse = dev.read(self.kd.lse, np.float32, (self.rows, 4)).astype(np.float64)
        gathered = dev.read(self.kd.gathered, np.float32, (self.rows, self.k + 1)).astype(np.float64)
        ce = lse[:, 2] + np.log(lse[:, 3]) - gathered[:, self.k]
        return {
            "kd_loss": dev.read(self.losses, np.float32, (1,)),
            "ce": ce,
            "top1": dev.read(self.top1.ids, np.uint32, (self.rows,)),
        }
