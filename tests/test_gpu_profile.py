"""gpu/profile.py on lavapipe: a profiled sequence of ops gives the same bytes as an unprofiled one, one timed
sample per dispatch grouped by kernel class (scopes override), and nothing is recorded once detached."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.ops.add import add, scale_inplace
from gpu.ops.gated import swiglu_forward
from gpu.ops.rmsnorm import rmsnorm_forward
from gpu.profile import Profiler, kernel_class, scope
from tests.gpu_fixtures import device_or_skip

pytestmark = pytest.mark.gpu

ROWS, H = 64, 128


def _ops(dev, bufs) -> None:
    x, w, y, z = bufs
    with dev.step():
        rmsnorm_forward(dev, x, w, y, ROWS, H, 1e-5)
        swiglu_forward(dev, x, y, z, ROWS * H)
        with scope(dev, "kd head"):
            add(dev, y, z, x, ROWS * H)
        scale_inplace(dev, x, 0.5, ROWS * H)


def test_profiled_ops_are_timed_by_class_and_unchanged() -> None:
    dev = device_or_skip()
    if "timestamp-query" not in dev.features:
        pytest.skip(f"{dev.adapter.summary} has no timestamp-query")
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(ROWS * H).astype(np.float32)
    outputs = []
    for profiled in (False, True):
        bufs = [dev.upload(x0), dev.upload(np.ones(H, np.float32))] + [dev.buffer(4 * ROWS * H) for _ in range(2)]
        if profiled:
            with Profiler(dev) as prof:
                _ops(dev, bufs)
        else:
            _ops(dev, bufs)
        outputs.append(dev.read(bufs[0], np.float32, (ROWS * H,)))
    assert outputs[0].tobytes() == outputs[1].tobytes()
    summary = prof.summary(steps=1)
    classes = summary["classes"]
    assert {c: v["dispatches"] for c, v in classes.items()} == {"norms": 1, "swiglu": 1, "kd head": 1, "other": 1}
    assert summary["dispatches_per_step"] == 4
    assert all(v["ms"] >= 0 for v in classes.values()) and summary["timed_ms_per_step"] > 0
    assert abs(sum(v["share"] for v in classes.values()) - 1) < 1e-3
    assert dev.profiler is None
    _ops(dev, bufs)  # detached: nothing more is recorded
    assert sum(prof.calls.values()) == 4


def test_kernel_classes() -> None:
    assert kernel_class("('matmul_tc', TCVariant(wtype='Q4_K', orient='nt'") == "fused-quant gemm"
    assert kernel_class("('matmul_tc', TCVariant(wtype='F16', orient='nn'") == "tc gemm"
    assert kernel_class("('matmul', MatmulVariant(wtype='F32'") == "f32 gemm"
    assert kernel_class("('matmul_i8', I8Variant(cfg=I8Config(sg_m=4") == "int8 gemm"
    assert kernel_class("('quantize_i8', ())") == "int8 gemm"
    assert kernel_class("('attention_backward_dkv', (('head_dim', 64),))") == "attention bwd"
    assert kernel_class("('attention_forward', (('head_dim', 64),))") == "attention fwd"
    assert kernel_class("('strided_matmul', ())") == "lora"
    assert kernel_class("('adamw_update', ())") == "adamw"
    assert kernel_class("('glu_i8', (('act', 'swiglu'),))") == kernel_class("('glu_back_i8', ())") == "swiglu"
    assert kernel_class("('rmsnorm_i8', (('rot', 128),))") == "norms"
    assert kernel_class("('kd_finish', (('ce', False),))") == kernel_class("('kd_rescaled_add', ())") == "kd head"
    assert kernel_class("('strided_matmul', ())", scope="kd head") == "kd head"


def test_profiled_by_grid_splits_a_kernel_by_its_grid() -> None:
    dev = device_or_skip()
    if "timestamp-query" not in dev.features:
        pytest.skip(f"{dev.adapter.summary} has no timestamp-query")
    x = dev.upload(np.ones(ROWS * H, np.float32))
    with Profiler(dev, by_grid=True) as prof, dev.step():
        scale_inplace(dev, x, 0.5, ROWS * H)
        scale_inplace(dev, x, 0.5, 64)
        scale_inplace(dev, x, 0.5, 64)
    labels = {label: prof.calls[(cls, label)] for cls, label in prof.calls}
    assert len(labels) == 2 and sorted(labels.values()) == [1, 2], labels
    assert all(label.startswith("grid=") and "x1x1 " in label for label in labels)
    assert np.allclose(dev.read(x, np.float32, (ROWS * H,))[:64], 0.125)
