"""The mergeable adapter (lora.kind mergeable, QA-LoRA with sum pooling): A constant over groups of inputs.

- the numpy reference: the projected dA is the gradient of A's group values, by central finite differences in
  float64 (a whole group of A moved at once); B A is constant over each group of a row;
- the numpy engine: its gradients are the reference's, a mergeable engine's dA is the projection of a plain one's
  (KD and DPO share the trunk), AdamW keeps A exactly group-constant, resume is bitwise;
- the GPU: lora_group_sum against numpy; GPUStudent against the numpy engine (relative 1e-4 in f32, lavapipe),
  with gradient accumulation, and A still group-constant after AdamW steps;
- the config: lora.kind, the group of 32 and the one-line refusal of an input size that is not a multiple.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cpu import NumpyEngine
from cpu.objectives import NumpyKd, NumpyPreference
from model import quant
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.dpo import DpoConfig
from model.engine_spec import EngineSpec, PairBatch
from model.kd import LossConfig
from schemas.config import MERGE_GROUP, load_config
from schemas.optim import AdamWConfig
from tests.gpu_fixtures import device_or_skip
from tests.test_numpy_engine import CFG, CHUNK, LAYERS, RANK, SCALE, B, K, T, _batch, _rel, _weights, _write
from tests.test_reference import STEP, _teacher, _tiny

GROUP = 16  # CFG: hidden 32 (2 groups per row), ffn 64 (4 groups)
LOSS = LossConfig("forward_kl", tau=1.0, use_tail=True)
GPU_REL = 1e-4


def _mergeable_adapter(cfg: ModelConfig, group: int, seed: int, layers=None, dtype=np.float32) -> dict:
    """init_lora with groups, B random (non-zero, so that dA is too)."""
    rng = np.random.default_rng(seed)
    init = R.init_lora(cfg, list(LORA_TARGETS), RANK, seed=seed, dtype=dtype, group=group)
    return {
        key: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(dtype))
        for key, p in init.items()
        if layers is None or key[0] in layers
    }


def _assert_group_constant(adapter: dict, group: int) -> None:
    for key, pair in adapter.items():
        R.check_group_constant(pair.A, group, str(key))


# ---------------------------------------------------------------- reference


def test_group_helpers() -> None:
    rng = np.random.default_rng(0)
    pooled = rng.standard_normal((3, 4))
    a = R.lora_group_expand(pooled, 8)
    assert a.shape == (3, 32)
    np.testing.assert_array_equal(R.lora_group_pool(a, 8), 8 * pooled)
    da = rng.standard_normal((3, 32))
    proj = R.lora_group_project(da, 8)
    R.check_group_constant(proj, 8, "projected")
    np.testing.assert_allclose(proj[:, 8], da[:, 8:16].sum(axis=1), rtol=1e-12)
    with pytest.raises(ValueError, match="not constant over groups of 8"):
        R.check_group_constant(da, 8, "random A")
    init = R.init_lora(_tiny(), ["q", "down"], 4, seed=3, group=8)
    _assert_group_constant(init, 8)
    plain = R.init_lora(_tiny(), ["q", "down"], 4, seed=3)
    for key, pair in init.items():  # the same Kaiming bound
        assert np.abs(pair.A).max() <= 1 / np.sqrt(pair.A.shape[1]) and pair.A.std() > 0.3 * plain[key].A.std()


def test_reference_projected_gradient_by_finite_differences() -> None:
    """Moving all g entries of one group of A by +-h changes the loss by 2h * (projected dA) at any entry of the
    group; B's gradient is the plain one; s B A is constant over each group of a row (it folds per block)."""
    group = 8
    cfg = _tiny(tied=False)
    w = R.random_weights(cfg, seed=3)
    rng = np.random.default_rng(4)
    t, k, s = 7, 8, 2.0
    ids = rng.integers(0, cfg.vocab, t)
    lora = _mergeable_adapter(cfg, group, seed=9, dtype=np.float64)
    tids, tlp = _teacher(rng, t, cfg.vocab, k, 1.0)
    targets = np.append(ids[1:], rng.integers(0, cfg.vocab))
    args = (tids, tlp, None, targets, np.ones(t, np.int64), LOSS)
    loss, grads = R.loss_and_grads(w, cfg, ids, lora, s, *args, lora_group=group)
    _, plain = R.loss_and_grads(w, cfg, ids, lora, s, *args)

    def f() -> float:
        return R.kd_loss_forward(R.forward(w, cfg, ids, lora, s), *args)

    assert f() == loss
    worst = 0.0
    for key, pair in lora.items():
        da, db = grads[key]
        np.testing.assert_array_equal(db, plain[key][1])
        np.testing.assert_allclose(da, R.lora_group_project(plain[key][0], group), rtol=1e-12, atol=1e-15)
        R.check_group_constant(da, group, f"dA {key}")
        fd, an = [], []
        for i in rng.choice(pair.A.size // group, size=6, replace=False):
            row, g0 = divmod(int(i) * group, pair.A.shape[1])
            old = pair.A[row, g0 : g0 + group].copy()
            pair.A[row, g0 : g0 + group] = old + STEP
            fp = f()
            pair.A[row, g0 : g0 + group] = old - STEP
            fm = f()
            pair.A[row, g0 : g0 + group] = old
            fd.append((fp - fm) / (2 * STEP))
            an.append(da[row, g0 + int(rng.integers(group))])
        fd, an = np.array(fd), np.array(an)
        assert np.abs(fd).max() > 1e-8
        err = float(np.abs(fd - an).max() / np.abs(fd).max())
        assert err < 1e-6, (key, err)
        worst = max(worst, err)
        delta = s * pair.B @ pair.A
        R.check_group_constant(delta, group, f"delta W {key}")
    print(f"mergeable reference: max FD rel error {worst:.2e}")


# ---------------------------------------------------------------- numpy engine


def _engine(w, objective=None, **kw) -> NumpyEngine:
    spec = EngineSpec(CFG, **{"targets": LORA_TARGETS, "r": RANK, "alpha": SCALE * RANK, "batch": B, "seq_len": T,
                              "layers": LAYERS, "vocab_chunk": CHUNK, **kw})  # fmt: skip
    optim = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)
    return NumpyEngine(w, spec, objective or NumpyKd(LOSS, K), optim)


def test_numpy_engine_gradients_and_steps() -> None:
    """A mergeable engine's grads are the float64 reference's projected ones and the projection of a plain
    engine's; four AdamW steps (clipping and weight decay active) leave A exactly group-constant."""
    rng = np.random.default_rng(11)
    w = _weights(11)
    adapter, batch = _mergeable_adapter(CFG, GROUP, 12, LAYERS), _batch(rng, 1.0)
    merge, plain = _engine(w, lora_group=GROUP), _engine(w)
    for st in (merge, plain):
        st.set_adapter(adapter)
        _write(st, batch, LOSS)
    assert merge.loss_and_grads() == plain.loss_and_grads()
    got, base = merge.get_grads(), plain.get_grads()
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    lora64 = {key: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for key, p in adapter.items()}
    ids, targets, mask, tids, tlp, tail = batch
    _, want = R.loss_and_grads(w64, CFG, ids, lora64, SCALE, tids, tlp, tail, targets, mask, LOSS, lora_group=GROUP)
    for key, pair in got.items():
        R.check_group_constant(pair.A, GROUP, f"dA {key}")
        np.testing.assert_array_equal(pair.A, R.lora_group_project(base[key].A, GROUP))
        assert _rel(pair.A, want[key][0]) < 2e-5 and _rel(pair.B, want[key][1]) < 2e-5
    for _ in range(4):
        stats = merge.train_step(lr=1e-2)
        assert stats.clip_scale < 1 and not stats.skipped
    after = merge.get_adapter()
    _assert_group_constant(after, GROUP)
    assert any(not np.array_equal(after[k].A, adapter[k].A) for k in adapter)
    with pytest.raises(ValueError, match="not constant over groups of 16"):
        noisy = after[(1, "q")].A + rng.normal(0, 1e-3, (RANK, 32)).astype(np.float32)
        merge.set_adapter({**after, (1, "q"): R.LoraPair(noisy, after[(1, "q")].B)})


def test_numpy_engine_resume_is_bitwise() -> None:
    """Four mergeable steps in one run == two, a checkpoint, a fresh engine, two more (bytes of A, B, m, v)."""
    rng = np.random.default_rng(13)
    w = _weights(13)
    adapter = _mergeable_adapter(CFG, GROUP, 14, LAYERS)
    batches = [_batch(rng, 1.0) for _ in range(4)]

    def run(st: NumpyEngine, steps: range) -> None:
        for s in steps:
            _write(st, batches[s], LOSS)
            st.train_step(lr=1e-2)

    whole = _engine(w, lora_group=GROUP)
    whole.set_adapter(adapter)
    run(whole, range(4))
    first = _engine(w, lora_group=GROUP)
    first.set_adapter(adapter)
    run(first, range(2))
    second = _engine(w, lora_group=GROUP)
    second.set_adapter(first.get_adapter())
    second.load_optimizer_state(first.optimizer_state(), first.applied_steps)
    run(second, range(2, 4))
    assert second.params.tobytes() == whole.params.tobytes()
    for name in ("m", "v"):
        assert second.optimizer_state()[name].tobytes() == whole.optimizer_state()[name].tobytes()


def _pairs(seed: int) -> PairBatch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab, (B, T))
    ids[1, :4] = ids[0, :4]
    mask = np.zeros((B, T), np.uint8)
    mask[0, 3:9], mask[1, 3:12] = 1, 1
    return PairBatch(ids, mask, -25 + 3 * rng.standard_normal(B))


def test_dpo_shares_the_projection() -> None:
    """The preference objective on the same trunk: a mergeable engine's dA is the projection of a plain one's."""
    w = _weights(15)
    adapter = _mergeable_adapter(CFG, GROUP, 16, LAYERS)
    engines = [_engine(w, NumpyPreference(DpoConfig(beta=0.5)), **kw) for kw in ({"lora_group": GROUP}, {})]
    for st in engines:
        st.set_adapter(adapter)
        st.write_batch(_pairs(17))
        st.loss_and_grads()
    got, base = engines[0].get_grads(), engines[1].get_grads()
    assert any(np.abs(p.A).max() > 0 for p in base.values())
    for key, pair in got.items():
        np.testing.assert_array_equal(pair.A, R.lora_group_project(base[key].A, GROUP))
        np.testing.assert_array_equal(pair.B, base[key].B)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_gpu_lora_group_sum(accumulate: bool) -> None:
    from gpu.ops.lora import lora_group_sum

    dev = device_or_skip()
    rng = np.random.default_rng(18)
    x, y0 = rng.standard_normal((2, 5, 96)).astype(np.float32)
    xb, yb = dev.upload(x), dev.upload(y0)
    lora_group_sum(dev, xb, yb, x.size, 32, accumulate=accumulate)
    got = dev.read(yb, np.float32, x.shape)
    want = R.lora_group_project(x.astype(np.float64), 32) + (y0 if accumulate else 0)
    assert _rel(got, want) < GPU_REL
    if not accumulate:
        R.check_group_constant(got, 32, "group sums")


def _gpu(dev, w, objective=None, **kw):
    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd
    from gpu.student import GPUStudent

    spec = EngineSpec(CFG, **{"targets": LORA_TARGETS, "r": RANK, "alpha": SCALE * RANK, "batch": B, "seq_len": T,
                              "layers": LAYERS, **kw})  # fmt: skip
    optim = AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)
    return GPUStudent(dev, ModelWeights.from_arrays(dev, CFG, w, Q.Q8_0), spec, objective or GpuKd(LOSS, K), optim)


@pytest.mark.gpu
def test_gpu_student_matches_numpy_engine() -> None:
    """Two accumulated micro-batches then three AdamW steps: gradients, losses and the updated A within
    relative 1e-4 (f32) of the numpy engine's, and A exactly group-constant on the GPU after the steps."""
    dev = device_or_skip()
    rng = np.random.default_rng(19)
    w = _weights(19)
    adapter = _mergeable_adapter(CFG, GROUP, 20, LAYERS)
    micro = [_batch(rng, 1.0) for _ in range(2)]
    cpu, gpu = _engine(w, lora_group=GROUP, grad_accum=2), _gpu(dev, w, lora_group=GROUP, grad_accum=2)
    grads, stats = [], []
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        for step in range(3):
            for i, batch in enumerate(micro):
                _write(st, batch, LOSS)
                st.accumulate(i)
            if step == 0:
                grads.append(st.get_grads())
            stats.append(st.apply(lr=1e-2))
    for key, pair in grads[1].items():
        R.check_group_constant(pair.A, GROUP, f"GPU dA {key}")
        assert _rel(grads[0][key].A, pair.A) < GPU_REL and _rel(grads[0][key].B, pair.B) < GPU_REL
    for s_cpu, s_gpu in zip(stats[:3], stats[3:], strict=True):
        assert abs(s_cpu.loss - s_gpu.loss) < GPU_REL * abs(s_gpu.loss)
    after = gpu.get_adapter()
    _assert_group_constant(after, GROUP)
    start = cpu.layout.pack(adapter)
    assert _rel(cpu.layout.pack(cpu.get_adapter()) - start, cpu.layout.pack(after) - start) < 3e-3


@pytest.mark.gpu
def test_gpu_dpo_matches_numpy_engine() -> None:
    from gpu.objectives import GpuPreference

    dev = device_or_skip()
    w = _weights(21)
    adapter = _mergeable_adapter(CFG, GROUP, 22, LAYERS)
    c = DpoConfig(beta=0.5)
    cpu, gpu = _engine(w, NumpyPreference(c), lora_group=GROUP), _gpu(dev, w, GpuPreference(c), lora_group=GROUP)
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        st.write_batch(_pairs(23))
        st.loss_and_grads()
    want, got = cpu.get_grads(), gpu.get_grads()
    for key, pair in got.items():
        R.check_group_constant(pair.A, GROUP, f"GPU dA {key}")
        assert _rel(pair.A, want[key].A) < GPU_REL and _rel(pair.B, want[key].B) < GPU_REL


# ---------------------------------------------------------------- config


def test_config_and_spec(tmp_path) -> None:
    assert MERGE_GROUP == quant.QK == quant.codec(Q.Q4_0).block_size == quant.QK_K // 8
    base = ["model.student=s.gguf", "model.teacher=t.gguf", f"data.path={tmp_path}"]
    plain = load_config(None, base)
    assert plain.lora.kind == "plain" and plain.lora.group == 0
    cfg = load_config(None, [*base, "lora.kind=mergeable"])
    assert cfg.lora.group == 32
    wide = ModelConfig(n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, vocab=300)
    assert EngineSpec.from_run(cfg, wide, T).lora_group == 32
    odd = ModelConfig(n_layers=1, hidden=48, ffn=128, n_heads=4, n_kv_heads=2, vocab=300)
    with pytest.raises(ValueError, match="lora.kind mergeable: target 'q' has 48 inputs, not a multiple of"):
        EngineSpec.from_run(cfg, odd, T)
    with pytest.raises(Exception, match="lora.kind"):
        load_config(None, [*base, "lora.kind=qalora"])


@pytest.mark.tensorcore
def test_tensorcore_student_projects_da() -> None:
    """precision tensorcore (f16 operands in the frozen GEMMs; LoRA's products and the projection stay f32): dA is
    group-constant and within the tensor-core tolerance of the numpy engine's. Runs on the H200 only."""
    from tests.gpu_fixtures import tensor_core_device_or_skip

    dev = tensor_core_device_or_skip()
    rng = np.random.default_rng(24)
    w = _weights(24)
    adapter, batch = _mergeable_adapter(CFG, GROUP, 25, LAYERS), _batch(rng, 1.0)
    cpu, gpu = _engine(w, lora_group=GROUP), _gpu(dev, w, lora_group=GROUP, precision="tensorcore")
    for st in (cpu, gpu):
        st.set_adapter(adapter)
        _write(st, batch, LOSS)
        st.loss_and_grads()
    want, got = cpu.get_grads(), gpu.get_grads()
    for key, pair in got.items():
        R.check_group_constant(pair.A, GROUP, f"tensor-core dA {key}")
        assert _rel(pair.A, want[key].A) < 2e-2 and _rel(pair.B, want[key].B) < 2e-2


# ---------------------------------------------------------------- the stages


def test_stages_train_resume_fold_and_evaluate(tmp_path) -> None:
    """lora.kind mergeable through the stages on the tiny model (Q4_0 student): the initial and trained A are
    group-constant, a run interrupted after a checkpoint resumes to the same adapter bytes, the export folds
    (Q4_0 -> Q4_1) and the merged GGUF evaluates like the adapter."""
    import stages.evaluate
    import stages.export
    import stages.student
    import stages.teacher
    import stages.tokenize
    import stages.train
    from data.checkpoint import load_checkpoint
    from model.gguf import GGUFFile
    from schemas.config import RunConfig
    from tests.pipeline_fixtures import tiny_config

    device_or_skip()

    def chain(root):
        cfg = RunConfig.model_validate(tiny_config(root, lora={"kind": "mergeable"}, train={"epochs": 1}))
        tokens = stages.tokenize.run(cfg)
        return cfg, tokens, stages.student.run(cfg), stages.teacher.run(cfg, tokens)

    cfg, tokens, student, teacher = chain(tmp_path / "a")
    whole = stages.train.run(cfg, student, tokens, teacher)
    cfg_b, tokens_b, student_b, teacher_b = chain(tmp_path / "b")

    class Crash(RuntimeError):
        pass

    def crash(rec: object) -> None:
        if rec.step == 3:  # type: ignore[attr-defined]
            raise Crash

    with pytest.raises(Crash):
        stages.train.run(cfg_b, student_b, tokens_b, teacher_b, on_step=crash)
    resumed = stages.train.run(cfg_b, student_b, tokens_b, teacher_b)
    a_bytes = whole[-1].adapter.verify(tmp_path / "a").read_bytes()
    assert resumed[-1].adapter.verify(tmp_path / "b").read_bytes() == a_bytes
    adapter, _, _ = load_checkpoint(whole[-1].path_in(tmp_path / "a"))
    _assert_group_constant(adapter, MERGE_GROUP)
    assert any(np.any(p.B != 0) for p in adapter.values())

    best = stages.evaluate.run(cfg, student, tokens, teacher, whole[-1])
    base = stages.evaluate.run(cfg, student, tokens, teacher)
    exported = stages.export.run(cfg, student, whole[-1])
    assert exported.merged is not None and exported.merge_report["fold"] == 1.0
    assert exported.merge_report["file_bytes"] < 1.15 * exported.merge_report["base_file_bytes"]
    with GGUFFile(exported.merged.resolve(tmp_path / "a")) as f:
        assert f.info("blk.0.attn_q.weight").type_name == "Q4_1" and f.info("blk.0.attn_k.weight").type_name == "Q4_0"
    merged = stages.evaluate.run_merged(cfg, exported.merged, tokens, teacher)
    assert abs(merged.kl - best.kl) < 0.01 * abs(base.kl - best.kl) + 1e-6, (base.kl, best.kl, merged.kl)
