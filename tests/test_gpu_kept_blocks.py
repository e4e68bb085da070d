"""Kept blocks (gpu/kept_blocks.py, GPUStudent kept_blocks): blocks whose intermediates the forward keeps, so the
backward skips their recompute. On lavapipe: the step with kept blocks is bitwise the step that recomputes them
(f32 checkpoints) for llama, qwen3 (q/k norms), gemma3 (post-norms, sliding windows, a subset of adapted blocks),
padded attention slots and the emulated int8 path, recorded and replayed; with bf16 checkpoints within the
checkpoints' tolerance of float64; the buffers exist only once a backward runs, and cost what kept_block_bytes
says; the recompute stops before the down projection; auto keeps none where the device does not report its
memory, and as many as fit where it does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu.device import Device
from gpu.headroom import AUTO_SHARE, RESERVE_BYTES
from gpu.kept_blocks import kept_bytes_per_token, kept_count, kept_widths
from gpu.model import ModelWeights
from gpu.objectives import GpuKd
from gpu.student import GPUStudent
from model import reference as ref
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig, log_softmax
from tests.gpu_helpers import make_device, random_student_problem, rel_err

pytestmark = pytest.mark.gpu

LLAMA = ModelConfig(n_layers=4, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
QWEN3 = ModelConfig(
    n_layers=3, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=300, context_length=64,
    eps=1e-6, arch="qwen3", rope_type="neox", qk_norm=True, rope_base=100.0,
)  # fmt: skip
T, B, K, R = 16, 2, 8, 4
LOSS = LossConfig("forward_kl", tau=1.0, use_tail=True)
BF16_CKPT_REL = 1e-2  # as tests/test_gpu_student.py: the recompute starts from bf16-rounded block inputs


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _kd_problem(cfg: ModelConfig, seed: int, qtype: int) -> tuple[dict, dict, KdBatch]:
    """(weights, adapter, batch) of a random KD step on `cfg`."""
    w, lora, ids, targets, mask, rng = random_student_problem(cfg, seed, qtype, R, B, T)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, cfg.vocab)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    top = np.take_along_axis(lp, tids, -1)
    tail = np.clip(1 - np.exp(top).sum(-1), 0, None).astype(np.float32)
    return w, lora, KdBatch(ids, targets, mask, tids, top.astype(np.float32), tail)


def _student(
    dev: Device, weights: ModelWeights, spec: EngineSpec, kept: int | str, cls: type = GPUStudent, **kw: Any
) -> GPUStudent:
    return cls(dev, weights, spec, GpuKd(LOSS, K), kept_blocks=kept, **kw)


def _errors(w: dict, adapter: dict, batch: KdBatch, loss: float, grads: dict) -> tuple[float, float]:
    """(loss, worst LoRA gradient) relative errors of a LLAMA step against the float64 reference (the batch's
    loss the masked mean over its sequences)."""
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    a64 = {k: ref.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    n_total, want_loss, want = batch.mask.sum(), 0.0, {}
    for s in range(B):
        ls, gs = ref.loss_and_grads(
            w64, LLAMA, batch.ids[s], a64, 2.0, batch.teacher_ids[s], batch.teacher_logprobs[s].astype(np.float64),
            batch.teacher_tail[s].astype(np.float64), batch.targets[s], batch.mask[s], LOSS,
        )  # fmt: skip
        c = batch.mask[s].sum() / n_total
        want_loss += c * ls
        for key, (da, db) in gs.items():
            prev = want.get(key, (0.0, 0.0))
            want[key] = (prev[0] + c * da, prev[1] + c * db)
    worst = max(max(rel_err(grads[k].A, da), rel_err(grads[k].B, db)) for k, (da, db) in want.items())
    return abs(loss - want_loss) / abs(want_loss), worst


def _steps(st: GPUStudent, adapter: dict, batch: KdBatch, n: int = 2) -> list[tuple[float, np.ndarray]]:
    """n loss_and_grads of one batch (the first recorded, the rest replayed): (loss, packed gradients) each."""
    st.set_adapter(adapter)
    st.write_batch(batch)
    return [(st.loss_and_grads(), st.layout.pack(st.get_grads())) for _ in range(n)]


class _SlottedStudent(GPUStudent):
    def _sequences_aligned(self) -> bool:  # attention through padded per-sequence slots
        return False


def _llama(dev: Device, qtype: int = Q.Q4_0) -> tuple[ModelWeights, EngineSpec, dict, KdBatch]:
    w, lora, batch = _kd_problem(LLAMA, 3, qtype)
    spec = EngineSpec(LLAMA, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T)
    return ModelWeights.from_arrays(dev, LLAMA, w, qtype), spec, lora, batch


def _qwen3(dev: Device) -> tuple[ModelWeights, EngineSpec, dict, KdBatch]:
    w, lora, batch = _kd_problem(QWEN3, 4, Q.Q8_0)
    spec = EngineSpec(QWEN3, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T)
    return ModelWeights.from_arrays(dev, QWEN3, w, Q.Q8_0), spec, lora, batch


def _gemma3(dev: Device) -> tuple[ModelWeights, EngineSpec, dict, KdBatch]:
    from tests.test_gemma3 import CFG, LAYERS, RANK, SCALE, _adapter, _batch, _weights

    rng = np.random.default_rng(10)
    w = _weights(11)
    adapter, batch = _adapter(rng, LAYERS), _batch(rng)
    b, t = batch.ids.shape
    spec = EngineSpec(CFG, tuple(LORA_TARGETS), RANK, SCALE * RANK, b, t, layers=LAYERS, vocab_chunk=64)
    return ModelWeights.from_arrays(dev, CFG, w), spec, adapter, batch


CASES: dict[str, tuple[Callable[[Device], tuple], type]] = {
    "llama": (_llama, GPUStudent),
    "llama-slots": (_llama, _SlottedStudent),
    "qwen3": (_qwen3, GPUStudent),
    "gemma3": (_gemma3, GPUStudent),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_blocks_give_bitwise_the_recomputed_step(dev: Device, case: str) -> None:
    """Keeping none, one, or every recomputed block: bitwise the same loss and gradients, recorded and replayed;
    the kept count is clipped to the blocks a backward recomputes."""
    build, cls = CASES[case]
    weights, spec, adapter, batch = build(dev)
    runs = {}
    for kept in (0, 1, 99):
        st = _student(dev, weights, spec, kept, cls)
        recomputed = len(st._recomputed_blocks())
        assert recomputed >= 2 and st.kept_blocks == min(kept, recomputed)
        runs[kept] = _steps(st, adapter, batch)
        assert sorted(st._kept) == st._recomputed_blocks()[recomputed - st.kept_blocks :]
    (loss, grads), _ = runs[0]
    assert np.isfinite(loss) and np.abs(grads).max() > 0
    for kept, steps in runs.items():
        for got_loss, got_grads in steps:
            assert got_loss == loss, (kept, got_loss, loss)
            np.testing.assert_array_equal(got_grads, grads, err_msg=f"kept_blocks={kept}")


def test_kept_blocks_on_the_emulated_int8_path(dev: Device) -> None:
    """The int8 path (its integer GEMMs emulated on lavapipe, LoRA terms in their epilogues): kept blocks give
    bitwise the step that recomputes them."""
    from gpu.ops.matmul_i8 import int8_emulation

    weights, _, adapter, batch = _llama(dev)
    spec = EngineSpec(LLAMA, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, precision="int8")
    with int8_emulation(dev):
        runs = [_steps(_student(dev, weights, spec, kept), adapter, batch) for kept in (0, 99)]
    assert runs[0][0][0] == runs[1][0][0]
    np.testing.assert_array_equal(runs[0][0][1], runs[1][0][1])
    np.testing.assert_array_equal(runs[1][1][1], runs[1][0][1])


def test_kept_blocks_with_bf16_checkpoints_hold_the_tolerance(dev: Device) -> None:
    """checkpoints="bf16" with kept blocks: the kept blocks' backward reads the forward's f32 intermediates, the
    others a recompute from bf16-rounded inputs; every gradient within BF16_CKPT_REL of float64, the loss bitwise
    the f32 checkpoints' (the forward is the same)."""
    w, adapter, batch = _kd_problem(LLAMA, 3, Q.F32)
    weights = ModelWeights.from_arrays(dev, LLAMA, w)
    spec = EngineSpec(LLAMA, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T)
    f32_loss = _steps(_student(dev, weights, spec, 0), adapter, batch, 1)[0][0]
    st = _student(dev, weights, spec, 1, checkpoints="bf16")
    (loss, _), *_ = _steps(st, adapter, batch, 1)
    assert st.bf16_checkpoints and st.kept_blocks == 1 and loss == f32_loss
    _, worst = _errors(w, adapter, batch, loss, st.get_grads())
    print(f"bf16 checkpoints with a kept block: worst grad rel err {worst:.2e}")
    assert worst < BF16_CKPT_REL


def test_kept_buffers_come_with_the_first_backward(dev: Device) -> None:
    """An engine that only evaluates holds no kept buffers; the first backward allocates kept_block_bytes() per
    kept block (the widths of kept_widths and a log-sum-exp per head and token), once."""
    weights, spec, adapter, batch = _llama(dev)
    st = _student(dev, weights, spec, 2)
    st.set_adapter(adapter)
    st.write_batch(batch)
    st.evaluate_batch()
    assert st.kept_blocks == 2 and not st._kept
    st.loss_and_grads()
    st.loss_and_grads()
    assert len(st._kept) == 2
    own = {
        id(buf): buf.size for kept in st._kept.values() for name, buf in kept.items() if buf is not st._scratch[name]
    }
    assert sum(own.values()) == 2 * st.kept_block_bytes() and len(own) == 2 * (len(kept_widths(LLAMA)) + 1)
    per_row = 4 * sum(kept_widths(LLAMA).values())
    assert st.kept_block_bytes() == B * T * per_row + 4 * B * st.seq_lse
    assert kept_bytes_per_token(LLAMA) == per_row + 4 * LLAMA.n_heads


def test_the_recompute_stops_before_the_down_projection(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward recomputes a block only up to the down projection's input: one down GEMM per block a step (the
    forward's), where recomputing whole blocks would run one more per recomputed block."""
    weights, spec, adapter, batch = _llama(dev)
    st = _student(dev, weights, spec, 0)
    calls: list[tuple[int, str]] = []
    proj = GPUStudent._proj

    def counted(self: GPUStudent, x: Any, layer: int, target: str, *args: Any, **kw: Any) -> None:
        calls.append((layer, target))
        proj(self, x, layer, target, *args, **kw)

    monkeypatch.setattr(GPUStudent, "_proj", counted)
    _steps(st, adapter, batch, 1)
    downs = [layer for layer, target in calls if target == "down"]
    gates = [layer for layer, target in calls if target == "gate"]
    assert sorted(downs) == list(range(LLAMA.n_layers))
    assert len(gates) == LLAMA.n_layers + len(st._recomputed_blocks())


def test_auto_keeps_what_the_reported_memory_holds(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: none where the device does not report its memory (lavapipe through wgpu-native); where it does, as many
    blocks as fit after what the process holds and the reserve."""
    weights, spec, _, _ = _llama(dev)
    assert dev.memory_bytes() is None
    assert _student(dev, weights, spec, "auto").kept_blocks == 0
    block = _student(dev, weights, spec, 0).kept_block_bytes()

    def reports(blocks_of_room: float) -> None:  # a device with that many blocks free beyond what is held then
        memory = lambda d: int((d.live_bytes + RESERVE_BYTES + blocks_of_room * block) / AUTO_SHARE) + 1  # noqa: E731
        monkeypatch.setattr(Device, "memory_bytes", memory)

    for room, kept in ((2.5, 2), (0.9, 0), (-5.0, 0), (1000.0, 3)):
        reports(room)
        assert _student(dev, weights, spec, "auto").kept_blocks == kept, room


@pytest.mark.tensorcore
@pytest.mark.parametrize(("precision", "tol"), [("tensorcore", 2e-2), ("int8", 1e-1)])
def test_kept_blocks_on_tensor_cores(precision: str, tol: float) -> None:
    """On the tensor cores (bf16 checkpoints, f16 operands; int8 on the integer GEMMs too): every recomputed block
    kept, or none, each step within the precision's tolerance of the float64 reference (tests/test_gpu_student.py's
    TC_REL and INT8_REL), the kept buffers allocated."""
    from tests.gpu_fixtures import tensor_core_device_or_skip

    tc = tensor_core_device_or_skip()
    w, lora, batch = _kd_problem(LLAMA, 3, Q.Q4_0)
    weights = ModelWeights.from_arrays(tc, LLAMA, w, Q.Q4_0)
    spec = EngineSpec(LLAMA, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, precision=precision)
    for kept in (0, 99):
        st = _student(tc, weights, spec, kept)
        [(loss, _)] = _steps(st, lora, batch, 1)
        assert len(st._kept) == st.kept_blocks == (3 if kept else 0)
        loss_err, worst = _errors(w, lora, batch, loss, st.get_grads())
        print(f"{precision} kept {st.kept_blocks}: loss rel err {loss_err:.1e}, worst grad {worst:.1e}")
        assert loss_err < tol and worst < tol


def test_kept_count_rule() -> None:
    gib = 1 << 30
    assert kept_count(0, 31, gib, 80 * gib, 10 * gib) == 0
    assert kept_count(5, 31, gib, None, 0) == 5
    assert kept_count(99, 31, gib, None, 0) == 31
    assert kept_count("auto", 31, gib, None, 0) == 0
    free = int(80 * gib * AUTO_SHARE) - 10 * gib - RESERVE_BYTES
    assert kept_count("auto", 99, gib, 80 * gib, 10 * gib) == free // gib
    assert kept_count("auto", 31, gib, 80 * gib, 10 * gib) == 31
    assert kept_count("auto", 31, gib, 80 * gib, 10 * gib, share=0.5) == (int(40 * gib * AUTO_SHARE) - 12 * gib) // gib
    assert kept_count("auto", 31, gib, 8 * gib, 10 * gib) == 0
    for bad in (-1, "all", True, 1.5):
        with pytest.raises(ValueError, match="kept_blocks"):
            kept_count(bad, 31, gib, 80 * gib, 0)  # type: ignore[arg-type]
