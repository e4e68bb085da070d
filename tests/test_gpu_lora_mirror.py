"""The integer GEMM's LoRA operands without per-GEMM packing (gpu/ops/lora_mirror.py, gpu/ops/lora_matmul.py
HalfCopy): the f16 copy of a LoRA product written by lora_reduce (split) or lora_pack (not split) is bitwise the
t16 lora_term packs from the product; the mirrors' B16 and A R16 are bitwise lora_term's L16 of B and of A rotated
by hadamard_rows (and within f16 rounding of the float64 rotation); an int8 training step (integer GEMMs emulated)
with the mirrors is bitwise the one that packs per GEMM, without its lora_pack and A-rotation dispatches."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from gpu.device import BufferView, Device, DeviceError
from gpu.ops import lora_mirror
from gpu.ops.lora import lora_term
from gpu.ops.lora_matmul import ColumnGroups, HalfCopy, lora_matmul
from gpu.ops.lora_mirror import LoraMirrors
from gpu.ops.quantize_i8 import rotate_rows
from gpu.ops.strided_matmul import row_major, transposed
from model.config import LORA_TARGETS, ModelConfig
from model.int8 import hadamard_rows, rotation_block
from model.lora_layout import LoraLayout
from tests.gpu_fixtures import device_or_skip
from tests.gpu_helpers import random_student_problem, up

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev() -> Device:
    return device_or_skip()


def _f16(dev: Device, buf: object, n: int, offset: int = 0) -> np.ndarray:
    return dev.read(buf, np.float16, (n,), offset=offset)


@pytest.mark.parametrize("rows,d,splits", [(64, 256, None), (64, 256, 1), (48, 40, None)])
def test_half_copy_is_lora_terms_t16(dev: Device, rows: int, d: int, splits: int | None) -> None:
    """t = x A^T with its f16 copy (times the LoRA scale) from lora_reduce (split) or lora_pack (splits=1, or a
    reduction too short to split): bitwise lora_term's t16 of the same t, at a nonzero offset of the copy."""
    r, scale = 16, 0.37
    rng = np.random.default_rng(1)
    x, a = rng.standard_normal((rows, d)).astype(np.float32), rng.standard_normal((r, d)).astype(np.float32)
    xb, ab, t = up(dev, x), up(dev, a), dev.buffer(4 * rows * r)
    off = 256  # elements of other copies before this one
    t16 = dev.buffer(2 * (off + rows * r))
    half = HalfCopy(t16, (off,), r, scale)
    lora_matmul(dev, row_major(xb, d), transposed(ab, d), t, rows, r, d, splits=splits, half=half)
    got = _f16(dev, t16, rows * r, offset=2 * off)
    packed = lora_term(dev, t, ab, rows, d, r, scale, "cols", dev.buffer(2 * rows * r), dev.buffer(2 * d * r))
    want = _f16(dev, packed.t16, rows * r)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    ref = ((x.astype(np.float64) @ a.T.astype(np.float64)) * scale).reshape(-1)
    assert np.abs(got.astype(np.float64) - ref).max() <= 2e-3 * np.abs(ref).max()


@pytest.mark.parametrize("splits", [None, 1])
def test_half_copy_of_column_groups(dev: Device, splits: int | None) -> None:
    """The shared-input product (three adapters' t in one lora_matmul, column groups): each group's f16 copy at its
    own offset, bitwise lora_term's t16 of that group's t."""
    rows, d, r, scale = 32, 128, 16, 2.0
    rng = np.random.default_rng(2)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    a = rng.standard_normal((3 * r, d)).astype(np.float32)  # three A's back to back
    xb, ab = up(dev, x), up(dev, a)
    slot = 1024  # floats per t slot
    t = dev.buffer(4 * 3 * slot)
    t16 = dev.buffer(2 * 3 * slot)
    groups = ColumnGroups(r, (0, r * d, 2 * r * d), (0, slot, 2 * slot))
    half = HalfCopy(t16, (2 * slot, 0, slot), r, scale)  # the copies in another order than the t's
    lora_matmul(dev, row_major(xb, d), transposed(ab, d), t, rows, 3 * r, d, csm=r, groups=groups, splits=splits,
                half=half)  # fmt: skip
    for g, h_off in enumerate(half.offsets):
        got = _f16(dev, t16, rows * r, offset=2 * h_off)
        tg = BufferView(t, 4 * g * slot, 4 * rows * r)
        packed = lora_term(dev, tg, ab, rows, d, r, scale, "cols", dev.buffer(2 * rows * r), dev.buffer(2 * d * r))
        np.testing.assert_array_equal(got.view(np.uint16), _f16(dev, packed.t16, rows * r).view(np.uint16))


def test_half_copy_refuses_layouts_it_cannot_copy(dev: Device) -> None:
    """A copy of C that is not row-major per group, or too small for it: a DeviceError, nothing dispatched."""
    a, b, c = dev.buffer(4 * 64 * 64), dev.buffer(4 * 64 * 16), dev.buffer(4 * 64 * 64)
    with pytest.raises(DeviceError, match="row-major"):
        lora_matmul(dev, row_major(a, 64), row_major(b, 16), c, 64, 16, 64, csm=1, csn=64,
                    half=HalfCopy(dev.buffer(4096), (0,), 16, 1.0))  # fmt: skip
    with pytest.raises(DeviceError, match="exceeds"):
        lora_matmul(
            dev, row_major(a, 64), row_major(b, 16), c, 64, 16, 64, half=HalfCopy(dev.buffer(64), (0,), 16, 1.0)
        )


CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)


def test_mirrors_are_lora_terms_operands(dev: Device) -> None:
    """LoraMirrors over a two-block adapter on every target, rank 16 (widths 32 and 64: rotation blocks 32 and 64,
    two dispatches): B16 bitwise lora_term's L16 of B ("rows"), A R16 bitwise its L16 of A rotated by rotate_rows
    ("cols"), and A R16 within f16 rounding of model/int8.py's float64 rotation; refresh rewrites them."""
    r = 16
    layout = LoraLayout.build(CFG, LORA_TARGETS, r, None)
    rng = np.random.default_rng(3)
    flat = rng.standard_normal(layout.n_params).astype(np.float32)
    params = up(dev, flat)
    mirrors = LoraMirrors(dev, layout.slots, r, rotation_block)
    mirrors.refresh(dev, params)
    for key, s in layout.slots.items():
        b = BufferView(params, 4 * s.b_off, 4 * s.d_out * r)
        a = BufferView(params, 4 * s.a_off, 4 * r * s.d_in)
        got_b = _f16(dev, mirrors.b16(key).buffer, s.d_out * r, offset=mirrors.b16(key).offset)
        scratch = dev.buffer(2 * 16 * r), dev.buffer(2 * max(s.d_in, s.d_out) * r)
        want_b = lora_term(dev, dev.buffer(4 * 16 * r), b, 16, s.d_out, r, 1.0, "rows", *scratch).l16
        np.testing.assert_array_equal(got_b.view(np.uint16), _f16(dev, want_b, s.d_out * r).view(np.uint16), str(key))
        rot = rotation_block(s.d_in)
        a_rot = dev.buffer(4 * r * s.d_in)
        rotate_rows(dev, a, r, s.d_in, rot, out=a_rot, forward=True)
        want_a = lora_term(dev, dev.buffer(4 * 16 * r), a_rot, 16, s.d_in, r, 1.0, "cols", *scratch).l16
        got_a = _f16(dev, mirrors.a16(key).buffer, r * s.d_in, offset=mirrors.a16(key).offset)
        np.testing.assert_array_equal(got_a.view(np.uint16), _f16(dev, want_a, r * s.d_in).view(np.uint16), str(key))
        ref = hadamard_rows(flat[s.a_off : s.a_off + r * s.d_in].reshape(r, s.d_in), rot).reshape(-1)
        assert np.abs(got_a.astype(np.float32) - ref).max() <= 1e-3 * np.abs(ref).max(), key
    dev.write(params, np.zeros_like(flat))
    mirrors.refresh(dev, params)
    key = next(iter(layout.slots))
    assert not _f16(dev, mirrors.a16(key).buffer, 16, offset=mirrors.a16(key).offset).any()


def test_mirrors_refuse_ranks_they_do_not_cover(dev: Device) -> None:
    """Ranks that are no multiple of 16 keep the per-GEMM packing (mirrors_cover), and LoraMirrors refuses them."""
    layout = LoraLayout.build(CFG, LORA_TARGETS, 8, None)
    assert not lora_mirror.mirrors_cover(8) and lora_mirror.mirrors_cover(32)
    with pytest.raises(DeviceError, match="multiple of 16"):
        LoraMirrors(dev, layout.slots, 8)


@contextlib.contextmanager
def _counted(monkeypatch: pytest.MonkeyPatch, modules: tuple, counts: Counter) -> Iterator[None]:
    """Count the pipelines (module, name, mode) the given op modules ask for within the block."""
    with monkeypatch.context() as m:
        for module in modules:
            real = module.pipeline

            def spy(
                dev: object, name: str, _real: object = real, _mod: str = module.__name__, **variant: object
            ) -> object:
                counts[(_mod.rsplit(".", 1)[-1], name, variant.get("mode", ""))] += 1
                return _real(dev, name, **variant)

            m.setattr(module, "pipeline", spy)
        yield


def test_int8_step_with_mirrors_is_bitwise_the_packed_one(monkeypatch: pytest.MonkeyPatch, dev: Device) -> None:
    """An int8 KD step at rank 16 (integer GEMMs emulated, the LoRA terms in their epilogues), recorded then
    replayed: with the mirrors (the default) bitwise the loss and gradients of the per-GEMM packing, with no
    lora_term packing and no A rotation (hadamard_rows "forward") dispatched, and one lora_mirror per rotation
    block."""
    from gguf import GGMLQuantizationType as Q

    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd
    from gpu.ops import lora as lora_ops
    from gpu.ops import lora_matmul as lm
    from gpu.ops import quantize_i8 as q8
    from gpu.ops.matmul_i8 import int8_emulation
    from gpu.student import GPUStudent
    from model.engine_spec import EngineSpec, KdBatch
    from model.kd import LossConfig
    from tests.test_gpu_student import _teacher

    r, batch, seq = 16, 2, 16
    w, lora, ids, targets, mask, rng = random_student_problem(CFG, 5, Q.Q4_0, r, batch, seq)
    kd = KdBatch(ids, targets, mask, *_teacher(rng, 1.0))
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    spec = EngineSpec(CFG, targets=LORA_TARGETS, r=r, alpha=2 * r, batch=batch, seq_len=seq, precision="int8",
                      vocab_chunk=256)  # fmt: skip
    runs, counts = [], []
    for on in (True, False):
        monkeypatch.setattr(lora_mirror, "MIRRORS", on)
        counts.append(Counter())
        with int8_emulation(dev), _counted(monkeypatch, (lora_ops, lm, q8, lora_mirror), counts[-1]):
            st = GPUStudent(dev, weights, spec, GpuKd(LossConfig("forward_kl", tau=1.0, use_tail=True), 8))
            assert (st.mirrors is not None) == on
            st.set_adapter(lora)
            st.write_batch(kd)
            runs.append([(st.loss_and_grads(), st.layout.pack(st.get_grads())) for _ in range(2)])
    (on_loss, on_grads), (off_loss, off_grads) = runs[0][0], runs[1][0]
    assert np.isfinite(on_loss) and np.abs(on_grads).max() > 0
    assert on_loss == off_loss
    np.testing.assert_array_equal(on_grads, off_grads)
    assert runs[0][1][0] == on_loss  # the replayed step (its tape refreshes the mirrors)
    np.testing.assert_array_equal(runs[0][1][1], on_grads)
    packed, rotated = ("lora", "lora_pack", ""), ("quantize_i8", "hadamard_rows", "forward")
    assert counts[1][packed] > 0 and counts[1][rotated] > 0
    assert counts[0][packed] == 0 and counts[0][rotated] == 0  # (unsplit products copy t with lora_matmul's pack)
    assert counts[0][("lora_mirror", "lora_mirror", "")] == 2  # rotation blocks 32 and 64, the step recorded once


def test_forward_only_model_with_mirrors_is_bitwise_the_packed_one(
    monkeypatch: pytest.MonkeyPatch, dev: Device
) -> None:
    """A forward-only int8 model at rank 16 (one t per target, no A mirrors; integer GEMMs emulated): the residual
    stream after every block with the mirrors bitwise the one that packs per GEMM, and after set_adapter with other
    parameters the new ones' (the forward refreshes the mirrors), not the old ones'."""
    from gguf import GGMLQuantizationType as Q

    from gpu.model import GPUModel, ModelWeights
    from gpu.ops.matmul_i8 import int8_emulation

    r, batch, seq = 16, 2, 16
    w, lora, ids, *_ = random_student_problem(CFG, 6, Q.Q4_0, r, batch, seq)
    other = {k: type(p)(p.A * 0.5, p.B * -2.0) for k, p in lora.items()}
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    streams = []
    for on in (True, False):
        monkeypatch.setattr(lora_mirror, "MIRRORS", on)
        with int8_emulation(dev):
            model = GPUModel(dev, weights, batch=batch, seq_len=seq, targets=LORA_TARGETS, r=r, alpha=2 * r,
                             precision="int8")  # fmt: skip
            assert (model.mirrors is not None) == on
            model.set_adapter(lora)
            first = model.residual_stream(ids, CFG.n_layers)
            model.set_adapter(other)
            streams.append((first, model.residual_stream(ids, CFG.n_layers)))
    assert np.isfinite(streams[0][0]).all() and not np.array_equal(streams[0][0], streams[0][1])
    for got, want in zip(streams[0], streams[1], strict=True):
        np.testing.assert_array_equal(got, want)
