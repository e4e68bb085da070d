"""The frozen-prefix activation cache: both engines started at the lowest adapted block from the cached input of
that block give the loss and LoRA gradients of the whole forward (exactly from a float32 prefix; within the
float16 storage tolerance from the cache), and the prefix stage writes, verifies, keeps and rebuilds its shards.

Float16 storage tolerance (stated): the cache rounds each value of block L's input to float16 (relative
2^-11 ~ 4.9e-4). On the tiny model below, against the whole forward, that moves the loss by 4e-6 relative and
the LoRA gradients by at most 1.4e-3 of each tensor's largest entry (NumpyEngine, measured); we assert 5e-3 for
the gradients and 1e-3 for losses and held-out KL. From a float32 prefix the numpy engine gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import stages.evaluate
import stages.prefix
import stages.student
import stages.teacher
import stages.tokenize
import stages.train
from cpu import NumpyEngine
from cpu.objectives import NumpyKd
from data.prefix import MANIFEST_NAME, PrefixError, PrefixReader, plan_shards, read_manifest, to_f16
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.kd import LossConfig, log_softmax
from model.quant import dequantize, quantize
from schemas.config import RunConfig
from schemas.manifests import sha256_file
from tests.gpu_fixtures import device_or_skip
from tests.pipeline_fixtures import tiny_config
from training.prefix import numpy_prefix, prefix_layer

CFG = ModelConfig(n_layers=4, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300, context_length=64)
T, B, K, RANK, SCALE = 16, 2, 8, 4, 2.0
LAYERS = (2, 3)  # LoRA on the top two of four blocks: the cache holds the input of block 2
LOSS = LossConfig("forward_kl", tau=1.0, use_tail=True)
F16_REL = 5e-3  # float16 storage: max |err| / max |ref| per gradient tensor (measured 1.4e-3)


def _spec(cfg: ModelConfig, start: int, **extra: object) -> EngineSpec:
    """The engines' spec: LoRA on LAYERS, the forward starting at block `start`."""
    return EngineSpec(
        cfg, targets=LORA_TARGETS, r=RANK, alpha=SCALE * RANK, batch=B, seq_len=T, layers=LAYERS, start_layer=start,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def _weights() -> dict[str, np.ndarray]:
    w = R.random_weights(CFG, 3, np.float32)
    return {
        n: dequantize(quantize(a, Q.Q8_0), Q.Q8_0, a.shape) if a.ndim == 2 and n.startswith("blk.") else a
        for n, a in w.items()
    }


def _batch() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(4)
    ids = rng.integers(0, CFG.vocab, (B, T))
    targets = np.concatenate([ids[:, 1:], rng.integers(0, CFG.vocab, (B, 1))], axis=1)
    mask = (rng.random((B, T)) > 0.2).astype(np.uint8)
    lp = log_softmax(rng.normal(0, 2.0, (B, T, CFG.vocab)))
    tids = np.argsort(-lp, axis=-1)[..., :K]
    top = np.take_along_axis(lp, tids, -1)
    tail = np.clip(1 - np.exp(top).sum(-1), 0, None)
    return ids, targets, mask, tids, top.astype(np.float32), tail.astype(np.float32)


def _adapter(layout: object) -> dict[tuple[int, str], R.LoraPair]:
    rng = np.random.default_rng(6)
    init = R.init_lora(CFG, list(LORA_TARGETS), RANK, seed=5)
    return {k: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(np.float32)) for k, p in init.items() if k[0] >= 2}


def _step(engine: object, batch: tuple[np.ndarray, ...], prefix: np.ndarray | None) -> tuple[float, dict]:
    engine.set_adapter(_adapter(engine.layout))
    engine.write_batch(KdBatch(*batch, prefix=prefix))
    return engine.loss_and_grads(), engine.get_grads()


def _compare(full: tuple[float, dict], cached: tuple[float, dict], rel: float) -> float:
    (loss_a, grads_a), (loss_b, grads_b) = full, cached
    assert set(grads_a) == set(grads_b) and all(k[0] >= 2 for k in grads_a)
    assert abs(loss_b - loss_a) <= min(rel, 1e-3) * abs(loss_a)
    worst = max(max(_rel(grads_b[k].A, grads_a[k].A), _rel(grads_b[k].B, grads_a[k].B)) for k in grads_a)
    assert worst <= rel, f"gradients differ by {worst:.2e} of their largest entry (allowed {rel:.0e})"
    return worst


def test_numpy_engine_from_the_cache_gives_the_whole_forwards_gradients() -> None:
    w, batch = _weights(), _batch()

    def engine(start: int) -> NumpyEngine:
        return NumpyEngine(w, _spec(CFG, start, vocab_chunk=64), NumpyKd(LOSS, K))

    full = _step(engine(0), batch, None)
    prefix = numpy_prefix(w, CFG, batch[0], 2)
    assert prefix.dtype == np.float32 and prefix.shape == (B, T, CFG.hidden)
    _compare(full, _step(engine(2), batch, prefix), 1e-5)  # float32 prefix: the same numbers
    _compare(full, _step(engine(2), batch, to_f16(prefix, "test").astype(np.float32)), F16_REL)
    with pytest.raises(ValueError, match="prefix activations: given False"):
        engine(2).write_batch(KdBatch(*batch))
    with pytest.raises(ValueError, match="prefix activations: given True"):
        engine(0).write_batch(KdBatch(*batch, prefix=prefix))
    with pytest.raises(ValueError, match="lowest adapted block 2"):
        engine(3)


@pytest.mark.gpu
def test_gpu_student_from_the_cache_gives_the_whole_forwards_gradients() -> None:
    from gpu.model import ModelWeights
    from gpu.objectives import GpuKd
    from gpu.student import GPUStudent

    dev = device_or_skip()
    w, batch = _weights(), _batch()
    weights = ModelWeights.from_arrays(dev, CFG, w, Q.Q8_0)

    def engine(start: int) -> GPUStudent:
        return GPUStudent(dev, weights, _spec(weights.cfg, start, precision="f32"), GpuKd(LOSS, K))

    full = _step(engine(0), batch, None)
    prefix = engine(0).residual_stream(batch[0], 2)
    np.testing.assert_allclose(prefix, numpy_prefix(w, CFG, batch[0], 2), rtol=0, atol=2e-5 * np.abs(prefix).max())
    _compare(full, _step(engine(2), batch, prefix), 1e-5)
    _compare(full, _step(engine(2), batch, to_f16(prefix, "test").astype(np.float32)), F16_REL)
    with pytest.raises(ValueError, match="prefix activations: given False"):
        engine(2).write_batch(KdBatch(*batch))


def test_to_f16_refuses_what_float16_cannot_hold() -> None:
    with pytest.raises(PrefixError, match="train.prefix_cache=off"):
        to_f16(np.array([1.0, 7e4], np.float32), "shard")


def test_plan_shards_whole_sequences_within_the_byte_budget() -> None:
    plans = plan_shards(
        {"train": np.arange(5), "eval": np.arange(5, 7)}, seq_len=4, hidden=8, shard_bytes=2 * 64
    )  # 64 bytes a sequence
    assert plans == [("train", 0, 2), ("train", 2, 4), ("train", 4, 5), ("eval", 5, 7)]


def test_prefix_layer_follows_the_config(tmp_path: object) -> None:
    def cfg(**train_lora: dict) -> RunConfig:
        return RunConfig.model_validate(tiny_config(tmp_path, **train_lora))

    assert prefix_layer(cfg()) == 0  # every block adapted
    assert prefix_layer(cfg(lora={"layers": [0, 1]})) == 0
    assert prefix_layer(cfg(lora={"layers": [1]})) == 1
    assert prefix_layer(cfg(lora={"layers": [1]}, train={"prefix_cache": "off"})) == 0


# ---------------------------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny pipeline with LoRA on its top block, on the numpy engine, up to the teacher shards."""
    root = tmp_path_factory.mktemp("prefix") / "run"
    raw = tiny_config(root, lora={"layers": [1]}, train={"backend": "numpy"})
    cfg = RunConfig.model_validate(raw)
    tokens = stages.tokenize.run(cfg)
    student = stages.student.run(cfg)
    teacher = stages.teacher.run(cfg, tokens)
    return {"raw": raw, "cfg": cfg, "root": root, "tokens": tokens, "student": student, "teacher": teacher}


def test_prefix_stage_writes_verified_float16_activations(tiny: dict) -> None:
    cfg, root, tokens, student = tiny["cfg"], tiny["root"], tiny["tokens"], tiny["student"]
    manifest = stages.prefix.run(cfg, student, tokens)
    assert (
        manifest is not None
        and manifest.layer == 1
        and manifest.path_in(root) == stages.prefix.folder(cfg, student, tokens)
    )
    assert read_manifest(manifest.path_in(root)) == manifest.model_copy(update={"dir": ""})
    for ref in manifest.outputs():
        ref.verify(root)
    assert {s.split for s in manifest.shards} == {"train", "eval"}
    n_seq = sum(s.seq_end - s.seq_start for s in manifest.shards)
    assert n_seq == tokens.train.n_sequences + tokens.eval.n_sequences

    from data.tokens import read_token_split
    from training.engines import load_host_weights

    model_cfg, w = load_host_weights(student.path_in(root))
    ds = read_token_split(tokens.path_in(root), "eval").with_format("numpy")
    ids, seq_ids = np.stack(ds["input_ids"]).astype(np.int64), np.asarray(ds["seq_id"])
    got = PrefixReader(manifest.path_in(root)).read(seq_ids.tolist())
    want = numpy_prefix(w, model_cfg, ids, 1).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_prefix_stage_keeps_verified_shards_and_rebuilds_a_corrupt_one(tiny: dict, monkeypatch) -> None:
    cfg, root, tokens, student = tiny["cfg"], tiny["root"], tiny["tokens"], tiny["student"]
    manifest = stages.prefix.run(cfg, student, tokens)
    out = manifest.path_in(root)
    import training.prefix

    real, calls = training.prefix.prefix_fn, []

    def counting(*args: object) -> object:
        fn = real(*args)
        return type(fn)(lambda ids: calls.append(len(ids)) or fn(ids), fn.layer, fn.hidden, fn.rows_per_call)

    monkeypatch.setattr(training.prefix, "prefix_fn", counting)
    assert stages.prefix.run(cfg, student, tokens) == manifest and calls == []  # everything kept
    victim = manifest.shards[0]
    blob = bytearray((out / victim.file).read_bytes())
    blob[-3] ^= 0xFF
    (out / victim.file).write_bytes(bytes(blob))
    with pytest.raises(PrefixError, match="corrupt prefix shard"):
        PrefixReader(out).read([victim.seq_start])
    assert stages.prefix.run(cfg, student, tokens) == manifest
    assert sum(calls) == victim.seq_end - victim.seq_start  # only the corrupt shard was recomputed
    assert sha256_file(out / victim.file) == victim.sha256
    (out / MANIFEST_NAME).unlink()
    assert stages.prefix.run(cfg, student, tokens) == manifest  # the manifest rewritten, the same bytes


def test_training_and_evaluation_from_the_cache_match_the_whole_forward(tiny: dict) -> None:
    """One epoch and its evaluation with the cache and with train.prefix_cache=off: losses and held-out
    metrics agree within the float16 storage tolerance; the cache really is used (it is read)."""
    results = {}
    for mode in ("auto", "off"):
        raw = {**tiny["raw"], "train": {**tiny["raw"]["train"], "prefix_cache": mode, "epochs": 1}}
        cfg = RunConfig.model_validate(raw)
        (ckpt,) = stages.train.run(cfg, tiny["student"], tiny["tokens"], tiny["teacher"])
        ev = stages.evaluate.run(cfg, tiny["student"], tiny["tokens"], tiny["teacher"], ckpt)
        results[mode] = (stages.train.read_steps(cfg, ckpt), ev)
    (steps_a, ev_a), (steps_b, ev_b) = results["auto"], results["off"]
    assert len(steps_a) == len(steps_b) > 1
    for a, b in zip(steps_a, steps_b, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * abs(b["loss"])
    assert abs(ev_a.kl - ev_b.kl) <= 1e-3 * abs(ev_b.kl) and ev_a.n_positions == ev_b.n_positions
    assert ev_a.kl != ev_b.kl or steps_a[-1]["loss"] != steps_b[-1]["loss"]  # float16 rounding shows somewhere
