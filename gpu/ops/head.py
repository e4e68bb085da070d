"""One vocab chunk of the LM head's logits, logits[:, :nv] = h . W[c0:c0+nv]^T (row stride ldc), shared by the
KD loss (gpu/ops/kd.py) and the top-k (gpu/ops/topk.py): a quantized lm_head through the fused-dequant GEMM
(on tensor cores when an f16 copy of h is given, on the integer GEMM when an Int8Head is), an f32 one through
strided_matmul."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gpu.codegen_i8 import MMA_K
from gpu.device import BufferView, Device
from gpu.ops.matmul import linear
from gpu.ops.matmul_i8 import Int8Matrix, gemm_i8, i8_buffers
from gpu.ops.matmul_tc import linear_tc
from gpu.ops.quantize_i8 import quantize_i8_gpu, rotated_back, transpose_i8, weight_to_i8
from gpu.ops.strided_matmul import row_major, strided_matmul, transposed
from gpu.weights import QuantTensor, row_slice

# precision int8: the teacher's logits on the integer GEMM too (off: the f16 tensor cores).
INT8_HEAD = True
# ... and the student's (logits and the KD backward's dlogits . W). Off: on the real SmolLM2 student (the demo,
# 2026-12-05, docs/benchmarks.md) training through it raised the held-out KL (0.262 -> 0.642 in 16 steps;
# 0.256 -> 0.155 with the head on f16): per-row 8-bit dlogits keep the few top entries and drop the rest of the
# softmax's mass (bench/train_step.py and bench/precision_quality.py --int8-head on|off).
INT8_STUDENT_HEAD = False
# ... or only the student's logits on the integer GEMM (the default), the one-pass backward's P_c . W on the f16
# tensor cores: +1.9 % on the Llama-3-8B step (H100 A/B, 2026-12-06, docs/benchmarks.md), the int8 gate +0.98 %
# against +0.30 % with f16 logits (within the 2 % bar); bench/train_step.py --int8-head off|logits|on.
INT8_STUDENT_LOGITS = True
# ... and with it the one-pass backward's P_c . W on the integer GEMM too (the default): P_c times W's row scales as
# int8 codes of their row's max, rounded stochastically (unbiased; gpu/kernels/kd_probs_i8.wgsl), instead of the f16
# tensor cores. +2.2 % on the Llama-3-8B step, +1.0 % on the real SmolLM2 (H100 A/Bs, 2026-12-07); the int8 gate on the
# same H100 +0.98 % over the f16 path (within the 2 % bar); numpy study: +0.6 / +0.8 % (seeds 0 / 1) over exact
# P_c . W, rounding to nearest +274 % (docs/benchmarks.md). bench/train_step.py --int8-head logits: the f16 product.
INT8_STUDENT_PROBS = True
# ... that product on the forward's ("nt") GEMM over the chunk's codes transposed (transpose_i8, 16 MB a chunk of
# 4,096 rows at hidden 4,096) instead of the "nn" GEMM reading W by columns: +0.4 % on the Llama-3-8B step (H100,
# 2026-12-07; bench/train_step.py --ab head-probs-nn for the "nn" GEMM).
PROBS_NT = True


@dataclass(frozen=True)
class Int8Head:
    """The LM head on the integer GEMM: h [T, hidden] as int8 codes with per-row scales (quantize() once per
    forward), one vocab chunk's rows of W decoded at a time into `rows` (from their GGML type, per-row scales),
    and for the KD backward dlogits [T, chunk] as codes with W's row scales folded in (`dz`). Chunks whose
    width is no multiple of one integer step (the last of an odd vocabulary) keep the other path."""

    h: Int8Matrix
    rows: Int8Matrix
    dz: Int8Matrix | None
    ones: Any  # hidden f32 ones: the backward's column scales (W's row scales are in dz)
    rot: int = 0  # h and W rotated in Walsh-Hadamard blocks of rot (model/int8.py hadamard_rows), 0: not
    dh_rot: Any = None  # [T, hidden] f32: a rotated chunk's dh R before its rotation back (backward with rot)
    # each decoded chunk's row scales by (weight, first row, rows), kept from its first decode: later decodes of the
    # chunk write the codes alone (weight_to_i8 fixed_scales: no absmax over each row; the same codes)
    chunk_scales: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    decoded: list[Any] = field(default_factory=list)  # [the row scales of the chunk decoded last]
    # the one-pass backward's P_c codes [T, chunk] (stochastically rounded, gpu/kernels/kd_probs_i8.wgsl) and their row
    # scales, two views of one buffer (probs_buf), and its uniform (seed, the scales' offset in words): built with probs
    probs: Int8Matrix | None = None
    probs_buf: Any = None
    dither: Any = None
    rows_t: Any = None  # the chunk's codes transposed ([hidden, chunk]) for P_c . W on the "nt" GEMM (PROBS_NT)

    @classmethod
    def build(
        cls, dev: Device, n_tokens: int, hidden: int, chunk: int, backward: bool, rot: int = 0, probs: bool = False
    ) -> Int8Head | None:
        """The buffers for n_tokens rows and vocab chunks of `chunk`; None when hidden is no multiple of 32.
        backward: the two-pass backward's dlogits codes; probs (instead): the one-pass backward's P_c codes."""
        if hidden % MMA_K or chunk % MMA_K:
            return None
        dz = i8_buffers(dev, n_tokens, chunk, chunk, "dlogits") if backward and not probs else None
        ones = dev.upload(np.ones(hidden, np.float32), label="int8 head column scales")
        dh_rot = dev.buffer(4 * n_tokens * hidden, label="int8 head dh, rotated") if dz is not None and rot else None
        head = cls(i8_buffers(dev, n_tokens, hidden, hidden, "head input"), i8_buffers(dev, chunk, hidden, hidden,
                   "lm_head chunk"), dz, ones, rot, dh_rot)  # fmt: skip
        if not probs:
            return head
        off = -(-n_tokens * chunk // dev.offset_alignment) * dev.offset_alignment
        buf = dev.buffer(off + 4 * n_tokens, label="int8 head probabilities")
        codes = Int8Matrix(BufferView(buf, 0, n_tokens * chunk), BufferView(buf, off, 4 * n_tokens), n_tokens, chunk,
                           chunk, "probabilities")  # fmt: skip
        usage = dev.wgpu.BufferUsage.UNIFORM | dev.wgpu.BufferUsage.COPY_DST
        dither = dev.buffer(16, usage=usage, label="int8 head dither")
        dev.write(dither, np.array([0, off // 4, 0, 0], np.uint32))
        rows_t = dev.buffer(chunk * hidden, label="lm_head chunk transposed") if PROBS_NT else None
        return replace(head, probs=codes, probs_buf=buf, dither=dither, rows_t=rows_t)

    def reseed(self, dev: Device, seed: int) -> None:
        """The stochastic rounding's seed for the next steps (probs): a new one per step, so each step's rounding
        errors are fresh."""
        if self.dither is not None:
            off = self.probs.scales.offset // 4
            dev.write(self.dither, np.array([seed & 0xFFFFFFFF, off, 0, 0], np.uint32))

    def probs_grad(self, dev: Device, nv: int, out: Any) -> None:
        """out [T, hidden] = P_c' . codes(W_c R), the chunk's P_c W_c R, from the probabilities' codes (kd_stats_probs8
        wrote them) and the chunk logits() decoded last (still rotated): the "nt" integer GEMM over its codes
        transposed (rows_t), else the "nn" one (the same sums and scales)."""
        p = self.probs
        codes = Int8Matrix(p.codes, p.scales, p.rows, nv, nv, "probabilities")
        rows = self.chunk_rows(nv)
        if self.rows_t is not None and nv % 4 == 0:
            gemm_i8(dev, codes, transpose_i8(dev, rows, self.rows_t, self.ones, "lm_head chunk transposed"), out)
        else:
            gemm_i8(dev, codes, rows, out, orient="nn", col_scales=self.ones)

    def quantize(self, dev: Device, h: Any) -> None:
        quantize_i8_gpu(dev, h, self.h, rot=self.rot)

    def covers(self, w: Any, nv: int) -> bool:
        return isinstance(w, QuantTensor) and nv % MMA_K == 0

    def chunk_rows(self, nv: int) -> Int8Matrix:
        """The decoded chunk's first nv rows (valid after logits() of that chunk: its scales are the last decoded's)."""
        r = self.rows
        return Int8Matrix(r.codes, self.decoded[0] if self.decoded else r.scales, nv, r.k, r.chunk, r.name)

    def keep_row_scales(self, dev: Device, w: Any, vocab: int) -> None:
        """Decode every chunk of W this head covers once now (chunks of self.rows.rows rows), keeping its row scales
        for the decodes of every later step (a recorded step then replays the codes-alone decode)."""
        with dev.step():
            for c0 in range(0, vocab, self.rows.rows):
                nv = min(self.rows.rows, vocab - c0)
                if self.covers(w, nv):
                    self.decode(dev, w, c0, nv)

    def decode(self, dev: Device, w: QuantTensor, c0: int, nv: int) -> Int8Matrix:
        """W[c0:c0+nv]'s codes into the chunk's rows: with their absmax the first time (the row scales kept by
        (weight, c0, nv)), the codes alone with the kept scales after it (the same codes)."""
        key = (w.name, c0, nv)
        fixed = key in self.chunk_scales
        if not fixed:
            self.chunk_scales[key] = dev.buffer(4 * nv, label=f"lm_head rows {c0}.. scales")
        self.decoded[:] = [self.chunk_scales[key]]
        rows = self.chunk_rows(nv)
        weight_to_i8(dev, row_slice(w, c0, nv), rows, rot=self.rot, fixed_scales=fixed)
        return rows

    def logits(self, dev: Device, w: QuantTensor, out: Any, c0: int, nv: int, ldc: int) -> None:
        """out [T, ldc] columns 0..nv-1 = h . W[c0:c0+nv]^T over the codes (the chunk's rows decoded first)."""
        gemm_i8(dev, self.h, self.decode(dev, w, c0, nv), out, ldc=ldc)

    def input_grad(self, dev: Device, dz: Any, ldz: int, nv: int, dh: Any, accumulate: bool) -> None:
        """dh [T, hidden] (+)= dz [T, nv] (row stride ldz) . W_c for the chunk logits() decoded last: dz times
        W's row scales rounded to 8 bits per row, then the "nn" integer GEMM (over rotated rows: dh R, rotated
        back into dh)."""
        rows = self.chunk_rows(nv)
        codes = Int8Matrix(self.dz.codes, self.dz.scales, self.h.rows, nv, nv, "dlogits")
        quantize_i8_gpu(dev, dz, codes, ldx=ldz, col_scales=rows.scales)

        def gemm(out: Any, acc: bool) -> None:
            gemm_i8(dev, codes, rows, out, orient="nn", col_scales=self.ones, accumulate=acc)

        rotated_back(dev, gemm, dh, self.h.rows, self.h.k, self.rot, accumulate, lambda: self.dh_rot)


def logits_chunk(
    dev: Device,
    h: Any,
    w: Any,
    out: Any,
    n_tokens: int,
    hidden: int,
    c0: int,
    nv: int,
    ldc: int,
    h16: Any = None,
    i8: Int8Head | None = None,
) -> None:
    """out [n_tokens, ldc] columns 0..nv-1 = h [n_tokens, hidden] . W[c0:c0+nv]^T. h16: h as f16 (tensor
    cores; the logits then carry h's f16 rounding, README's Numerics); i8: h's codes (integer GEMM, where
    i8.covers the chunk)."""
    if i8 is not None and i8.covers(w, nv):
        i8.logits(dev, w, out, c0, nv, ldc)
        return
    if isinstance(w, QuantTensor):
        if h16 is not None:
            linear_tc(dev, h16, row_slice(w, c0, nv), out, n_tokens, ldc=ldc, a_dtype="f16")
        else:
            linear(dev, h, row_slice(w, c0, nv), out, n_tokens, ldc=ldc)
        return
    a, b = row_major(h, hidden), transposed(w, hidden, off=c0 * hidden)
    strided_matmul(dev, a, b, out, n_tokens, nv, hidden, ldc=ldc)
