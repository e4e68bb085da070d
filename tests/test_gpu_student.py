"""A whole training step on the GPU (lavapipe) against model/reference.py: loss and every LoRA gradient,
then AdamW steps that reduce the loss, and bitwise reproducibility."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu.headroom import AUTO_SHARE as SHARE
from gpu.headroom import RESERVE_BYTES as RESERVE
from gpu.model import ModelWeights
from gpu.objectives import GpuKd
from gpu.student import GPUStudent
from model import reference
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig, log_softmax
from model.quant import quantize
from schemas.optim import AdamWConfig
from tests.gpu_fixtures import device_or_skip, tensor_core_device_or_skip
from tests.gpu_helpers import random_student_problem

pytestmark = pytest.mark.gpu

CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
T, B, K, R = 16, 2, 8, 4
REL = 1e-4  # f32 GPU vs float64 reference: max |err| / max |ref| per tensor


def _teacher(rng: np.random.Generator, tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    logits = rng.normal(0, 2.0, (B, T, CFG.vocab))
    lp = log_softmax(logits / tau)
    ids = np.argsort(-lp, axis=-1)[..., :K]
    top = np.take_along_axis(lp, ids, -1)
    return ids, top.astype(np.float32), np.clip(1 - np.exp(top).sum(-1), 0, None).astype(np.float32)


def _problem(seed: int, qtype: int):
    return random_student_problem(CFG, seed, qtype, R, B, T)


def _kd_problem(seed: int, qtype: int) -> tuple[dict, dict, KdBatch]:
    """(weights, adapter, batch) of a random KD step with a forward-KL teacher at tau 1 (FORWARD_KL)."""
    w, lora, ids, targets, mask, rng = _problem(seed, qtype)
    return w, lora, KdBatch(ids, targets, mask, *_teacher(rng, 1.0))


FORWARD_KL = LossConfig("forward_kl", tau=1.0, use_tail=True)


def _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, scale):
    """Batch loss = mean over all masked rows: combine per-sequence masked means by their row counts."""
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    l64 = {k: reference.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in lora.items()}
    n_total = mask.sum()
    loss, grads = 0.0, {}
    for s in range(B):
        ls, gs = reference.loss_and_grads(
            w64,
            CFG,
            ids[s],
            l64,
            scale,
            tids[s],
            tlp[s].astype(np.float64),
            ttail[s].astype(np.float64),
            targets[s],
            mask[s],
            loss_cfg,
        )
        c = mask[s].sum() / n_total
        loss += c * ls
        for key, (da, db) in gs.items():
            prev = grads.get(key, (0.0, 0.0))
            grads[key] = (prev[0] + c * da, prev[1] + c * db)
    return loss, grads


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize(
    ("qtype", "loss_cfg"),
    [
        (Q.F32, LossConfig("forward_kl", tau=1.0, use_tail=True)),
        (Q.Q4_0, LossConfig("jsd", tau=2.0, beta=0.3, ce_weight=0.25, use_tail=False)),
    ],
    ids=["f32-forward_kl-tail", "q4_0-jsd-ce"],
)
def test_step_matches_reference(qtype: int, loss_cfg: LossConfig) -> None:
    dev = device_or_skip()
    w, lora, ids, targets, mask, rng = _problem(3, qtype)
    tids, tlp, ttail = _teacher(rng, loss_cfg.tau)
    scale = 2.0
    weights = ModelWeights.from_arrays(dev, CFG, w, qtype)
    st = GPUStudent(
        dev,
        weights,
        EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=scale * R, batch=B, seq_len=T),
        GpuKd(loss_cfg, K),
    )
    st.set_adapter(lora)
    st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail if loss_cfg.use_tail else None))
    loss = st.loss_and_grads()
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, scale)
    assert abs(loss - want_loss) / abs(want_loss) < REL
    got = st.get_grads()
    worst = {}
    for key, (da, db) in want.items():
        worst[key] = max(_rel(got[key].A, da), _rel(got[key].B, db))
    assert max(worst.values()) < REL, sorted(worst.items(), key=lambda kv: -kv[1])[:4]


BF16_CKPT_REL = 1e-2  # bf16 checkpoints: the recompute starts from block inputs rounded to 8 significant bits


def test_bf16_checkpoints_keep_the_loss_and_bound_the_gradients() -> None:
    """checkpoints="bf16" (the tensor-core default) on the f32 path: bitwise the same loss (the forward stays
    f32), the kept block inputs at half the bytes, gradients within BF16_CKPT_REL of float64 and not bitwise
    those recomputed from f32 inputs (the bf16 copies are what the backward read)."""
    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    runs = {}
    for kind in ("f32", "bf16"):
        st = GPUStudent(
            dev,
            weights,
            EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T),
            GpuKd(loss_cfg, K),
            checkpoints=kind,
        )
        st.set_adapter(lora)
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        runs[kind] = (st, st.loss_and_grads(), st.get_grads())
    (f32, loss_f32, grads_f32), (bf16, loss_bf16, grads_bf16) = runs["f32"], runs["bf16"]
    assert loss_bf16 == loss_f32
    assert f32.xs.size == 4 * (CFG.n_layers + 1) * f32.slot and not f32.bf16_checkpoints
    assert bf16.xs.size == 4 * 2 * bf16.slot and bf16.xs16.size == 4 * (CFG.n_layers - 1) * bf16.slot16
    _, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, 2.0)
    worst = max(max(_rel(grads_bf16[k].A, da), _rel(grads_bf16[k].B, db)) for k, (da, db) in want.items())
    print(f"bf16 checkpoints: worst grad rel err {worst:.2e}")
    assert worst < BF16_CKPT_REL
    assert any(not np.array_equal(grads_bf16[k].A, grads_f32[k].A) for k in want)
    with pytest.raises(ValueError, match="checkpoints='f16'"):
        GPUStudent(
            dev,
            weights,
            EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T),
            GpuKd(loss_cfg, K),
            checkpoints="f16",
        )


def test_attention_views_equal_padded_slots() -> None:
    """Sequences whose rows start binding-aligned bind views into the packed tensors; otherwise rows go through
    padded slots. Both give bitwise the same loss and gradients."""

    class SlottedStudent(GPUStudent):
        def _sequences_aligned(self) -> bool:
            return False

    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(5, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    results = []
    for cls in (GPUStudent, SlottedStudent):
        spec = EngineSpec(CFG, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T)
        st = cls(dev, weights, spec, GpuKd(loss_cfg, K))
        assert st.direct_attention == (cls is GPUStudent)
        st.set_adapter(lora)
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        results.append((st.loss_and_grads(), st.layout.pack(st.get_grads())))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_replayed_step_reads_the_new_batch() -> None:
    """The second loss_and_grads replays the first one's tape: on a new batch it gives bitwise what a fresh
    student recording that batch gives (the tape holds commands, not data)."""
    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(9, Q.Q4_0)
    batches = [(ids, targets, mask, *_teacher(rng, 1.0))]
    _, _, ids2, targets2, mask2, rng2 = _problem(10, Q.Q4_0)
    batches.append((ids2, targets2, mask2, *_teacher(rng2, 1.0)))
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)

    def student() -> GPUStudent:
        st = GPUStudent(
            dev,
            weights,
            EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T),
            GpuKd(loss_cfg, K),
        )
        st.set_adapter(lora)
        return st

    taped = student()
    for batch in batches:
        taped.write_batch(KdBatch(*batch))
        replayed = (taped.loss_and_grads(), taped.layout.pack(taped.get_grads()))
    assert len(taped._tapes) == 1
    fresh = student()
    fresh.write_batch(KdBatch(*batches[1]))
    assert replayed[0] == fresh.loss_and_grads()
    np.testing.assert_array_equal(replayed[1], fresh.layout.pack(fresh.get_grads()))


def test_training_reduces_kl_and_is_bitwise_reproducible() -> None:
    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, _, ids, targets, mask, rng = _problem(5, Q.Q8_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q8_0)

    def run(n_steps: int) -> tuple[list[float], np.ndarray]:
        st = GPUStudent(
            dev,
            weights,
            EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T),
            GpuKd(loss_cfg, K),
            AdamWConfig(lr=1e-2, max_grad_norm=1.0),
        )
        st.set_adapter(reference.init_lora(CFG, list(LORA_TARGETS), R, seed=0))
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        losses = [st.train_step(lr=1e-2).loss for _ in range(n_steps)]
        return losses, st.layout.pack(st.get_adapter())

    losses, params = run(30)
    assert losses[-1] < 0.7 * losses[0], losses
    losses2, params2 = run(30)
    assert losses == losses2
    assert params.tobytes() == params2.tobytes()


def test_teacher_topk_matches_reference() -> None:
    from gpu.teacher import GPUTeacher

    dev = device_or_skip()
    w, _, ids, _, _, _ = _problem(7, Q.F32)
    tau = 1.5
    teacher = GPUTeacher(dev, ModelWeights.from_arrays(dev, CFG, w), batch=B, seq_len=T, top_k=K, tau=tau)
    got_ids, got_lp, got_tail = teacher.topk(ids)
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    for s in range(B):
        lp = log_softmax(reference.forward(w64, CFG, ids[s]) / tau)
        want_ids = np.argsort(-lp, axis=-1)[:, :K]
        want_lp = np.take_along_axis(lp, want_ids, -1)
        np.testing.assert_array_equal(got_ids[s], want_ids)
        assert _rel(got_lp[s], want_lp) < REL
        np.testing.assert_allclose(got_tail[s], 1 - np.exp(want_lp).sum(-1), atol=1e-5)


def test_streamed_upload_from_gguf_matches_arrays(tmp_path) -> None:
    """ModelWeights.from_gguf (read-ahead thread) gives the same step as uploading the arrays directly."""
    from model.gguf import llama_metadata, write_gguf

    dev = device_or_skip()
    w, lora, ids, targets, mask, rng = _problem(11, Q.Q4_0)
    meta = llama_metadata(CFG)
    tensors = [
        (
            n,
            quantize(a, Q.Q4_0) if a.ndim == 2 and n.startswith("blk.") else a,
            Q.Q4_0 if a.ndim == 2 and n.startswith("blk.") else Q.F32,
        )
        for n, a in w.items()
    ]
    write_gguf(tmp_path / "s.gguf", "llama", meta, tensors)
    seen = []
    streamed = ModelWeights.from_gguf(dev, tmp_path / "s.gguf", progress=lambda info: seen.append(info.name))
    assert sorted(seen) == sorted(w)
    tids, tlp, ttail = _teacher(rng, 1.0)
    losses = []
    for weights in (streamed, ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)):
        st = GPUStudent(
            dev,
            weights,
            EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=R, batch=B, seq_len=T),
            GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=True), K),
        )
        st.set_adapter(lora)
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        losses.append(st.loss_and_grads())
    assert losses[0] == losses[1]


TC_REL = 2e-2  # tensor cores: activations and dequantized weights rounded to f16 (11-bit mantissa), f32 accumulation


@pytest.mark.tensorcore
def test_tensorcore_f16_gemm_inputs_are_exact() -> None:
    """Packing each projection's input to f16 once (shared by q/k/v and gate/up) gives bitwise the residual
    stream of the GEMMs rounding f32 inputs while staging (H200 only)."""
    from gpu.model import GPUModel

    dev = tensor_core_device_or_skip()
    w, lora, ids, *_ = _problem(3, Q.Q4_0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    streams = []
    for packed in (True, False):
        model = GPUModel(
            dev, weights, batch=B, seq_len=T, targets=LORA_TARGETS, r=R, alpha=2 * R, precision="tensorcore"
        )
        model._pack_inputs = packed
        model.set_adapter(lora)
        streams.append(model.residual_stream(ids, CFG.n_layers))
    assert np.isfinite(streams[0]).all()
    np.testing.assert_array_equal(streams[0], streams[1])


def _precision_student(
    dev, weights: ModelWeights, precision: str, loss_cfg: LossConfig, vocab_chunk: int = 4096
) -> GPUStudent:
    """A KD student of the test shapes (LoRA on every target, alpha 2r) on `precision`."""
    spec = EngineSpec(
        CFG, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, precision=precision, vocab_chunk=vocab_chunk
    )
    return GPUStudent(dev, weights, spec, GpuKd(loss_cfg, K))


@pytest.mark.tensorcore
def test_tensorcore_step_matches_reference() -> None:
    """The same step with every frozen projection and the LM head's logits on tensor cores (Dawn subgroup
    matrices; H200 only)."""
    dev = tensor_core_device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    st = _precision_student(dev, ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0), "tensorcore", loss_cfg)
    st.set_adapter(lora)
    st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
    loss = st.loss_and_grads()
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, 2.0)
    assert abs(loss - want_loss) / abs(want_loss) < TC_REL
    got = st.get_grads()
    worst = max(max(_rel(got[k].A, da), _rel(got[k].B, db)) for k, (da, db) in want.items())
    print(f"tensorcore step: loss rel err {abs(loss - want_loss) / abs(want_loss):.2e}, worst grad rel err {worst:.2e}")
    assert worst < TC_REL


# int8 (opt-in): the frozen forward's activations and weights rounded to 8 bits of their row's max |value| (a
# relative error up to 1/254 each, vs f16's 1/2048), i32 accumulation; the rest as tensorcore. Measured on the
# H200 (2026-12-04): loss 1.5e-4 (Q4_0) / 1.6e-3 (Q8_0) relative, the worst LoRA gradient 6.4e-2 / 3.9e-2 of its
# max (tensorcore: 4.4e-3); teacher top-k log-probs 1.5e-2 of max, top-1 ids 96.9 % equal to f32's. With the
# operands rotated (2026-12-05): loss 5.4e-4 / 2.4e-4, gradients 4.4e-2 / 6.5e-2, teacher 2.1e-2 and 100 %. An
# indexing or scale error is O(1); the tolerance holds the measured rounding with a margin.
INT8_REL = 1e-1


@pytest.mark.tensorcore
def test_tensorcore_rope_in_pack_is_bitwise_the_rope_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-core attention (head dim 64) with q and k RoPE'd as they are packed (rope_in_pack, the default)
    against the RoPE pass then the pack: bitwise the same loss and gradients, and 2 RoPE passes fewer a block in
    the forward (4 with the backward's recompute; H200 only)."""
    import dataclasses
    import sys

    from gpu import model as gpu_model
    from gpu.ops import rope as rope_ops

    wide = dataclasses.replace(CFG, hidden=128, n_heads=2, n_kv_heads=1, head_dim=64)
    monkeypatch.setattr(sys.modules[__name__], "CFG", wide)
    runs, ran = _spied_runs(monkeypatch, rope_ops, ("rope_in_pack",), lambda name, variant: name, "tensorcore")
    calls = [len(r) for r in ran]  # 4 L - 2 fewer only where the attention is the batched tensor-core one
    assert gpu_model.GPUModel.rope_in_pack
    assert calls[1] - calls[0] == 4 * wide.n_layers - 2  # the top block is not recomputed
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.tensorcore
@pytest.mark.parametrize(
    "qtype,int8_grads", [(Q.Q4_0, True), (Q.Q8_0, True), (Q.Q4_0, False)], ids=["Q4_0", "Q8_0", "Q4_0-f16-grads"]
)
def test_int8_step_matches_reference(qtype: int, int8_grads: bool) -> None:
    """The step with every frozen projection's forward (and the backward's recompute) and input gradient on the
    integer tensor cores (int8_grads False: the input gradients on f16 ones) and the rest as tensorcore, against
    the float64 reference on the dequantized weights (H200 only)."""
    dev = tensor_core_device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, qtype)
    tids, tlp, ttail = _teacher(rng, 1.0)
    st = _precision_student(dev, ModelWeights.from_arrays(dev, CFG, w, qtype), "int8", loss_cfg)
    st.int8_input_grads = int8_grads
    st.set_adapter(lora)
    st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
    loss = st.loss_and_grads()
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, 2.0)
    got = st.get_grads()
    worst = max(max(_rel(got[k].A, da), _rel(got[k].B, db)) for k, (da, db) in want.items())
    print(
        f"int8 step ({qtype.name}): loss rel err {abs(loss - want_loss) / abs(want_loss):.2e}, worst grad {worst:.2e}"
    )
    assert abs(loss - want_loss) / abs(want_loss) < INT8_REL
    assert worst < INT8_REL


@pytest.mark.tensorcore
def test_tensorcore_teacher_topk_close() -> None:
    """The teacher's top-k with projections and LM-head logits on tensor cores vs the f32 path on the same
    device: the sorted top-k log-probs (continuous even where near-ties swap ids) within TC_REL of their max,
    and the top-1 ids agree on nearly every row (H200 only)."""
    from gpu.teacher import GPUTeacher

    dev = tensor_core_device_or_skip()
    w, _, ids, _, _, _ = _problem(7, Q.F32)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    got, want = (
        GPUTeacher(dev, weights, batch=B, seq_len=T, top_k=K, tau=1.0, precision=p).topk(ids)
        for p in ("tensorcore", "f32")
    )
    err = float(np.abs(got[1] - want[1]).max() / np.abs(want[1]).max())
    print(f"tensorcore teacher: top-k log-prob err {err:.2e} of max")
    assert err < TC_REL
    assert np.mean(got[0][..., 0] == want[0][..., 0]) > 0.95


def test_int8_engine_logic_with_emulated_integer_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 path on lavapipe, its integer GEMMs emulated and its other GEMMs f32 (int8_emulation): the step's
    loss and LoRA gradients within INT8_REL of the float64 reference (the 8-bit rounding of the projections' and
    the LM head's inputs, weights and input gradients; a stale or mis-indexed block of codes is an O(1) error);
    a replayed step
    (its tape decodes what it needs) bitwise the recorded one; the input gradients over W's transposed codes
    (the default) bitwise those of the "nn" GEMM over W's codes; the LoRA terms in passes of their own instead of
    the GEMMs' epilogues as close to the reference; and after a step the shared slots hold exactly the
    codes weight_to_i8 gives the lowest block's weights (one block's projections are decoded at a time). The
    student's LM head runs on the integer GEMM here (INT8_STUDENT_HEAD, off by default) so its code is held too.
    The slots' decodes write the codes alone, from the row scales decoded once (weights.scales_i8)."""
    from gpu.ops import head
    from gpu.ops.matmul_i8 import int8_emulation
    from gpu.ops.quantize_i8 import weight_to_i8
    from model.int8 import rotation_block

    monkeypatch.setattr(head, "INT8_STUDENT_HEAD", True)
    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    with int8_emulation(dev):
        # vocab chunks of 256: the first on the integer head, the last (44 wide) on the f32 one
        st = _precision_student(dev, weights, "int8", loss_cfg, vocab_chunk=256)
        assert not st.tensor_cores and set(st._w8_slots) == set(LORA_TARGETS) and st.objective.scratch.int8
        st.set_adapter(lora)
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        runs = [(st.loss_and_grads(), st.get_grads()) for _ in range(3)]  # recorded, then replayed twice
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, 2.0)
    loss, grads = runs[0]
    worst = max(max(_rel(grads[k].A, da), _rel(grads[k].B, db)) for k, (da, db) in want.items())
    print(f"emulated int8 step: loss rel err {abs(loss - want_loss) / abs(want_loss):.2e}, worst grad {worst:.2e}")
    assert abs(loss - want_loss) / abs(want_loss) < INT8_REL
    assert worst < INT8_REL
    for again, again_grads in runs[1:]:
        assert again == loss
        for key, g in grads.items():
            np.testing.assert_array_equal(g.A, again_grads[key].A)
            np.testing.assert_array_equal(g.B, again_grads[key].B)
    with int8_emulation(dev):
        # the LoRA terms in passes of their own instead of the integer GEMMs' epilogues (the default: f16 operands,
        # rank padded to 16, the input gradient's A rotated like the codes): a few 1e-4 of the LoRA term apart,
        # which move 8-bit roundings downstream, so both are held to the reference (O(1) if misplaced)
        keys = [k[1] for k in dev._pipelines if k[0] == "matmul_i8"]
        assert st.lora_in_gemm_i8 and {v.lora for v in keys} >= {"rows", "cols"}, "the epilogue variants ran"
        split = _precision_student(dev, weights, "int8", loss_cfg, vocab_chunk=256)
        split.lora_in_gemm_i8 = False
        split.set_adapter(lora)
        split.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        split_loss, split_grads = split.loss_and_grads(), split.get_grads()
        split_worst = max(max(_rel(split_grads[k].A, da), _rel(split_grads[k].B, db)) for k, (da, db) in want.items())
        print(f"LoRA in passes of their own: loss rel err {abs(split_loss - want_loss) / abs(want_loss):.2e}, "
              f"worst grad {split_worst:.2e}")  # fmt: skip
        assert abs(split_loss - want_loss) / abs(want_loss) < INT8_REL
        assert split_worst < INT8_REL
        # the input gradients on the "nn" GEMM over W's codes (its LoRA terms in passes of their own, as split's):
        # the same integer sums
        nn = _precision_student(dev, weights, "int8", loss_cfg, vocab_chunk=256)
        nn.transposed_input_grads, nn.lora_in_gemm_i8 = False, False
        nn.set_adapter(lora)
        nn.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        assert nn.loss_and_grads() == split_loss
        for key, g in nn.get_grads().items():
            np.testing.assert_array_equal(g.A, split_grads[key].A)
            np.testing.assert_array_equal(g.B, split_grads[key].B)
    for target, slot in st._w8_slots.items():  # the slots' codes, decoded with the row scales kept at construction
        fresh = weight_to_i8(dev, weights.proj[(0, target)], rot=rotation_block(slot.k))
        for got, wanted, n in (
            (slot.codes, fresh.codes, slot.rows * slot.k),
            (weights.scales_i8[(0, target, rotation_block(slot.k))], fresh.scales, 4 * slot.rows),
        ):
            assert dev.read(got, np.uint8, (n,)).tobytes() == dev.read(wanted, np.uint8, (n,)).tobytes(), target


@pytest.mark.parametrize("switch", ["THIN_I8", "THIN_DT", "THIN_DB", "THIN_DA"])
def test_int8_lora_products_from_codes(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """lora_i8.THIN_I8: every adapter's t = x A^T from x's int8 codes and A's (lora_thin_i8, emulated; widths of 64
    and up, rank 16, 64 rows), run four times a block in the forward (q, k, v together; o; gate, up together; down)
    and none in the recompute (the kept t's replayed); the first block's kept t's (the same x codes either way)
    within 3e-2 of t from f32 x (A's 8-bit rounding: ~1 %; a misplaced group is O(1)). THIN_DT (THIN_I8 on in both
    runs): dt = s dY B from the input gradient's dY codes and B / sW, for every adapter whose d_out is a multiple of
    64 (q, o, gate, up, down here: k and v are 32 wide). THIN_DB (both on in both runs): dB from those codes and t
    too (gpu/ops/lora_db_i8.py, one chunk of scales), for the same adapters. THIN_DA (the three on in both runs): every
    adapter's dA from the forward's x codes kept through the block's backward (gpu/ops/lora_da_i8.py: q, k, v in one
    product, o, gate and up in one, down: four a block, each input rotated), the norms' and the gated unit's f32
    outputs then left unwritten (their readers take the codes). Each: the loss within INT8_REL of the
    float64 reference, the LoRA gradients within 3 INT8_REL (this random model amplifies the extra rounding through
    both blocks: 0.15 at worst; numpy studies on the demo: the trained adapter's held-out KL -0.5 % and +0.3 %,
    docs/benchmarks.md 2026-12-07), and not the gradients of the f32 products (the path ran)."""
    import dataclasses
    import sys

    from gpu.ops import lora_da_i8, lora_db_i8, lora_i8
    from gpu.ops.matmul_i8 import int8_emulation

    wide = dataclasses.replace(CFG, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16)
    monkeypatch.setattr(sys.modules[__name__], "CFG", wide)
    monkeypatch.setattr(sys.modules[__name__], "R", 16)
    monkeypatch.setattr(sys.modules[__name__], "T", 32)  # 64 rows: lora_db_i8 takes whole chunks of 64
    dev = device_or_skip()
    w, lora, ids, targets, mask, rng = _problem(5, Q.Q4_0)
    teacher = _teacher(rng, 1.0)
    batch = KdBatch(ids, targets, mask, *teacher)
    weights = ModelWeights.from_arrays(dev, wide, w, Q.Q4_0)
    real, thin = lora_i8.pipeline, []

    def spy(dev: object, name: str, **variant: object) -> object:
        thin.append(name)
        return real(dev, name, **variant)

    monkeypatch.setattr(lora_i8, "pipeline", spy)
    monkeypatch.setattr(lora_db_i8, "pipeline", spy)
    monkeypatch.setattr(lora_i8, "THIN_I8", True)
    monkeypatch.setattr(lora_i8, "THIN_DT", switch in ("THIN_DB", "THIN_DA"))  # THIN_I8's runs: dt from f32 dY
    monkeypatch.setattr(lora_db_i8, "THIN_DB", switch == "THIN_DA")
    monkeypatch.setattr(lora_da_i8, "THIN_DA", False)
    module = {"THIN_DB": lora_db_i8, "THIN_DA": lora_da_i8}.get(switch, lora_i8)
    runs, kept = {}, {}
    for on in (True, False):
        monkeypatch.setattr(module, switch, on)
        thin.clear()
        with int8_emulation(dev):
            st = _precision_student(dev, weights, "int8", FORWARD_KL, vocab_chunk=256)
            st.set_adapter(lora)
            st.write_batch(batch)
            runs[on] = (st.loss_and_grads(), st.get_grads())
            if switch == "THIN_DA":  # every input's f32 copy unwritten with it (its readers take the codes)
                needed = {
                    st._input_f32_needed(layer, name) for layer in range(wide.n_layers) for name in ("n1", "n2", "s")
                }
                assert needed == {not on}, needed
            kept[on] = {k: dev.read(st._lora_t(*k).buffer, np.float32, (st.rows * 16,), offset=st._lora_t(*k).offset)
                        for k in st.layout.slots if k[0] == 0}  # fmt: skip
        products = {"THIN_I8": (4, 0), "THIN_DT": (4 + 5, 4), "THIN_DB": (9, 9), "THIN_DA": (9, 9)}[switch]
        assert thin.count("lora_thin_i8") == products[0 if on else 1] * wide.n_layers, thin
        sums = {"THIN_DB": (5, 0), "THIN_DA": (5 + 4, 5)}.get(switch, (0, 0))[0 if on else 1]
        assert thin.count("lora_sum_i8") == sums * wide.n_layers, thin
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, *teacher, FORWARD_KL, 2.0)
    loss, grads = runs[True]
    worst = max(max(_rel(grads[k].A, da), _rel(grads[k].B, db)) for k, (da, db) in want.items())
    print(f"int8 step, {switch}: loss rel err {abs(loss - want_loss) / abs(want_loss):.2e}, worst grad {worst:.2e}")
    assert abs(loss - want_loss) / abs(want_loss) < INT8_REL
    assert worst < 3 * INT8_REL
    changed = "B" if switch == "THIN_DB" else "A"  # dA comes from dt, which THIN_DB leaves alone
    assert any(not np.array_equal(getattr(g, changed), getattr(runs[False][1][k], changed)) for k, g in grads.items())
    if switch == "THIN_I8":
        for key, t in kept[True].items():
            assert not np.array_equal(t, kept[False][key]) and _rel(t, kept[False][key]) < 3e-2, key


def _spied_runs(
    monkeypatch: pytest.MonkeyPatch,
    spied: Any,
    switches: tuple[str, ...],
    record: Any,
    precision: str = "int8",
    **fixed: bool,
) -> tuple[list, list]:
    """The step of _kd_problem(3) on `precision` (int8: its integer GEMMs emulated; tensorcore: Dawn only) with the
    student's attributes `switches` on, then off (`fixed` set as given in both): (loss and packed gradients of each,
    record(name, variant) of each pipeline that module `spied` asked for in each). With fused_grad_codes_i8 among
    them, the separate RMSNorm backward on the scalar kernel, whose sums' order the fused one (rmsnorm_back_i8)
    follows, not rmsnorm_backward4's."""
    from gpu.ops import rmsnorm
    from gpu.ops.matmul_i8 import int8_emulation

    if "fused_grad_codes_i8" in (*switches, *fixed):
        monkeypatch.setattr(rmsnorm, "VEC4_BACKWARD", False)

    dev = tensor_core_device_or_skip() if precision == "tensorcore" else device_or_skip()
    w, lora, batch = _kd_problem(3, Q.Q4_0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    runs, ran = [], []
    real = spied.pipeline

    def spy(dev: object, name: str, **variant: object) -> object:
        ran[-1].append(record(name, variant))
        return real(dev, name, **variant)

    monkeypatch.setattr(spied, "pipeline", spy)
    with int8_emulation(dev) if precision == "int8" else contextlib.nullcontext():
        for on in (True, False):
            ran.append([])
            st = _precision_student(dev, weights, precision, FORWARD_KL)
            for name, value in {**dict.fromkeys(switches, on), **fixed}.items():
                setattr(st, name, value)
            st.set_adapter(lora)
            st.write_batch(batch)
            runs.append((st.loss_and_grads(), st.layout.pack(st.get_grads())))
    return runs, ran


def test_int8_residual_in_gemm_is_bitwise_the_add_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's residual adds in the o and down projections' integer GEMM epilogues (residual_in_gemm_i8, the
    default) against add passes over their outputs: bitwise the same loss and gradients (emulated integer GEMMs;
    the LoRA terms in the epilogues too), two add passes fewer a block in the forward and one in a recompute."""
    from gpu.model import GPUModel
    from gpu.ops import add as add_ops

    runs, ran = _spied_runs(monkeypatch, add_ops, ("residual_in_gemm_i8",), lambda name, variant: name)
    assert GPUModel.residual_in_gemm_i8
    blocks = CFG.n_layers
    assert ran[1].count("add") - ran[0].count("add") == 2 * blocks + (blocks - 1)
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_int8_fused_codes_is_bitwise_the_separate_quantizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 step with the RMSNorms and the SwiGLU giving their outputs' codes in the same pass, the SwiGLU's
    backward its gradients', and the RMSNorms' backward the o and down projections' dY operands (fused_codes_i8, the
    default, and fused_grad_codes_i8, off by default), and with the quantizer reading them back: bitwise the same
    loss and gradients (emulated integer GEMMs); fused, the only scaled quantizers left are q/k/v's."""
    from gpu.model import GPUModel
    from gpu.ops import quantize_i8

    runs, ran = _spied_runs(
        monkeypatch,
        quantize_i8,
        ("fused_codes_i8", "fused_grad_codes_i8", "glu_grad_codes_i8"),
        lambda name, variant: name + ("_scaled" if variant.get("scaled") else ""),
    )
    assert GPUModel.fused_codes_i8 and not GPUStudent.fused_grad_codes_i8 and GPUStudent.glu_grad_codes_i8
    blocks = CFG.n_layers
    assert ran[0].count("rmsnorm_back_i8") == 2 * blocks and "rmsnorm_back_i8" not in ran[1]
    # o's, down's, gate's and up's dY quantizers, a block
    assert ran[1].count("quantize_i8_scaled") - ran[0].count("quantize_i8_scaled") == 4 * blocks
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def _thin_shapes(monkeypatch: pytest.MonkeyPatch) -> ModelConfig:
    """Patch this module's CFG, R and T to shapes the thin LoRA products over codes take (rank 16, 64 rows, widths
    of whole steps); returns the config."""
    import dataclasses
    import sys

    wide = dataclasses.replace(CFG, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16)
    for name, value in (("CFG", wide), ("R", 16), ("T", 32)):
        monkeypatch.setattr(sys.modules[__name__], name, value)
    return wide


def _rotations(name: str, variant: dict) -> tuple:
    """A pipeline's record for _spied_runs: its name, rotation mode and block."""
    return name, variant.get("mode"), variant.get("rot")


def test_int8_glu_grad_codes_is_bitwise_the_separate_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated unit's backward giving both gradients' codes in the same pass (glu_grad_codes_i8, the default) against
    swiglu_backward and the two scaled quantizers: bitwise the same loss and gradients (emulated integer GEMMs), two
    quantizer dispatches fewer a block, and the f32 gradients left unwritten (every adapter's dt and dB from the codes)
    unless the LoRA products read f32 dY (lora_i8.THIN_DT off). Rank 16 over 64 rows: the thin products' shapes."""
    from gpu import student as student_mod
    from gpu.ops import lora_i8, quantize_i8

    wide = _thin_shapes(monkeypatch)

    stores: list[bool] = []
    real = student_mod.glu_backward_i8

    def spy(*args: Any, store_grads: bool = True, **kw: Any) -> None:
        stores.append(store_grads)
        real(*args, store_grads=store_grads, **kw)

    monkeypatch.setattr(student_mod, "glu_backward_i8", spy)
    record = lambda name, variant: name + ("_scaled" if variant.get("scaled") else "")  # noqa: E731
    runs, ran = _spied_runs(monkeypatch, quantize_i8, ("glu_grad_codes_i8",), record)
    blocks = wide.n_layers
    assert ran[0].count("glu_back_i8") == blocks and "glu_back_i8" not in ran[1]
    assert ran[1].count("quantize_i8_scaled") - ran[0].count("quantize_i8_scaled") == 2 * blocks
    assert stores == [False] * blocks
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    stores.clear()
    monkeypatch.setattr(lora_i8, "THIN_DT", False)
    runs, _ = _spied_runs(monkeypatch, quantize_i8, ("glu_grad_codes_i8",), record)
    assert stores == [True] * blocks
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_int8_glu_turns_back_the_down_input_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated unit's backward turning the down projection's rotated input gradient dL/ds R back as it reads it
    (glu_turns_back, opt-in) against a rotation pass over ds first: bitwise the same loss and gradients (emulated
    integer GEMMs, ffn 128 rotated in blocks of 128), one rotation pass fewer a block, the fused kernel's rotated
    variant once a block."""
    from gpu.ops import quantize_i8

    wide = _thin_shapes(monkeypatch)
    runs, ran = _spied_runs(monkeypatch, quantize_i8, ("glu_turns_back",), _rotations, glu_grad_codes_i8=True)
    blocks = wide.n_layers
    backs = [sum(name == "hadamard_rows" and mode == "back" for name, mode, _ in r) for r in ran]
    assert backs[1] - backs[0] == blocks
    assert [rot for name, _, rot in ran[0] if name == "glu_back_i8"] == [128] * blocks
    assert [rot for name, _, rot in ran[1] if name == "glu_back_i8"] == [0] * blocks
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_int8_norm_turns_back_the_summed_input_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RMSNorm backward turning the summed q/k/v and gate/up input gradients (dX R) back itself (norm_turns_back,
    with fused_grad_codes_i8; both off by default) against a rotation pass over them first: bitwise the same loss
    and gradients (emulated integer GEMMs), and two rotation passes fewer a block (the lowest block's attention
    norm, whose gradient feeds no integer GEMM, keeps its pass). k and v 32 wide here, so that their input
    gradients join q's on the integer GEMM."""
    import dataclasses
    import sys

    wide = dataclasses.replace(CFG, hidden=64, head_dim=16)
    monkeypatch.setattr(sys.modules[__name__], "CFG", wide)
    from gpu.ops import quantize_i8

    runs, ran = _spied_runs(monkeypatch, quantize_i8, ("norm_turns_back",), _rotations, fused_grad_codes_i8=True)
    assert not GPUStudent.norm_turns_back
    backs = [sum(name == "hadamard_rows" and mode == "back" for name, mode, _ in r) for r in ran]
    assert backs[1] - backs[0] == 2 * wide.n_layers - 1
    turned = [rot for name, _, rot in ran[0] if name == "rmsnorm_back_i8"]
    assert turned == [0, 64, 64, 64]  # the output norm, block 1's two norms, block 0's ffn norm
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("precision", ["f32", "int8"])
def test_shared_lora_inputs_is_one_product_per_input(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """The LoRA products over the input that q, k, v (and gate, up) share, t = x A^T in the forward and dA = dt^T x
    in the backward, one for all of them (shared_lora_inputs, the default): two lora_gemm dispatches fewer a block
    for q/k/v and one for gate/up, each way, and the step's loss and gradients within 1e-5 of the per-projection
    products' (the same sums, other tiles; int8 emulated). Products on any of lora_matmul's kernels count."""
    from gpu.ops import lora_matmul
    from gpu.ops.matmul_i8 import int8_emulation

    dev = device_or_skip()
    w, lora, batch = _kd_problem(3, Q.Q4_0)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    real, counts, runs = lora_matmul.pipeline, [], []

    def spy(dev: object, name: str, **variant: object) -> object:
        counts[-1] += name in ("lora_gemm", "lora_stream", "lora_rows")
        return real(dev, name, **variant)

    monkeypatch.setattr(lora_matmul, "pipeline", spy)
    with int8_emulation(dev):
        for shared in (True, False):
            counts.append(0)
            st = _precision_student(dev, weights, precision, FORWARD_KL)
            st.shared_lora_inputs = shared
            st.set_adapter(lora)
            st.write_batch(batch)
            runs.append((st.loss_and_grads(), st.layout.pack(st.get_grads())))
    assert counts[1] - counts[0] == 6 * CFG.n_layers
    assert abs(runs[0][0] - runs[1][0]) <= 1e-5 * abs(runs[1][0])
    assert _rel(runs[0][1], runs[1][1]) <= 1e-5


@pytest.mark.parametrize("where", ["emulated", pytest.param("tensor cores", marks=pytest.mark.tensorcore)])
def test_int8_student_logits_alone(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """INT8_STUDENT_LOGITS: the student's logits on the integer GEMM (rotated), its backward dlogits . W on the
    other path: the step within INT8_REL of the float64 reference, its KD scratch without the integer backward's
    buffers, and the logits computed once (the one-pass backward; on tensor cores its P_c W_c over the decoded f16
    chunk). Lavapipe with the integer GEMMs emulated, and Dawn's tensor cores."""
    from contextlib import nullcontext

    from gpu.ops import head
    from gpu.ops.matmul_i8 import int8_emulation

    monkeypatch.setattr(head, "INT8_STUDENT_LOGITS", True)
    monkeypatch.setattr(head, "INT8_STUDENT_PROBS", False)  # P_c W_c on f16 (the probabilities' path: its own tests)
    calls = []
    real_logits = head.Int8Head.logits
    monkeypatch.setattr(head.Int8Head, "logits", lambda self, *a: calls.append(a[3]) or real_logits(self, *a))
    dev = device_or_skip() if where == "emulated" else tensor_core_device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    with int8_emulation(dev) if where == "emulated" else nullcontext():
        st = _precision_student(dev, ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0), "int8", loss_cfg, vocab_chunk=256)
        sc = st.objective.scratch
        assert sc.int8 is not None and sc.int8.dz is None and sc.int8.rot == 32
        assert (sc.w16 is not None) == (where != "emulated"), "tensor cores: the chunk decoded to f16 for P_c W_c"
        st.set_adapter(lora)
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
        loss = st.loss_and_grads()
        got = st.get_grads()
    assert calls == [0], "one chunk of 256 on the integer head (the last, 44 wide, on the other), its logits once"
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, tids, tlp, ttail, loss_cfg, 2.0)
    worst = max(max(_rel(got[k].A, da), _rel(got[k].B, db)) for k, (da, db) in want.items())
    print(f"{where} int8 logits: loss rel err {abs(loss - want_loss) / abs(want_loss):.2e}, worst grad {worst:.2e}")
    assert abs(loss - want_loss) / abs(want_loss) < INT8_REL
    assert worst < INT8_REL


def test_int8_head_decodes_a_chunk_with_its_kept_row_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The integer head decodes each vocab chunk's rows with their absmax once, as the student is built, and every
    step with the row scales kept from it (weight_to_i8 fixed_scales): loss and gradients bitwise those of a step
    decoding with the absmax (the scales not kept), twice in a row (emulated)."""
    from gpu.ops import head
    from gpu.ops.matmul_i8 import int8_emulation

    monkeypatch.setattr(head, "INT8_STUDENT_LOGITS", True)
    fixed, real_decode, real_keep = [], head.weight_to_i8, head.Int8Head.keep_row_scales
    monkeypatch.setattr(
        head, "weight_to_i8", lambda *a, **kw: fixed.append(kw.get("fixed_scales")) or real_decode(*a, **kw)
    )
    dev = device_or_skip()
    loss_cfg = LossConfig("forward_kl", tau=1.0, use_tail=True)
    w, lora, ids, targets, mask, rng = _problem(3, Q.Q4_0)
    tids, tlp, ttail = _teacher(rng, 1.0)
    runs = []
    with int8_emulation(dev):
        weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
        for keep in (True, False):
            keeper = real_keep if keep else (lambda *a: None)
            monkeypatch.setattr(head.Int8Head, "keep_row_scales", keeper)
            fixed.clear()
            st = _precision_student(dev, weights, "int8", loss_cfg, vocab_chunk=256)
            st.set_adapter(lora)
            st.write_batch(KdBatch(ids, targets, mask, tids, tlp, ttail))
            for _ in range(2):
                runs.append((st.loss_and_grads(), st.layout.pack(st.get_grads())))
            assert fixed == ([False, True] if keep else [False]), fixed  # one chunk of 256 on the integer head
    for loss, grads in runs[1:]:
        assert loss == runs[0][0]
        np.testing.assert_array_equal(grads, runs[0][1])


def _int8_teacher_vs_f32(dev) -> tuple[float, float]:
    """(worst top-k log-prob error relative to the max, top-1 agreement) of the int8 teacher against the f32 one
    on the same weights; vocab chunks of 256 put the first chunk on the integer head, the last (44) on the other."""
    from gpu.teacher import GPUTeacher

    w, _, ids, _, _, _ = _problem(7, Q.F32)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    got, want = (
        GPUTeacher(dev, weights, batch=B, seq_len=T, top_k=K, tau=1.0, precision=p, vocab_chunk=256).topk(ids)
        for p in ("int8", "f32")
    )
    err = float(np.abs(got[1] - want[1]).max() / np.abs(want[1]).max())
    top1 = float(np.mean(got[0][..., 0] == want[0][..., 0]))
    print(f"int8 teacher: top-k log-prob err {err:.2e} of max, top-1 agreement {top1:.3f}")
    return err, top1


@pytest.mark.tensorcore
def test_int8_teacher_topk_close() -> None:
    """The teacher's top-k with the frozen forward and the LM head on the integer tensor cores vs the f32 path
    (H200 only)."""
    err, top1 = _int8_teacher_vs_f32(tensor_core_device_or_skip())
    assert err < INT8_REL
    assert top1 > 0.9


def test_int8_teacher_topk_close_emulated() -> None:
    """The same on lavapipe with the integer GEMMs emulated (the rest f32): the int8 path's indexing and scales."""
    from gpu.ops.matmul_i8 import int8_emulation

    dev = device_or_skip()
    with int8_emulation(dev):
        err, top1 = _int8_teacher_vs_f32(dev)
    assert err < INT8_REL
    assert top1 > 0.9


def test_int8_resident_codes_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8_codes="resident" (every projection's codes decoded once, ModelWeights.codes_i8): the teacher's top-k and
    the student's step (recorded, then replayed; alone and with every recomputed block kept) bitwise those decoding
    one block at a time; models over the same weights share the codes (none decoded again); auto keeps them where
    they fit the reported memory, never where none is reported (lavapipe) unless they are there already."""
    from gpu.device import Device
    from gpu.ops.matmul_i8 import int8_emulation
    from gpu.teacher import GPUTeacher

    dev = device_or_skip()
    w, lora, batch = _kd_problem(7, Q.Q4_0)
    ids = batch.ids
    spec = EngineSpec(CFG, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, precision="int8")

    def teacher(weights: ModelWeights, codes: str, seq_len: int = T) -> GPUTeacher:
        return GPUTeacher(dev, weights, batch=B, seq_len=seq_len, top_k=K, tau=1.0, precision="int8", vocab_chunk=256,
                          int8_codes=codes)  # fmt: skip

    def steps(weights: ModelWeights, codes: str, kept: int) -> tuple[GPUStudent, list]:
        st = GPUStudent(dev, weights, spec, GpuKd(FORWARD_KL, K), kept_blocks=kept, int8_codes=codes)
        st.set_adapter(lora)
        st.write_batch(batch)
        return st, [(st.loss_and_grads(), st.layout.pack(st.get_grads())) for _ in range(2)]

    with int8_emulation(dev):
        weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
        plain = teacher(weights, "per_block")
        assert not plain.resident_codes and not weights.codes_i8
        with monkeypatch.context() as none_reported:  # as on lavapipe (Dawn on a GPU reports its memory)
            none_reported.setattr(Device, "memory_bytes", lambda d: None)
            assert not teacher(weights, "auto").resident_codes
        want_topk = plain.topk(ids)
        _, want_steps = steps(weights, "per_block", 0)
        assert not weights.codes_i8
        kept = teacher(weights, "resident")
        assert kept.resident_codes and len(weights.codes_i8) == CFG.n_layers * len(LORA_TARGETS)
        codes = dict(weights.codes_i8)
        for got in (kept.topk(ids), kept.topk(ids)):
            for g, wnt in zip(got, want_topk, strict=True):
                np.testing.assert_array_equal(g, wnt)
        for n_kept in (0, 99):
            st, got_steps = steps(weights, "resident", n_kept)
            assert st.resident_codes and weights.codes_i8 == codes
            for (loss, grads), (want_loss, want_grads) in zip(got_steps, want_steps * 2, strict=False):
                assert loss == want_loss
                np.testing.assert_array_equal(grads, want_grads)
        assert teacher(weights, "auto", seq_len=T // 2).resident_codes  # already there: nothing to fit
        assert weights.codes_i8 == codes
        fresh = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
        need = sum(p.shape[0] * (p.shape[1] + 4) for p in fresh.proj.values())
        for room, resident in ((need + (1 << 20), True), (need - (1 << 20), False)):
            fresh.codes_i8.clear()
            monkeypatch.setattr(
                Device, "memory_bytes", lambda d, room=room: int((d.live_bytes + RESERVE + room) / SHARE)
            )
            assert teacher(fresh, "auto").resident_codes == resident, room
        with pytest.raises(ValueError, match="int8_codes='yes'"):
            teacher(weights, "yes")


def _sampled_teacher(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sampled store's batch columns: per position 1..n distinct ids (ascending) whose counts sum to n, padded
    with id 0 / count 0, and the stored log-probs of the ids."""
    tids, counts = np.zeros((B, T, n), np.int64), np.zeros((B, T, n), np.uint8)
    for b in range(B):
        for t in range(T):
            d = int(rng.integers(1, n + 1))
            tids[b, t, :d] = np.sort(rng.choice(CFG.vocab, d, replace=False))
            counts[b, t, :d] = rng.multinomial(n - d, np.full(d, 1.0 / d)) + 1
    return tids, -rng.uniform(0.05, 9.0, (B, T, n)).astype(np.float32), counts


def test_sampled_store_step_matches_reference() -> None:
    """The sampled store's KD estimate (with a CE mix, tau 1.5) on the GPU's f32 path, run as forward KL against
    c / n with a zero tail plus the loss shift: loss and every LoRA gradient within REL of the float64 reference's
    estimator (model/kd.py); a second micro-batch's loss gets its own shift (gradient accumulation)."""
    dev = device_or_skip()
    n = 12
    loss_cfg = LossConfig("forward_kl", tau=1.5, ce_weight=0.25, samples=n)
    w, lora, ids, targets, mask, rng = _problem(5, Q.Q4_0)
    tids, tlp, counts = _sampled_teacher(rng, n)
    spec = EngineSpec(CFG, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, grad_accum=2)
    st = GPUStudent(dev, ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0), spec, GpuKd(loss_cfg, n))
    st.set_adapter(lora)
    w64 = {name: a.astype(np.float64) for name, a in w.items()}
    l64 = {k: reference.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in lora.items()}
    want = []
    for micro, flip in enumerate((False, True)):  # the second micro-batch: the teacher columns of other rows
        cols = (tids[::-1], tlp[::-1], counts[::-1]) if flip else (tids, tlp, counts)
        st.write_batch(KdBatch(ids, targets, mask, cols[0], cols[1], None, teacher_counts=cols[2]))
        st.accumulate(micro)
        want.append(
            reference.loss_and_grads(
                w64,
                CFG,
                ids,
                l64,
                2.0,
                cols[0],
                cols[1].astype(np.float64),
                None,
                targets,
                mask,
                loss_cfg,
                teacher_counts=cols[2],
            )  # fmt: skip
        )
        got_loss = st.objective.micro_loss(micro)
        assert abs(got_loss - want[-1][0]) <= REL * abs(want[-1][0]), (micro, got_loss, want[-1][0])
    got = st.get_grads()
    worst = 0.0
    for key, g in got.items():
        da = want[0][1][key][0] + want[1][1][key][0]
        db = want[0][1][key][1] + want[1][1][key][1]
        worst = max(worst, _rel(g.A, da), _rel(g.B, db))
    print(f"sampled store on the GPU: worst LoRA gradient rel err {worst:.1e}")
    assert worst < REL


def test_int8_products_from_codes_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient accumulation over the int8 step with every LoRA product from codes (t, dt, dB, dA: the defaults) and
    the f32 inputs unwritten: two micro-batches of the same batch give twice one's gradients (within 1e-5: dA's
    rotated rows added by hadamard_rows back_add, dB's by the finish pass; the KD head's stochastic rounding draws
    per micro-batch within that), plain and mergeable (dA through its group sums)."""

    from gpu.ops import lora_da_i8, lora_db_i8, lora_i8
    from gpu.ops.matmul_i8 import int8_emulation

    wide = _thin_shapes(monkeypatch)  # 64 rows: whole chunks of the sums over rows
    for module, switch in (
        (lora_i8, "THIN_I8"),
        (lora_i8, "THIN_DT"),
        (lora_db_i8, "THIN_DB"),
        (lora_da_i8, "THIN_DA"),
    ):
        monkeypatch.setattr(module, switch, True)
    dev = device_or_skip()
    w, lora, ids, targets, mask, rng = _problem(5, Q.Q4_0)
    teacher = _teacher(rng, 1.0)
    batch = KdBatch(ids, targets, mask, *teacher)
    weights = ModelWeights.from_arrays(dev, wide, w, Q.Q4_0)
    for group in (0, 32):
        grads: dict[int, dict] = {}
        for accum in (1, 2):
            spec = EngineSpec(wide, targets=LORA_TARGETS, r=16, alpha=32, batch=B, seq_len=32, precision="int8",
                              vocab_chunk=256, grad_accum=accum, lora_group=group)  # fmt: skip
            with int8_emulation(dev):
                st = GPUStudent(dev, weights, spec, GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=True), K))
                st.set_adapter(_group_constant(lora, group))
                for micro in range(accum):
                    st.write_batch(batch)
                    st.accumulate(micro)
                assert st.input_codes is not None and st.input_codes.layers
                grads[accum] = st.get_grads()
        for key, g in grads[2].items():
            assert _rel(g.A, 2 * grads[1][key].A) < 1e-5, (group, key)
            assert _rel(g.B, 2 * grads[1][key].B) < 1e-5, (group, key)


def _group_constant(adapter: dict, group: int) -> dict:
    """The adapter with each A's rows averaged over groups of `group` inputs (0: as it is): a mergeable adapter."""
    if not group:
        return adapter
    out = {}
    for key, pair in adapter.items():
        a = np.asarray(pair.A)
        mean = a.reshape(a.shape[0], -1, group).mean(-1, keepdims=True)
        out[key] = reference.LoraPair(
            np.broadcast_to(mean, (*mean.shape[:2], group)).reshape(a.shape).astype(np.float32), pair.B
        )
    return out


def test_int8_products_from_codes_beside_kept_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept block (train.kept_blocks) takes its adapters' dA from f32 x (its backward follows no recompute that
    would write its inputs' codes); the others from the kept codes: the step within INT8_REL of the float64 reference
    (loss) and 3 INT8_REL (gradients), as with no block kept."""
    import dataclasses
    import sys

    from gpu.ops.matmul_i8 import int8_emulation

    wide = dataclasses.replace(CFG, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=3)
    monkeypatch.setattr(sys.modules[__name__], "CFG", wide)
    monkeypatch.setattr(sys.modules[__name__], "R", 16)
    monkeypatch.setattr(sys.modules[__name__], "T", 32)
    dev = device_or_skip()
    w, lora, ids, targets, mask, rng = _problem(7, Q.Q4_0)
    teacher = _teacher(rng, 1.0)
    weights = ModelWeights.from_arrays(dev, wide, w, Q.Q4_0)
    want_loss, want = _reference_batch(w, lora, ids, targets, mask, *teacher, FORWARD_KL, 2.0)
    spec = EngineSpec(
        wide, targets=LORA_TARGETS, r=16, alpha=32, batch=B, seq_len=32, precision="int8", vocab_chunk=256
    )
    for kept in (0, 1):
        with int8_emulation(dev):
            st = GPUStudent(dev, weights, spec, GpuKd(FORWARD_KL, K), kept_blocks=kept)
            st.set_adapter(lora)
            st.write_batch(KdBatch(ids, targets, mask, *teacher))
            loss = st.loss_and_grads()
        assert st.input_codes is not None
        assert st.input_codes.layers == set(range(wide.n_layers)) - set(st._kept_layers())
        assert len(st._kept_layers()) == kept
        grads = st.get_grads()
        worst = max(max(_rel(grads[k].A, da), _rel(grads[k].B, db)) for k, (da, db) in want.items())
        assert abs(loss - want_loss) / abs(want_loss) < INT8_REL
        assert worst < 3 * INT8_REL, (kept, worst)
