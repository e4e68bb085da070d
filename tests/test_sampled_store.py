"""The sampled teacher store: the numpy teacher's sampled rows, the versioned shard schema, write -> read -> the
same KdBatch, bytes per position, the cache key and the refusals (teacher.store: sampled)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from data import topk as S
from model import reference as R
from model.kd import LossConfig
from model.sampled import logp_value, sample_positions
from model.teacher_cpu import reference_sampled_batch
from schemas.config import RunConfig
from schemas.files import SAMPLED_SHARD
from schemas.manifests import TeacherManifest
from stages.keys import content
from stages.teacher import KEY
from tests.pipeline_fixtures import tiny_config
from tests.test_topk_store import CFG, TAU, _token_table
from training.batches import Split, kd_batch

N, SEED = 12, 5


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return R.random_weights(CFG, seed=7, dtype=np.float64)


def _teacher(weights: dict) -> S.TeacherFn:
    def fn(ids: np.ndarray, mask: np.ndarray, seq_ids: np.ndarray) -> tuple[np.ndarray, ...]:
        return reference_sampled_batch(weights, CFG, ids, N, TAU, SEED, seq_ids, mask=mask)

    fn.store = "sampled"  # type: ignore[attr-defined]
    return fn


def _header(shards: list) -> TeacherManifest:
    return TeacherManifest(
        teacher_sha256="a" * 64, store="sampled", shard_schema=SAMPLED_SHARD, seed=SEED, k=N, temperature=TAU,
        vocab_size=CFG.vocab, token_shards_hash="b" * 64, shards=tuple(shards),
    )  # fmt: skip


def test_sampled_teacher_rows_are_the_draws_of_its_logits(weights: dict) -> None:
    table = _token_table(5)
    ids = np.asarray(table.column("input_ids").to_pylist())
    mask = np.asarray(table.column("loss_mask").to_pylist())
    seq = np.arange(5) + 100
    out_ids, codes, counts = reference_sampled_batch(weights, CFG, ids, N, TAU, SEED, seq, mask=mask)
    for j in (0, 3):  # against the draw on the reference forward's logits (float64 vs float32: same draws here)
        pos = np.flatnonzero(mask[j])
        z = R.forward(weights, CFG, ids[j])[pos]
        want = sample_positions(z, TAU, N, SEED, np.full(len(pos), seq[j]), pos)
        np.testing.assert_array_equal(out_ids[j, pos], want[0])
        np.testing.assert_array_equal(counts[j, pos], want[1])
        assert np.abs(codes[j, pos].astype(int) - want[2]).max() <= 1
    assert (counts[mask == 0] == 0).all() and (counts[mask == 1].sum(axis=-1) == N).all()
    # one sequence at a time, or in another order: the same rows (keyed by seq_id and position)
    alone = reference_sampled_batch(weights, CFG, ids[3:4], N, TAU, SEED, seq[3:4], mask=mask[3:4])
    np.testing.assert_array_equal(alone[2][0], counts[3])
    np.testing.assert_array_equal(alone[0][0], out_ids[3])


def test_sampled_shards_round_trip_and_are_small(tmp_path: Path, weights: dict) -> None:
    table = _token_table(30)
    plans = S.plan_shards(table, 60, "train")
    teacher = _teacher(weights)
    S.open_manifest(tmp_path / "a", _header(plans))
    manifest = None
    for plan in plans:
        rows = S.compute_shard_rows(table, plan, teacher)
        manifest = S.record_shard(tmp_path / "a", S.write_shard(tmp_path / "a", plan, rows, CFG.vocab, N))
    assert manifest is not None and manifest.complete and manifest.store == "sampled"
    assert S.read_manifest(tmp_path / "a") == manifest.model_copy(update={"dir": ""})
    assert S.missing_shards(manifest, tmp_path / "a") == []
    # another batching of the teacher calls writes byte-identical shards
    S.open_manifest(tmp_path / "b", _header(plans))
    for plan in plans:
        rows_b = S.compute_shard_rows(table, plan, teacher, rows_per_call=13)
        rec = S.write_shard(tmp_path / "b", plan, rows_b, CFG.vocab, N)
        assert rec.sha256 == next(s for s in manifest.shards if s.shard == plan.shard).sha256
    # read back: the teacher's rows, as one KdBatch
    seq_ids = np.asarray(table.column("seq_id").to_pylist())
    ids = np.asarray(table.column("input_ids").to_pylist(), np.int64)
    mask = np.asarray(table.column("loss_mask").to_pylist(), np.uint8)
    reader = S.TopkReader(tmp_path / "a")
    split = Split(seq_ids, ids, mask, ids.shape[1])
    rows = np.arange(8)
    batch = kd_batch(split, rows, 8, reader, N)
    want_ids, want_codes, want_counts = reference_sampled_batch(
        weights, CFG, ids[:8], N, TAU, SEED, rows, mask=mask[:8]
    )
    np.testing.assert_array_equal(batch.teacher_counts, want_counts)
    np.testing.assert_array_equal(batch.teacher_ids, want_ids)
    np.testing.assert_array_equal(batch.teacher_logprobs, np.where(want_counts > 0, logp_value(want_codes), 0))
    assert batch.teacher_tail is None
    # a corrupt shard is found and redone
    path = tmp_path / "a" / plans[0].file
    path.write_bytes(path.read_bytes()[:-9] + b"corrupted")
    assert [s.shard for s in S.missing_shards(manifest, tmp_path / "a")] == [plans[0].shard]


def test_sampled_bytes_per_position(tmp_path: Path, weights: dict) -> None:
    """One shard of ~1,300 positions of the tiny model (a near-flat teacher over 300 ids: ~12 distinct ids per
    position, the store's worst case): bytes per position on disk, printed."""
    table = _token_table(200, seed=3)
    plan = S.plan_shards(table, 10**6, "train")[0]
    S.open_manifest(tmp_path, _header([plan]))
    rows = S.compute_shard_rows(table, plan, _teacher(weights))
    manifest = S.record_shard(tmp_path, S.write_shard(tmp_path, plan, rows, CFG.vocab, N))
    bpp = S.bytes_per_position(manifest, tmp_path)
    distinct = (rows.counts > 0).sum(axis=1).mean()
    print(f"\nsampled store, n={N}: {bpp:.1f} bytes/position over {plan.n_positions} positions "
          f"({distinct:.1f} distinct ids per position)")  # fmt: skip
    assert bpp < 4 * distinct + 8  # 2 B id + 1 B count + 1 B log-prob per distinct id, a few bytes of row keys


def test_sampled_rows_refused_when_malformed(tmp_path: Path, weights: dict) -> None:
    table = _token_table(4)
    plan = S.plan_shards(table, 1000, "train")[0]
    rows = S.compute_shard_rows(table, plan, _teacher(weights))
    bad = rows.counts.copy()
    bad[0, 0] += 1
    with pytest.raises(ValueError, match="counts"):
        S.write_shard(tmp_path, plan, S.TopkRows(*rows.__dict__.values()).__class__(**{**rows.__dict__, "counts": bad}),
                      CFG.vocab, N)  # fmt: skip


def test_numpy_kd_takes_the_sampled_batch() -> None:
    """NumpyKd's head on a sampled KdBatch: the loss of model/kd.py's reference on the same logits."""
    from cpu.head import VocabHead
    from cpu.objectives import NumpyKd
    from model.engine_spec import KdBatch

    rng = np.random.default_rng(0)
    v, h, t = 50, 16, 6
    w = rng.standard_normal((v, h)).astype(np.float32)
    nf = rng.standard_normal((t, h)).astype(np.float32)
    ids, counts, codes = sample_positions(rng.standard_normal((t, v)), 1.0, N, 1, np.zeros(t), np.arange(t))
    cfg = LossConfig("forward_kl", tau=1.0, ce_weight=0.5, samples=N)

    class Trunk:
        batch, seq_len, rows, start_layer, head = 1, t, t, 0, VocabHead(w)
        cfg = SimpleNamespace(vocab=v, hidden=h)

    kd = NumpyKd(cfg, N)
    kd.bind(Trunk())  # type: ignore[arg-type]
    tok = rng.integers(0, v, (1, t))
    targets, mask = rng.integers(0, v, (1, t)), np.ones((1, t))
    lt = logp_value(codes)
    b = kd.write(KdBatch(tok, targets, mask, ids[None], lt[None], None, teacher_counts=counts[None]))
    loss, dh, _ = kd.head(b, nf, backward=True)
    z = (nf @ w.T).astype(np.float64)
    want = R.kd_loss_forward(z, ids, lt, None, targets[0], mask[0], cfg, teacher_counts=counts)
    assert loss == pytest.approx(want, rel=1e-5)
    dz = R.kd_loss_backward(z, ids, lt, None, targets[0], mask[0], cfg, teacher_counts=counts)
    np.testing.assert_allclose(dh, dz @ w, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="teacher_counts"):
        kd.write(KdBatch(tok, targets, mask, ids[None], lt[None], None))


def test_config_store_fields_key_and_refusals(tmp_path: Path) -> None:
    base = tiny_config(tmp_path)
    cfg = RunConfig.model_validate(base)
    assert cfg.teacher.store == "topk" and cfg.teacher.samples == 12
    sampled = RunConfig.model_validate({**base, "teacher": {**base["teacher"], "store": "sampled"}})
    inputs = {"tokens": {"shards_hash": "0" * 64}}
    more = {**base["teacher"], "store": "sampled", "samples": 16}
    seeded = {**base["teacher"], "store": "sampled", "seed": 1}
    others = [RunConfig.model_validate({**base, "teacher": t}) for t in (more, seeded)]
    keys = [KEY.key(c, inputs) for c in (cfg, sampled, *others)]
    assert len(set(keys)) == 4
    # top-k keys stay those of runs from before the sampled store: its fields are folded in only when sampled
    assert KEY.config_fields_when and KEY.key(cfg, inputs) == replace(KEY, config_fields_when=()).key(cfg, inputs)
    topk_other_seed = RunConfig.model_validate({**base, "teacher": {**base["teacher"], "seed": 5, "samples": 3}})
    assert KEY.key(topk_other_seed, inputs) == KEY.key(cfg, inputs)
    manifest = TeacherManifest(
        teacher_sha256="0" * 64, k=4, temperature=1.0, vocab_size=300, token_shards_hash="0" * 64, shards=()
    )
    assert not {"store", "shard_schema", "seed"} & set(content(manifest))
    assert {"store", "seed"} <= set(content(manifest.model_copy(update={"store": "sampled", "seed": 3})))
    for kind in ("reverse_kl", "jsd"):
        with pytest.raises(ValidationError, match=r"loss\.kind: .* teacher\.store: sampled"):
            RunConfig.model_validate(
                {**base, "teacher": {**base["teacher"], "store": "sampled"}, "loss": {"kind": kind}}
            )
    # the Ray runner writes the sampled store too (tests/test_ray_teacher.py: the local runner's bytes)
    ray_cfg = RunConfig.model_validate({**base, "teacher": {**base["teacher"], "store": "sampled", "runner": "ray"}})
    assert ray_cfg.teacher.runner == "ray" and ray_cfg.teacher.store == "sampled"


@pytest.mark.gpu
def test_gpu_teacher_writes_the_numpy_teachers_sampled_rows(tmp_path: Path) -> None:
    """teacher.backend: gpu with teacher.store: sampled (training.teacher's GPU teacher, 5 sequences in batches of
    2, the last padded): the numpy teacher's rows on every position of this tiny model (the agreement rate beyond it:
    tests/test_gpu_sampled.py), masked positions zero as the numpy teacher's."""
    from tests.gpu_fixtures import device_or_skip
    from training.teacher import make_teacher_fn

    device_or_skip()
    teachers = {}
    for backend in ("gpu", "numpy"):
        raw = tiny_config(tmp_path, teacher={"backend": backend, "store": "sampled", "seed": 2**33 + 1},
                          train={"batch_size": 2})  # fmt: skip
        cfg = RunConfig.model_validate(raw)
        teachers[backend] = make_teacher_fn(cfg, cfg.model.teacher)
    assert teachers["gpu"].backend == "gpu" and teachers["gpu"].store == "sampled"
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 200, size=(5, 24))
    mask = (rng.random(ids.shape) < 0.8).astype(np.uint8)
    seq_ids = np.array([3, 1, 4, 1_000_000_007, 2**40])
    got, want = teachers["gpu"](ids, mask, seq_ids), teachers["numpy"](ids, mask, seq_ids)
    assert got[0].shape == want[0].shape == (5, 24, 12)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    assert np.abs(got[1].astype(int) - want[1].astype(int)).max() <= 1
    assert (got[2].astype(int).sum(-1) == np.where(mask > 0, 12, 0)).all()


def test_sampled_run_keeps_the_eval_split_topk(tmp_path: Path) -> None:
    """teacher.store sampled through the stages on the tiny model: the train split is sampled, the eval split is
    top-k (teacher.top_k, with tail) byte for byte as a top-k run's, so held-out metrics (KL, top-1, CE, ECE) are
    the top-k run's exactly; the manifest records it (eval_k), and a sampled run trains on its draws."""
    import stages.evaluate
    import stages.student
    import stages.teacher
    import stages.tokenize
    import stages.train

    runs = {}
    for store in ("topk", "sampled"):
        base = tiny_config(tmp_path / store, train={"epochs": 1, "backend": "numpy"})
        cfg = RunConfig.model_validate({**base, "teacher": {**base["teacher"], "store": store}})
        tokens = stages.tokenize.run(cfg)
        student, teacher = stages.student.run(cfg), stages.teacher.run(cfg, tokens)
        runs[store] = (cfg, tokens, student, teacher)
    topk, sampled = runs["topk"][3], runs["sampled"][3]
    assert (topk.eval_k, sampled.eval_k, sampled.k) == (0, 8, N)
    assert [sampled.store_of(s) for s in ("train", "eval")] == ["sampled", "topk"]
    assert [sampled.k_of(s) for s in ("train", "eval")] == [N, 8] and topk.k_of("eval") == 8
    assert "eval_k" not in content(topk) and content(sampled)["eval_k"] == 8
    assert S.read_manifest(sampled.path_in(tmp_path / "sampled")) == sampled.model_copy(update={"dir": ""})

    def shas(m: TeacherManifest, split: str) -> list[str]:
        return [s.sha256 for s in m.shards if s.split == split]

    assert shas(sampled, "eval") == shas(topk, "eval") and shas(sampled, "train") != shas(topk, "train")
    assert S.missing_shards(sampled, sampled.path_in(tmp_path / "sampled")) == []
    reader = S.TopkReader(sampled.path_in(tmp_path / "sampled"))
    train_seq = next(s for s in sampled.shards if s.split == "train").seq_start
    eval_seq = next(s for s in sampled.shards if s.split == "eval").seq_start
    assert reader.read([train_seq]).counts is not None and reader.read([eval_seq]).counts is None
    with pytest.raises(S.ShardError, match="one store"):
        reader.read([train_seq, eval_seq])
    evals = {store: stages.evaluate.run(cfg, student, tokens, teacher) for store, (cfg, tokens, student, teacher) in
             runs.items()}  # fmt: skip
    assert evals["sampled"] == evals["topk"] and None not in (evals["topk"].ece, evals["topk"].ece_teacher)
    cfg, tokens, student, teacher = runs["sampled"]
    checkpoints = stages.train.run(cfg, student, tokens, teacher)
    trained = stages.evaluate.run(cfg, student, tokens, teacher, checkpoints[-1])
    assert trained.kl < evals["sampled"].kl
