"""The teacher on the GPU: forward of the frozen model and its top-k next-token distribution per position, or the
sampled store's draws (gpu/ops/sampled.py, the same rows as model.teacher_cpu.reference_sampled_batch).
With precision int8, `int8_codes` (GPUModel.keep_codes): the projections' codes decoded once and kept, or one
block's at a time every forward (the decode was 11 % of the Llama-3-8B teacher's forward on an H100)."""

from __future__ import annotations

import numpy as np

from gpu.device import Device
from gpu.model import GPUModel, ModelWeights
from gpu.ops import head
from gpu.ops.head import Int8Head
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
        int8_codes: str = "per_block",
    ) -> None:
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
        if self.int8_head is not None:
            self.int8_head.keep_row_scales(dev, self.w.lm_head, self.cfg.vocab)
        self.keep_codes(int8_codes)

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
