"""Teacher top-k (CPU reference) and the Parquet top-k store: plan, write, verify, resume, read, vocab."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import topk as S
from model import reference as R
from model.config import ModelConfig
from model.teacher_cpu import reference_topk, reference_topk_batch, topk_chunked, topk_from_logits
from schemas.config import RunConfig
from schemas.files import TOKEN_SHARD_SCHEMA, topk_schema, validate_table
from schemas.manifests import TeacherManifest

CFG = ModelConfig(n_layers=1, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300)
K, TAU, SEQ_LEN = 8, 1.5, 12


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return R.random_weights(CFG, seed=7, dtype=np.float64)


def _token_table(n_seq: int, first_seq: int = 0, seed: int = 0) -> pa.Table:
    """A token split: random ids, random loss masks (last position always 0, one row with no target)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab, size=(n_seq, SEQ_LEN), dtype=np.int32)
    mask = (rng.random((n_seq, SEQ_LEN)) < 0.6).astype(np.uint8)
    mask[:, -1] = 0
    mask[1] = 0
    return pa.Table.from_pydict(
        {
            "input_ids": ids.tolist(),
            "loss_mask": mask.tolist(),
            "doc_id": np.arange(n_seq, dtype=np.int64),
            "seq_id": np.arange(first_seq, first_seq + n_seq, dtype=np.int64),
        },
        schema=TOKEN_SHARD_SCHEMA,
    )


def _header(shards: list, k: int = K) -> TeacherManifest:
    return TeacherManifest(
        teacher_sha256="a" * 64, k=k, temperature=TAU, vocab_size=CFG.vocab, token_shards_hash="b" * 64,
        shards=tuple(shards),
    )  # fmt: skip


def _teacher(weights: dict) -> S.TeacherFn:
    """The batched numpy teacher of the stage: ids [N, T], mask [N, T] -> top-k of every sequence."""
    return lambda ids, mask: reference_topk_batch(weights, CFG, ids, K, TAU, mask=mask)


def _fill(out: Path, table: pa.Table, weights: dict, plans: list) -> TeacherManifest:
    teacher = _teacher(weights)
    manifest = None
    for plan in plans:
        rec = S.write_shard(out, plan, S.compute_shard_rows(table, plan, teacher), CFG.vocab, K)
        manifest = S.record_shard(out, rec)
    assert manifest is not None
    return manifest


# ---------------------------------------------------------------------------------------------- teacher


def test_reference_topk_matches_direct_numpy(weights: dict[str, np.ndarray]) -> None:
    ids = np.random.default_rng(1).integers(0, CFG.vocab, size=10)
    got_ids, got_lp, got_tail = reference_topk(weights, CFG, ids, K, TAU)
    assert got_ids.shape == (10, K) and got_lp.dtype == np.float32 and got_tail.shape == (10,)

    z = R.forward(weights, CFG, ids) / TAU
    logp = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :K]
    np.testing.assert_array_equal(got_ids, order)
    np.testing.assert_allclose(got_lp, np.take_along_axis(logp, order, -1), rtol=1e-6, atol=1e-6)
    assert (np.diff(got_lp, axis=1) <= 0).all()
    np.testing.assert_allclose(got_tail, 1.0 - np.exp(np.take_along_axis(logp, order, -1)).sum(-1), atol=1e-6)
    assert (got_tail > 0.01).all()  # 8 of 300 ids leave real mass outside: the check above is not vacuous


def test_topk_from_logits_ties_temperature_and_full_k() -> None:
    logits = np.array([[0.0, 2.0, 2.0, 1.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    ids, lp, tail = topk_from_logits(logits, 2, 1.0)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])  # a tie keeps the smaller ids
    ids, lp, tail = topk_from_logits(logits, 5, 0.5)
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(tail, 0.0)
    sharp = topk_from_logits(logits[1:], 1, 0.25)[2][0]
    soft = topk_from_logits(logits[1:], 1, 4.0)[2][0]
    assert 0.0 < sharp < soft  # a higher temperature spreads mass outside the top id
    with pytest.raises(ValueError, match="NaN or inf"):
        topk_from_logits(np.array([[0.0, np.nan]]), 1, 1.0)


def test_batched_teacher_matches_reference_topk(weights: dict[str, np.ndarray]) -> None:
    """Many sequences per call, float32, 64 vocabulary ids per chunk (300 = 4 full chunks + 44), 2 sequences per
    forward: the same ids as reference_topk (float64 here), logprobs within 2e-5, tails within 1e-4 relative."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, CFG.vocab, size=(5, SEQ_LEN))
    mask = rng.random(ids.shape) < 0.7
    got_ids, got_lp, got_tail = reference_topk_batch(weights, CFG, ids, K, TAU, vocab_chunk=64, max_rows=2 * SEQ_LEN)
    masked = reference_topk_batch(weights, CFG, ids, K, TAU, mask=mask, vocab_chunk=64)
    assert got_ids.shape == (5, SEQ_LEN, K) and got_lp.dtype == np.float32 and got_tail.shape == (5, SEQ_LEN)
    for s in range(len(ids)):
        want_ids, want_lp, want_tail = reference_topk(weights, CFG, ids[s], K, TAU)
        np.testing.assert_array_equal(got_ids[s], want_ids)
        np.testing.assert_allclose(got_lp[s], want_lp, rtol=0, atol=2e-5)
        np.testing.assert_allclose(got_tail[s], want_tail, rtol=1e-4)
        np.testing.assert_array_equal(masked[0][s][mask[s]], want_ids[mask[s]])
        np.testing.assert_allclose(masked[2][s][mask[s]], got_tail[s][mask[s]], rtol=1e-5)
        assert not masked[0][s][~mask[s]].any() and not masked[2][s][~mask[s]].any()


def test_chunked_topk_ties_and_small_tails() -> None:
    """Exact ties across chunk borders keep the smaller ids (integer logits: exact in float32), and a tail far
    below float32's 1 - sum(top) resolution keeps its relative precision."""
    rng = np.random.default_rng(3)
    w = rng.integers(-3, 4, size=(5, 6)).astype(np.float32)[rng.integers(0, 5, size=40)]  # 40 ids, 5 distinct rows
    h = rng.integers(-2, 3, size=(9, 6)).astype(np.float32)
    for k, chunk in ((4, 7), (1, 3), (13, 16), (40, 11)):
        got = topk_chunked(h, w, k, 1.3, chunk)
        want = topk_from_logits(h @ w.T, k, 1.3)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # z / tau rounded in float32
        np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-30)
    sharp = np.zeros((3, 50), np.float32)
    sharp[:, 7] = 30.0  # one id holds all but ~e^-30 * 49 of the mass
    logits = sharp + np.eye(3, 50, dtype=np.float32)
    got = topk_chunked(logits, np.eye(50, dtype=np.float32), 1, 1.0, 8)  # W = I: the logits are h itself
    want = topk_from_logits(logits, 1, 1.0)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    assert 0 < got[2].max() < 1e-10


# ---------------------------------------------------------------------------------------------- store


def test_plan_shards_whole_sequences_deterministic() -> None:
    table = _token_table(9, first_seq=5)
    plans = S.plan_shards(table, shard_positions=15, split="eval", first_shard=3)
    counts = [int(np.sum(m)) for m in table.column("loss_mask").to_pylist()]
    assert [p.shard for p in plans] == list(range(3, 3 + len(plans))) and len(plans) > 1
    assert plans[0].seq_start == 5 and plans[-1].seq_end == 14
    assert all(a.seq_end == b.seq_start for a, b in zip(plans, plans[1:], strict=False))
    for p in plans:
        assert p.n_positions == sum(counts[p.seq_start - 5 : p.seq_end - 5])
        assert p.file == f"topk-eval-{p.shard:05d}.parquet" and not p.complete
    assert all(p.n_positions >= 15 for p in plans[:-1])
    assert S.plan_shards(table, 15, "eval", 3) == plans
    assert S.plan_shards(datasets.Dataset(table), 15, "eval", 3) == plans  # a datasets.Dataset plans alike
    assert sum(p.n_positions for p in S.plan_shards(table, 10**9, "eval")) == sum(counts)


def test_shard_rows_come_from_batched_calls(weights: dict[str, np.ndarray]) -> None:
    """compute_shard_rows hands the teacher many sequences per call (about rows_per_call positions), reports
    progress per call, and keeps the same rows as one sequence per call."""
    table = _token_table(9, seed=8)
    plan = S.plan_shards(table, 10**9, "train")[0]
    calls: list[tuple[int, ...]] = []
    done: list[int] = []

    def teacher(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        calls.append(ids.shape)
        return _teacher(weights)(ids, mask)

    batched = S.compute_shard_rows(table, plan, teacher, rows_per_call=4 * SEQ_LEN, on_sequences=done.append)
    assert calls == [(4, SEQ_LEN), (4, SEQ_LEN)]  # 8 sequences with a trained position; seq 1 has none
    assert sum(done) == 9
    single = S.compute_shard_rows(table, plan, _teacher(weights), rows_per_call=1)
    assert len(batched) == len(single) == plan.n_positions
    for name in ("seq_id", "pos", "ids"):
        np.testing.assert_array_equal(getattr(batched, name), getattr(single, name))
    np.testing.assert_allclose(batched.logprobs, single.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(batched.tail, single.tail, rtol=1e-5, atol=1e-9)


@pytest.mark.gpu
def test_gpu_teacher_takes_batches_like_the_numpy_teacher(tmp_path: Path) -> None:
    """training.teacher's GPU teacher on [N, T] batches (N not a multiple of its batch: the last group padded)
    gives the numpy teacher's top-k: the same ids, logprobs within 1e-4, tails within 1e-4 relative."""
    from tests.gpu_fixtures import device_or_skip
    from tests.pipeline_fixtures import tiny_config
    from training.teacher import make_teacher_fn

    device_or_skip()
    teachers = {}
    for backend in ("gpu", "numpy"):
        raw = tiny_config(tmp_path, teacher={"backend": backend}, train={"batch_size": 2})
        cfg = RunConfig.model_validate(raw)
        teachers[backend] = make_teacher_fn(cfg, cfg.model.teacher)
    assert teachers["gpu"].backend == "gpu" and teachers["gpu"].rows_per_call == 2 * 24
    ids = np.random.default_rng(9).integers(0, 200, size=(5, 24))
    mask = np.ones_like(ids, np.uint8)
    g_ids, g_lp, g_tail = teachers["gpu"](ids, mask)
    n_ids, n_lp, n_tail = teachers["numpy"](ids, mask)
    assert g_ids.shape == n_ids.shape == (5, 24, 8)
    np.testing.assert_array_equal(g_ids, n_ids)
    np.testing.assert_allclose(g_lp, n_lp, rtol=0, atol=1e-4)
    np.testing.assert_allclose(g_tail, n_tail, rtol=1e-4, atol=1e-7)


def test_write_verify_read_round_trip(tmp_path: Path, weights: dict[str, np.ndarray]) -> None:
    train, held = _token_table(6, 0, seed=1), _token_table(3, 6, seed=2)
    plans = S.plan_all(train, held, shard_positions=12)
    manifest = S.open_manifest(tmp_path, _header(plans))
    assert len(S.missing_shards(manifest, tmp_path)) == len(plans)
    _fill(tmp_path, train, weights, [p for p in plans if p.split == "train"])
    manifest = _fill(tmp_path, held, weights, [p for p in plans if p.split == "eval"])
    assert manifest.complete and S.read_manifest(tmp_path) == manifest
    assert S.missing_shards(manifest, tmp_path) == []
    for rec in manifest.shards:
        S.verify_shard(tmp_path / rec.file, rec, CFG.vocab, K)
        validate_table(pq.read_table(tmp_path / rec.file), topk_schema(CFG.vocab, K), rec.file)

    # Read sequences across shards and splits, in a shuffled order; rows follow the masks exactly. The shards
    # were written by the batched float32 teacher; against the per-sequence float64 reference they hold the same
    # ids, logprobs within float16 storage (1e-3) and tails within float32 rounding (relative 1e-4,
    # as test_batched_teacher_matches_reference_topk states).
    tables = {s: t for t in (train, held) for s in t.column("seq_id").to_pylist()}
    order = [7, 0, 3, 1, 8, 5]
    masks = [np.array(tables[s].column("loss_mask").to_pylist()[s - tables[s]["seq_id"][0].as_py()]) for s in order]
    got = S.read_topk(tmp_path, order, masks)
    assert got.ids.dtype == np.int32 and got.logprobs.dtype == np.float32 and got.tail.dtype == np.float32
    at = 0
    for s, mask in zip(order, masks, strict=True):
        row = tables[s].column("input_ids").to_pylist()[s - tables[s]["seq_id"][0].as_py()]
        want_ids, want_lp, want_tail = reference_topk(weights, CFG, np.array(row), K, TAU)
        pos = np.flatnonzero(mask)
        n = len(pos)
        np.testing.assert_array_equal(got.seq_id[at : at + n], s)
        np.testing.assert_array_equal(got.pos[at : at + n], pos)
        np.testing.assert_array_equal(got.ids[at : at + n], want_ids[pos])
        np.testing.assert_allclose(got.logprobs[at : at + n], want_lp[pos], rtol=1e-3, atol=1e-3)  # float16
        np.testing.assert_allclose(got.tail[at : at + n], want_tail[pos], rtol=1e-4, atol=1e-8)
        at += n
    assert at == len(got) and len(S.read_topk(tmp_path, [1]).seq_id) == 0  # seq 1 has no trained position

    assert masks[1].any()
    with pytest.raises(S.ShardError, match="token and top-k shards disagree"):
        S.read_topk(tmp_path, order[1:2], [np.roll(masks[1], 1)])
    assert 0 < S.bytes_per_position(manifest, tmp_path)


def test_corrupted_shard_is_detected_and_redone(
    tmp_path: Path, weights: dict[str, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    table = _token_table(8, seed=3)
    plans = S.plan_shards(table, 10, "train")
    S.open_manifest(tmp_path, _header(plans))
    manifest = _fill(tmp_path, table, weights, plans)
    victim = manifest.shards[1]
    path = tmp_path / victim.file
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))

    with pytest.raises(S.ShardError, match=rf"corrupt shard .*{victim.file}: sha256"):
        S.verify_shard(path, victim, CFG.vocab, K)
    with caplog.at_level(logging.WARNING, logger="data.topk"):
        todo = S.missing_shards(manifest, tmp_path)
    assert [r.shard for r in todo] == [victim.shard] and not todo[0].complete
    assert f"corrupt shard {path}" in caplog.text
    with pytest.raises(S.ShardError, match="corrupt shard"):
        S.read_topk(tmp_path, [victim.seq_start])

    manifest = _fill(tmp_path, table, weights, todo)
    assert S.missing_shards(manifest, tmp_path) == []
    path.unlink()
    assert [r.shard for r in S.missing_shards(manifest, tmp_path)] == [victim.shard]


def test_interrupted_writes_are_not_complete(
    tmp_path: Path, weights: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = _token_table(6, seed=4)
    plans = S.plan_shards(table, 10, "train")
    manifest = S.open_manifest(tmp_path, _header(plans))
    rows = S.compute_shard_rows(table, plans[0], _teacher(weights))

    # 1. Crash while writing: a temp file with partial bytes is all there is.
    def crash(table: pa.Table, where: object, **_: object) -> None:
        where.write(b"PAR1 partial")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(S.pq, "write_table", crash)
        with pytest.raises(OSError, match="disk full"):
            S.write_shard(tmp_path, plans[0], rows, CFG.vocab, K)
    assert not (tmp_path / plans[0].file).exists()
    (tmp_path / f".{plans[0].file}.tmp-999-deadbeef").write_bytes(b"PAR1 left by a killed process")
    assert [r.shard for r in S.missing_shards(S.read_manifest(tmp_path), tmp_path)] == [p.shard for p in plans]

    # 2. Crash after the rename but before the manifest row: the file exists, the shard is still not done.
    rec = S.write_shard(tmp_path, plans[0], rows, CFG.vocab, K)
    assert S.read_manifest(tmp_path) == manifest
    assert plans[0].shard in [r.shard for r in S.missing_shards(S.read_manifest(tmp_path), tmp_path)]
    with pytest.raises(S.ShardError, match="not complete"):
        S.TopkReader(tmp_path)
    assert not list(tmp_path.glob(".topk-train-00000.parquet.tmp-*"))  # the next writer cleared the leftover
    S.record_shard(tmp_path, rec)
    assert plans[0].shard not in [r.shard for r in S.missing_shards(S.read_manifest(tmp_path), tmp_path)]


def test_open_manifest_resumes_or_starts_over(tmp_path: Path, weights: dict[str, np.ndarray]) -> None:
    table = _token_table(5, seed=5)
    plans = S.plan_shards(table, 8, "train")
    S.open_manifest(tmp_path, _header(plans))
    done = _fill(tmp_path, table, weights, plans[:1])
    assert S.open_manifest(tmp_path, _header(plans)) == done  # same inputs: resume
    other_k = S.open_manifest(tmp_path, _header(plans, k=K + 1))  # other inputs: every shard pending again
    assert not any(s.complete for s in other_k.shards) and other_k.k == K + 1


def test_write_shard_rejects_bad_rows(tmp_path: Path, weights: dict[str, np.ndarray]) -> None:
    table = _token_table(4, seed=6)
    plan = S.plan_shards(table, 1000, "train")[0]
    rows = S.compute_shard_rows(table, plan, _teacher(weights))
    with pytest.raises(ValueError, match="the plan counted"):
        S.write_shard(tmp_path, plan.model_copy(update={"n_positions": plan.n_positions + 1}), rows, CFG.vocab, K)
    bad_ids = S.TopkRows(rows.seq_id, rows.pos, rows.ids + CFG.vocab, rows.logprobs, rows.tail)
    with pytest.raises(ValueError, match="outside"):
        S.write_shard(tmp_path, plan, bad_ids, CFG.vocab, K)
    repeated = S.TopkRows(rows.seq_id, rows.pos, np.repeat(rows.ids[:, :1], K, axis=1), rows.logprobs, rows.tail)
    with pytest.raises(ValueError, match="repeats an id"):
        S.write_shard(tmp_path, plan, repeated, CFG.vocab, K)
    unsorted = S.TopkRows(rows.seq_id[::-1], rows.pos[::-1], rows.ids, rows.logprobs, rows.tail)
    with pytest.raises(ValueError, match="sorted by"):
        S.write_shard(tmp_path, plan, unsorted, CFG.vocab, K)
    assert not list(tmp_path.iterdir())


def test_check_vocab() -> None:
    S.check_vocab(["<s>", "a", "b"], ["<s>", "a", "b"], "t.gguf", "s.gguf")
    with pytest.raises(S.VocabMismatchError) as err:
        S.check_vocab(["<s>", "a", "b"], ["<s>", "x", "b", "c"], "/m/teacher.gguf", "/m/student.gguf")
    msg = str(err.value)
    assert "teacher /m/teacher.gguf has 3 tokens" in msg and "student /m/student.gguf has 4" in msg
    assert "index 1: teacher 'a', student 'x'" in msg
    with pytest.raises(S.VocabMismatchError, match="index 2: teacher \\(none\\), student 'c'"):
        S.check_vocab(["a", "b"], ["a", "b", "c"], "t", "s")


def test_unreadable_manifest_starts_over(tmp_path: Path) -> None:
    plans = S.plan_shards(_token_table(3), 8, "train")
    S.open_manifest(tmp_path, _header(plans))
    (tmp_path / S.MANIFEST_NAME).write_bytes(b"not parquet")
    with pytest.raises(S.ShardError, match="unreadable top-k manifest"):
        S.read_manifest(tmp_path)
    assert [s.shard for s in S.open_manifest(tmp_path, _header(plans)).shards] == [p.shard for p in plans]
    assert S.read_manifest(tmp_path) is not None
