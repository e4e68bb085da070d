"""Vocabularies above 65,535 (Llama 3: 128,256; Gemma 3: 262,144) everywhere token ids travel, on a tiny random
model of vocabulary 70,000 whose high rows are boosted so most teacher top-k ids are above 65,535: the numpy
teacher -> top-k shards (uint32 ids) -> the reader -> KdBatch -> the numpy engine's KD loss, gradients and top-1
(evaluation) against the float64 reference; a shard of uint16 ids under a vocabulary that needs uint32 refused;
the GGUF LoRA / merge of such a model; the GPU teacher's top-k and the GPU KD head on lavapipe. Each check holds
ids above 65,535, so a narrowing to 16 bits anywhere fails it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gguf import GGMLQuantizationType as Q

from cpu import NumpyEngine
from cpu.objectives import NumpyKd
from data import topk as S
from data.adapters import merge_adapter
from model import reference as R
from model.config import LORA_TARGETS, ModelConfig
from model.engine_spec import EngineSpec
from model.gguf import GGUFFile, check_model_file, model_metadata, write_gguf
from model.kd import LossConfig
from model.teacher_cpu import reference_topk_batch
from schemas.files import TOKEN_SHARD_SCHEMA, topk_id_type
from schemas.manifests import TeacherManifest, sha256_file
from tests.pipeline_fixtures import tokenizer_metadata
from training.batches import Split, kd_batch

VOCAB = 70_000
HIGH = 1 << 16  # the first id a uint16 cannot hold
CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=VOCAB, context_length=64)
K, TAU, T, N_SEQ, RANK, SCALE = 8, 1.0, 8, 4, 4, 2.0
REL = 2e-5  # float32 engine vs float64 reference (as tests/test_numpy_engine.py)


def _weights() -> dict[str, np.ndarray]:
    """Random float32 weights; the (tied) embedding rows >= 65,536 scaled up so those ids win most top-k places."""
    w = R.random_weights(CFG, seed=3, dtype=np.float32)
    w["token_embd.weight"][HIGH:] *= 2.5
    return w


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return _weights()


def _tokens(seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = rng.integers(HIGH - 1000, VOCAB, size=(N_SEQ, T), dtype=np.int32)
    mask = np.ones((N_SEQ, T), np.uint8)
    mask[:, -1] = 0
    return pa.Table.from_pydict(
        {
            "input_ids": ids.tolist(),
            "loss_mask": mask.tolist(),
            "doc_id": np.arange(N_SEQ, dtype=np.int64),
            "seq_id": np.arange(N_SEQ, dtype=np.int64),
        },
        schema=TOKEN_SHARD_SCHEMA,
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, weights: dict[str, np.ndarray]) -> tuple[Path, pa.Table]:
    """The teacher stage's files for the tokens: plan, shards written by the numpy teacher, manifest."""
    out = tmp_path_factory.mktemp("topk")
    tokens = _tokens()
    plans = S.plan_all(tokens, tokens.slice(0, 0), shard_positions=2 * T)
    header = TeacherManifest(
        teacher_sha256="a" * 64, k=K, temperature=TAU, vocab_size=VOCAB, token_shards_hash="b" * 64,
        shards=tuple(plans),
    )  # fmt: skip
    S.open_manifest(out, header)

    def teacher(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        return reference_topk_batch(weights, CFG, ids, K, TAU, mask=mask, vocab_chunk=16384)

    for plan in plans:
        S.record_shard(out, S.write_shard(out, plan, S.compute_shard_rows(tokens, plan, teacher), VOCAB, K))
    return out, tokens


def test_shards_store_and_return_ids_above_65535(shards: tuple[Path, pa.Table], weights) -> None:
    out, tokens = shards
    manifest = S.read_manifest(out)
    assert manifest is not None and manifest.complete and len(manifest.shards) > 1
    assert topk_id_type(VOCAB) == pa.uint32()
    for rec in manifest.shards:
        assert pq.read_schema(out / rec.file).field("ids").type == pa.list_(pa.uint32(), K)
    ids = np.stack(tokens.column("input_ids").to_numpy(zero_copy_only=False))
    masks = list(np.stack(tokens.column("loss_mask").to_numpy(zero_copy_only=False)))
    read = S.TopkReader(out).read(list(range(N_SEQ)), masks=masks)
    want_ids, want_lp, _ = reference_topk_batch(weights, CFG, ids, K, TAU)
    keep = np.stack(masks) != 0
    np.testing.assert_array_equal(read.ids, want_ids[keep])
    np.testing.assert_allclose(read.logprobs, want_lp[keep], atol=2e-2)  # float16 on disk
    assert (read.ids >= HIGH).mean() > 0.5 and read.ids.max() < VOCAB


def test_uint16_shard_under_a_large_vocabulary_is_refused(shards: tuple[Path, pa.Table], tmp_path: Path) -> None:
    """A shard whose ids are uint16 (a writer that narrowed them) does not verify against a 70,000-id manifest."""
    out, _ = shards
    rec = S.read_manifest(out).shards[0]
    table = pq.read_table(out / rec.file)
    flat = table.column("ids").combine_chunks().flatten().cast(pa.uint16(), safe=False)
    narrow = table.set_column(2, "ids", pa.FixedSizeListArray.from_arrays(flat, K))
    path = tmp_path / rec.file
    pq.write_table(narrow, path)
    record = rec.model_copy(update={"sha256": sha256_file(path)})
    with pytest.raises(S.ShardError, match=r"column 'ids' has type fixed_size_list<.*uint16.*expected .*uint32"):
        S.verify_shard(path, record, VOCAB, K)


def _spec() -> EngineSpec:
    return EngineSpec(CFG, targets=tuple(LORA_TARGETS), r=RANK, alpha=SCALE * RANK, batch=2, seq_len=T,
                      vocab_chunk=16384)  # fmt: skip


def _adapter(seed: int) -> dict[tuple[int, str], R.LoraPair]:
    rng = np.random.default_rng(seed)
    init = R.init_lora(CFG, list(LORA_TARGETS), RANK, seed=seed)
    return {key: R.LoraPair(p.A, rng.normal(0, 0.2, p.B.shape).astype(np.float32)) for key, p in init.items()}


def test_numpy_engine_kd_and_top1_on_shard_batches(shards: tuple[Path, pa.Table], weights) -> None:
    """KdBatches read from the shards (teacher ids >= 65,536) through NumpyEngine: loss and every LoRA gradient
    against the float64 reference, and the evaluation's top-1 ids (the argmax over all 70,000 logits)."""
    out, tokens = shards
    ids = np.stack(tokens.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    mask = np.stack(tokens.column("loss_mask").to_numpy(zero_copy_only=False)).astype(np.uint8)
    split = Split(np.arange(N_SEQ), ids, mask, ids.shape[1])
    batch = kd_batch(split, np.array([1, 2]), 2, S.TopkReader(out), K)
    assert batch.teacher_ids[batch.mask != 0].max() >= HIGH
    loss_cfg = LossConfig("forward_kl", tau=TAU, use_tail=True, ce_weight=0.25)
    engine = NumpyEngine(weights, _spec(), NumpyKd(loss_cfg, K))
    adapter = _adapter(5)
    engine.set_adapter(adapter)
    engine.write_batch(batch)
    loss = engine.loss_and_grads()
    w64 = {n: a.astype(np.float64) for n, a in weights.items()}
    a64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    args = (batch.teacher_ids, batch.teacher_logprobs, batch.teacher_tail, batch.targets, batch.mask, loss_cfg)
    want_loss, want = R.loss_and_grads(w64, CFG, batch.ids, a64, SCALE, *args)
    assert abs(loss - want_loss) <= REL * abs(want_loss)
    got = engine.get_grads()
    for key, (da, db) in want.items():
        for g, w in ((got[key].A, da), (got[key].B, db)):
            assert np.abs(g - w).max() <= REL * np.abs(w).max(), key
    top1 = engine.evaluate_batch()["top1"]
    logits = R.forward(w64, CFG, batch.ids, a64, SCALE).reshape(-1, VOCAB)
    np.testing.assert_array_equal(top1, logits.argmax(axis=1))
    assert top1.dtype == np.uint32 and top1.max() >= HIGH


def test_gguf_merge_keeps_a_large_vocabulary(tmp_path: Path, weights) -> None:
    """The merged GGUF of a 70,000-id model reads back as the same model with the adapter folded in."""
    src = tmp_path / "model.gguf"
    n_base = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
    meta = {**tokenizer_metadata(tuple(f"<x{i}>" for i in range(VOCAB - n_base))), **model_metadata(CFG, "tiny 70k")}
    write_gguf(src, CFG.arch, meta, ((n, w, Q.F32) for n, w in weights.items()))
    adapter = _adapter(7)
    merged = tmp_path / "merged.gguf"
    merge_adapter(src, adapter, SCALE, merged)
    assert check_model_file(merged) == CFG
    with GGUFFile(merged) as f:
        got = {n: f.tensor_f32(n).astype(np.float64) for n in f.tensors}
    ids = np.array([HIGH + 5, 3, VOCAB - 1, HIGH - 1, 70])
    w64 = {n: a.astype(np.float64) for n, a in weights.items()}
    a64 = {k: R.LoraPair(p.A.astype(np.float64), p.B.astype(np.float64)) for k, p in adapter.items()}
    want = R.forward(w64, CFG, ids, a64, SCALE)
    assert np.abs(R.forward(got, CFG, ids) - want).max() <= 1e-4 * np.abs(want).max()


# ---------------------------------------------------------------- the GPU side (lavapipe)


@pytest.mark.gpu
def test_gpu_teacher_topk_above_65535(weights) -> None:
    """GPUTeacher (forward, chunked lm_head, top-k kernels) returns the numpy teacher's ids, most >= 65,536."""
    from gpu.model import ModelWeights
    from gpu.teacher import GPUTeacher
    from tests.gpu_fixtures import device_or_skip

    dev = device_or_skip()
    ids = np.random.default_rng(2).integers(HIGH - 500, VOCAB, size=(2, T))
    teacher = GPUTeacher(dev, ModelWeights.from_arrays(dev, CFG, weights), batch=2, seq_len=T, top_k=K, tau=TAU,
                         vocab_chunk=16384)  # fmt: skip
    got_ids, got_lp, got_tail = teacher.topk(ids)
    want_ids, want_lp, want_tail = reference_topk_batch(weights, CFG, ids, K, TAU)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_tail, want_tail, rtol=1e-4, atol=5e-6)  # GPU: 1 - sum exp(top-k) in f32
    assert got_ids.dtype == np.uint32 and (got_ids >= HIGH).mean() > 0.5


@pytest.mark.gpu
def test_gpu_kd_head_with_teacher_ids_above_65535(weights) -> None:
    """The GPU KD head (logits chunks, gather at the teacher ids, scatter of dL/dz) against model/kd.py when the
    teacher ids and the targets are above 65,535."""
    from gpu.ops.kd import KdScratch, kd_head_forward_backward
    from model.kd import kd_loss_backward, kd_loss_forward, log_softmax
    from tests.gpu_fixtures import device_or_skip
    from tests.gpu_helpers import rel_err, up

    dev = device_or_skip()
    rng = np.random.default_rng(4)
    t, h_dim, chunk = 6, CFG.hidden, 16384
    w = weights["token_embd.weight"]
    h = rng.standard_normal((t, h_dim)).astype(np.float32)
    z = rng.standard_normal((t, VOCAB)) * 3.0
    z[:, HIGH:] += 2.0
    lp = log_softmax(z)
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :K].astype(np.uint32)
    lt = np.take_along_axis(lp, ids.astype(np.int64), axis=1).astype(np.float32)
    targets = rng.integers(HIGH, VOCAB, t).astype(np.uint32)
    mask = np.array([1, 1, 0, 1, 1, 1], np.uint32)
    assert (ids >= HIGH).mean() > 0.3 and (ids < HIGH).any()
    cfg = LossConfig("forward_kl", tau=1.0, ce_weight=0.3)
    hb, wb, idb, ltb, tgb, mb = (up(dev, a, a.dtype) for a in (h, w, ids, lt, targets, mask))
    dh, loss = dev.buffer(h.nbytes), dev.buffer(8)
    scratch = KdScratch.build(dev, t, K, chunk)
    kd_head_forward_backward(
        dev, hb, wb, idb, ltb, None, tgb, mb, cfg, dh, loss, t, h_dim, VOCAB, K, scratch=scratch, loss_index=1
    )
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    args = (ids, lt.astype(np.float64), None, targets, mask, cfg)
    want_loss = kd_loss_forward(logits, *args)
    want_dh = kd_loss_backward(logits, *args) @ w.astype(np.float64)
    got_loss = float(dev.read(loss, np.float32, (2,))[1])
    assert abs(got_loss - want_loss) <= 1e-4 * abs(want_loss)
    assert rel_err(dev.read(dh, np.float32, h.shape), want_dh) <= 1e-4
