"""The teacher on the GPU: forward of the frozen model and its top-k next-token distribution per position, or the
sampled store's draws (gpu/ops/sampled.py, the same rows as model.teacher_cpu.reference_sampled_batch).

With precision int8 the teacher's projections can stay decoded: `resident_codes` keeps every projection's int8
codes (a byte a weight and a scale a row: 7.0 GB at Llama-3-8B) in ModelWeights.codes_i8, decoded once, where the
student decodes one block's at a time for every forward (11 % of the Llama-3-8B teacher's forward on an H100). auto:
when they fit (gpu/headroom.py), else block by block as the student."""

from __future__ import annotations

import numpy as np

from gpu.device import Device
from gpu.headroom import free_bytes
from gpu.model import GPUModel, ModelWeights
from gpu.ops import head
from gpu.ops.head import Int8Head
from gpu.ops.matmul_i8 import Int8Matrix
from gpu.ops.quantize_i8 import weight_to_i8
from gpu.ops.sampled import SampledState, hidden_sampled
from gpu.ops.topk import TopKState, hidden_topk
from gpu.profile import scope


class GPUTeacher(GPUModel):
    """Top-k ids, log-probs at temperature tau, and the tail mass, for `batch` sequences of `seq_len` tokens."""

    keeps_block_inputs = False  # forward only: two alternating residual-stream buffers, no backward scratch

    def __init__(
        self,
        dev: Device,
        weights: ModelWeights,
        *,
        batch: int,
        seq_len: int,
        top_k: int,
        tau: float,
        vocab_chunk: int = 4096,
        precision: str = "f32",
        resident_codes: bool | str = "auto",
    ) -> None:
        if resident_codes not in (True, False, "auto"):
            raise ValueError(f"resident_codes={resident_codes!r}: expected True, False or 'auto'")
        super().__init__(dev, weights, batch=batch, seq_len=seq_len, precision=precision)
        self.top_k = top_k
        self.tau = tau
        self.chunk = min(vocab_chunk, self.cfg.vocab)
        self.state = TopKState.build(dev, self.rows, top_k)
        self.logprobs = dev.buffer(4 * self.rows * top_k, label="teacher logprobs")
        self.tail = dev.buffer(4 * self.rows, label="teacher tail")
        self.logits = dev.buffer(4 * self.rows * self.chunk, label="teacher logits chunk")
        self._sampled: SampledState | None = None
        self.int8_head = (
            Int8Head.build(
                dev, self.rows, self.cfg.hidden, self.chunk, backward=False, rot=self._rotation(self.cfg.hidden)
            )
            if self.precision == "int8" and head.INT8_HEAD
            else None
        )
        self.resident_codes = self._keep_codes(resident_codes)

    def _keep_codes(self, setting: bool | str) -> bool:
        """Whether every projection's int8 codes stay decoded in self.w.codes_i8 (module docstring): decodes the
        missing ones now, when setting is True, or auto and they fit."""
        if not self._w8_slots:
            return False
        w = self.w
        missing = [
            (layer, target, self._rotation(slot.k))
            for layer in range(self.cfg.n_layers)
            for target, slot in self._w8_slots.items()
            if (layer, target, self._rotation(slot.k)) not in w.codes_i8
        ]
        need = sum(w.proj[key[:2]].shape[0] * (w.proj[key[:2]].shape[1] + 4) for key in missing)
        if not (
            setting is True or (setting == "auto" and need <= free_bytes(self.dev.memory_bytes(), self.dev.live_bytes))
        ):
            return False
        with self.dev.step():
            for layer, target, rot in missing:
                w.codes_i8[(layer, target, rot)] = weight_to_i8(self.dev, w.proj[(layer, target)], rot=rot)
        return True

    def _int8_weight(self, layer: int, target: str) -> Int8Matrix | None:
        slot = self._w8_slots.get(target)
        if slot is None or not self.resident_codes:
            return super()._int8_weight(layer, target)
        return self.w.codes_i8[(layer, target, self._rotation(slot.k))]

    def topk(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [B, T] -> (top-k ids [B, T, k] u32, logprobs [B, T, k] f32 sorted descending, tail [B, T] f32)."""
        batch, seq_len, top_k = self.batch, self.seq_len, self.top_k
        ids = np.asarray(ids).reshape(batch, seq_len)
        if np.any(ids < 0) or np.any(ids >= self.cfg.vocab):
            raise ValueError(f"token ids outside the teacher's vocabulary [0, {self.cfg.vocab})")
        bufs = self._b.bufs
        self.dev.write(bufs["ids"], ids.astype(np.uint32).reshape(-1))
        self.dev.write(bufs["positions"], np.tile(np.arange(seq_len, dtype=np.uint32), batch))
        with self.dev.step():
            self._taped("topk", self._record_topk)
        out_ids = self.dev.read(self.state.ids, np.uint32, (batch, seq_len, top_k))
        logprobs = self.dev.read(self.logprobs, np.float32, (batch, seq_len, top_k))
        tail = self.dev.read(self.tail, np.float32, (batch, seq_len))
        return out_ids, logprobs, tail

    def _record_topk(self) -> None:
        """Forward to the head and the top-k over vocab chunks, recorded into the current step."""
        cfg = self.cfg
        h16 = self._forward_to_head()
        with scope(self.dev, "kd head"):
            hidden_topk(
                self.dev,
                self.a["nf"],
                self.w.lm_head,
                self.state,
                self.logprobs,
                self.tail,
                cfg.hidden,
                cfg.vocab,
                self.tau,
                logits_scratch=self.logits,
                chunk=self.chunk,
                h16=h16,
                i8=self.int8_head,
            )

    def sampled(
        self, ids: np.ndarray, seq_ids: np.ndarray, n: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids [B, T] of the sequences seq_ids [B] -> the sampled store's rows (ids int64 [B, T, n], log-prob
        codes uint8 [B, T, n], counts uint8 [B, T, n]) of n draws keyed by (seed, seq_id, position), as
        model.teacher_cpu.reference_sampled_batch returns them (every position drawn; no mask)."""
        batch, seq_len = self.batch, self.seq_len
        ids = np.asarray(ids).reshape(batch, seq_len)
        if np.any(ids < 0) or np.any(ids >= self.cfg.vocab):
            raise ValueError(f"token ids outside the teacher's vocabulary [0, {self.cfg.vocab})")
        st = self._sampled
        if st is None or st.n != n:
            st = self._sampled = SampledState.build(self.dev, self.rows, n, self.cfg.vocab, self.chunk)
        bufs = self._b.bufs
        self.dev.write(bufs["ids"], ids.astype(np.uint32).reshape(-1))
        self.dev.write(bufs["positions"], np.tile(np.arange(seq_len, dtype=np.uint32), batch))
        seq = np.repeat(np.asarray(seq_ids, np.uint64).reshape(batch), seq_len)
        st.write_keys(self.dev, seq, np.tile(np.arange(seq_len), batch))
        with self.dev.step():
            self._taped(("sampled", n, seed), lambda: self._record_sampled(st, seed))
        shape = (batch, seq_len, n)
        out_ids = self.dev.read(st.ids, np.uint32, shape).astype(np.int64)
        codes = self.dev.read(st.codes, np.uint32, shape).astype(np.uint8)
        counts = self.dev.read(st.counts, np.uint32, shape).astype(np.uint8)
        return out_ids, codes, counts

    def _record_sampled(self, st: SampledState, seed: int) -> None:
        """Forward to the head and the sampled draw over vocab chunks, recorded into the current step."""
        cfg = self.cfg
        h16 = self._forward_to_head()
        with scope(self.dev, "kd head"):
            hidden_sampled(
                self.dev,
                self.a["nf"],
                self.w.lm_head,
                st,
                cfg.hidden,
                cfg.vocab,
                self.tau,
                seed,
                logits_scratch=self.logits,
                chunk=self.chunk,
                h16=h16,
                i8=self.int8_head,
            )
