"""gpu/registry.py lists every (kernel, variant) the model can dispatch; each one compiles.

- complete: a tiny student's training step, evaluation and the GPU teacher dispatch only registry members,
  and every gpu/kernels/*.wgsl file ends up in some generated kernel;
- within WebGPU's default limit of 8 storage buffers per shader stage (Dawn's Null backend enforces it);
- compiled on this adapter (lavapipe: shader module + compute pipeline) for every variant but the
  tensor-core ones, and by Tint (Dawn's Null backend: shader module, nothing runs) for all of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu.codegen import KERNEL_DIR
from gpu.codegen_i8 import matmul_i8_source
from gpu.codegen_tc import matmul_tc_source
from gpu.device import Device
from gpu.model import ModelWeights
from gpu.objectives import GpuKd
from gpu.ops.matmul import pick_tile
from gpu.ops.matmul_i8 import all_i8_variants
from gpu.ops.matmul_tc import pick_config
from gpu.registry import MATMUL_TILES, TC_TILES, entries, kernel_source
from gpu.student import GPUStudent
from gpu.teacher import GPUTeacher
from model import reference
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig, log_softmax
from schemas.optim import AdamWConfig
from tests.gpu_fixtures import device_or_skip

ROOT = Path(__file__).resolve().parents[1]
MAX_STORAGE_BUFFERS = 8  # WebGPU's default maxStorageBuffersPerShaderStage
ENTRIES = entries()
CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
T, B, K, R = 16, 2, 8, 4
# Files that only a generator option no preset takes reads (benches and the tensor-core tests use them).
OPTION_ONLY = {"matmul_tc_stage_v4.wgsl": "TCConfig(vec=4): 4-element staging units"}

# Compile every variant with Tint on Dawn's Null backend, in its own process (the backend is chosen by
# environment before Dawn starts); started by a fixture so that it runs while lavapipe compiles.
_TINT_SCRIPT = """
import json
from gpu.device import Device
from gpu.registry import entries
dev = Device(backend="dawn")
compiled, failed = 0, []
for e in entries():
    if e.compiler == "naga":
        continue
    try:
        dev.device.create_shader_module(code=e.source())
        compiled += 1
    except Exception as exc:
        failed.append(f"{e.key}: {str(exc)[-600:]}")
print(json.dumps({"adapter": dev.adapter.summary, "compiled": compiled, "failed": failed}))
"""


@pytest.fixture(scope="module", autouse=True)
def tint_run() -> Iterator[subprocess.Popen]:
    """The Tint compile (wgpudawn, a project dependency), started at the first test of this module."""
    env = dict(os.environ, WGPU_BACKEND_TYPE="Null", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", _TINT_SCRIPT]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _storage_bindings(source: str) -> int:
    return len(set(re.findall(r"@binding\((\d+)\)\s*var<storage", source)))


def test_registry_lists_each_variant_once() -> None:
    keys = [e.key for e in ENTRIES]
    assert len(keys) == len(set(keys))
    kinds = {e.key[0] for e in ENTRIES}
    assert {"matmul", "matmul_tc", "kd_row", "topk", "add"} <= kinds


def test_variants_outside_the_registry_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kernel 'topk' has no variant ns=3; gpu/registry.py lists \(2, 4"):
        kernel_source("topk", ns=3)
    with pytest.raises(ValueError, match=r"variant parameters \['kind'\], expected \['ce', 'kind', 'tail'\]"):
        kernel_source("kd_row", kind="jsd")
    with pytest.raises(ValueError, match="no kernel 'softmax'"):
        kernel_source("softmax")


def test_tile_presets_the_ops_pick_are_registered() -> None:
    """gemm() and gemm_tc() pick their tiles by shape and device: every pick is a registry preset."""
    shapes = [(m, p) for m in (1, 4, 5, 16, 17, 64, 300, 5000) for p in (64, 576, 4096, 49152)]
    for is_cpu in (True, False):
        for m, _ in shapes:
            assert pick_tile(SimpleNamespace(is_cpu=is_cpu), m) in MATMUL_TILES
    for m, p in shapes:
        assert pick_config(m, p) in TC_TILES


def test_every_kernel_file_is_used() -> None:
    """Each gpu/kernels/*.wgsl file's text (its longest part between ${...} placeholders) appears in a
    registry kernel, or in the emulated tensor-core kernels (gemm_tc / gemm_i8(emulate=True), the tests' path), or is
    one of OPTION_ONLY."""
    tc = next(e for e in ENTRIES if e.key[0] == "matmul_tc")
    emulated = [matmul_tc_source(tc.key[1], emulate=True), matmul_i8_source(all_i8_variants()[0], emulate=True)]
    sources = [e.source() for e in ENTRIES] + emulated
    unused = []
    for path in sorted(KERNEL_DIR.glob("*.wgsl")):
        if path.name in OPTION_ONLY:
            continue
        literal = max(re.split(r"\$\{\w+\}", path.read_text()), key=len).strip()
        if not any(literal in s for s in sources):
            unused.append(path.name)
    assert not unused, f"kernel files no registry variant uses: {unused}"


def test_within_default_storage_buffer_limit() -> None:
    counts = {e.key: _storage_bindings(e.source()) for e in ENTRIES}
    over = {key: n for key, n in counts.items() if n > MAX_STORAGE_BUFFERS}
    assert not over, f"kernels binding more than {MAX_STORAGE_BUFFERS} storage buffers: {over}"
    assert min(counts.values()) >= 1  # every kernel binds storage: the count sees the declarations


def _problem(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    ids = rng.integers(0, CFG.vocab, (B, T))
    targets = np.concatenate([ids[:, 1:], rng.integers(0, CFG.vocab, (B, 1))], axis=1)
    mask = (rng.random((B, T)) > 0.2).astype(np.uint8)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, CFG.vocab)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    tlp = np.take_along_axis(lp, tids, -1).astype(np.float32)
    tail = np.clip(1 - np.exp(tlp).sum(-1), 0, None).astype(np.float32)
    return ids, targets, mask, tids, tlp, tail


@pytest.mark.gpu
def test_model_dispatches_only_registry_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two accumulated micro-batches + an AdamW step, an evaluation batch and the GPU teacher: every pipeline
    they ask the device for is a registry entry."""
    dev = device_or_skip()
    asked: set = set()
    cached = dev.pipeline

    def recording(key: tuple, source_fn: Callable[[], str], *args: Any, **kwargs: Any) -> Any:
        asked.add(key)
        return cached(key, source_fn, *args, **kwargs)

    monkeypatch.setattr(dev, "pipeline", recording)
    rng = np.random.default_rng(0)
    w = reference.random_weights(CFG, 0, np.float32)
    ids, targets, mask, tids, tlp, tail = _problem(rng)
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q4_0)
    loss = LossConfig("jsd", tau=2.0, beta=0.3, ce_weight=0.25, use_tail=True)
    st = GPUStudent(
        dev,
        weights,
        EngineSpec(weights.cfg, targets=LORA_TARGETS, r=R, alpha=2 * R, batch=B, seq_len=T, grad_accum=2),
        GpuKd(loss, K),
        AdamWConfig(lr=1e-2),
    )
    for micro in range(2):
        st.write_batch(KdBatch(ids, targets, mask, tids, tlp, tail))
        st.accumulate(micro)
    assert not st.apply(lr=1e-2).skipped
    st.evaluate_batch()
    teacher = GPUTeacher(dev, weights, batch=B, seq_len=T, top_k=K, tau=1.5, vocab_chunk=128)
    teacher.topk(ids)
    teacher.sampled(ids, np.arange(B), 12, 3)

    registered = {e.key for e in ENTRIES}
    assert {k[0] for k in asked} >= {
        "matmul",
        "kd_row",
        "topk",
        "sample_draw",
        "rmsnorm_backward4",
        "adamw_update",
        "scale",
    }
    stray = sorted(map(str, asked - registered))
    assert not stray, f"dispatched kernels missing from gpu/registry.py: {stray[:5]}"


@pytest.mark.gpu
def test_every_variant_compiles_on_this_adapter() -> None:
    """Shader module + compute pipeline for every variant except Tint's (the tensor-core ones: Dawn only)."""
    dev: Device = device_or_skip()
    failed = []
    for e in ENTRIES:
        if e.compiler == "tint":
            continue
        try:
            dev.pipeline(e.key, e.source)
        except Exception as exc:  # collect every failure, then report
            failed.append(f"{e.key}: {str(exc)[-400:]}")
    assert not failed, f"{len(failed)} variants fail to compile on {dev.adapter.summary}:\n" + "\n".join(failed[:3])


def test_every_variant_compiles_in_tint(tint_run: subprocess.Popen) -> None:
    """Every variant, tensor-core ones included, through Dawn's WGSL compiler on its Null backend (but those in
    naga's dialect: the rotation kernels without `enable subgroups;`, which Tint compiles in their Tint variant)."""
    out, err = tint_run.communicate(timeout=600)
    if tint_run.returncode != 0 and "Dawn found no adapter" in err:
        pytest.skip(f"Dawn's Null backend is unavailable: {err[-300:]}")
    assert tint_run.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert "Null" in result["adapter"]
    assert not result["failed"], f"{len(result['failed'])} variants fail in Tint:\n" + "\n".join(result["failed"][:3])
    naga_only = [e for e in ENTRIES if e.compiler == "naga"]
    assert naga_only and result["compiled"] == len(ENTRIES) - len(naga_only)
