"""topk_shard/2 (teacher.topk_format compact): the codes' stated error, the varint ids, and a round trip through
the writer, the manifest and TopkReader beside a plain (topk_shard/1) copy of the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data import topk as S
from model import reference as R
from model.config import ModelConfig
from model.teacher_cpu import reference_topk_batch
from schemas.config import RunConfig
from schemas.files import SCHEMA_KEY, TOPK_COMPACT_SHARD, TOPK_SHARD
from schemas.manifests import TeacherManifest
from tests.test_topk_store import _token_table

CFG = ModelConfig(n_layers=1, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300)
K, TAU = 8, 1.5


def test_logp_codes_hold_the_stated_error() -> None:
    d = np.linspace(0, S.MAX_CODED_NATS, 200_001)
    err = np.abs(S.logp_deltas(S.logp_codes(d)) - d)
    near = d < S.NEAR_NATS
    assert err[near].max() <= S.NEAR_STEP / 2 + 1e-6 and err[~near].max() <= S.FAR_STEP / 2 + 1e-6
    assert S.MAX_NEAR_ERROR == pytest.approx(1 / 16 + 1 / 2048) and S.MAX_FAR_ERROR == pytest.approx(1 / 4 + 1 / 2048)
    assert S.logp_codes(np.array([S.MAX_CODED_NATS + 50])).item() == 255  # clipped past the coded range


def test_varint_round_trip() -> None:
    v = np.array([[0, 1, 127, 128, 16383, 16384, 65535, 2**32 - 1], [5, 0, 0, 0, 300, 2**21, 2**28, 2**35 - 1]])
    data, offsets = S.varint_bytes(v)
    assert offsets.tolist() == [0, 1 + 1 + 1 + 2 + 2 + 3 + 3 + 5, 1 + 1 + 1 + 1 + 2 + 4 + 5 + 5 + 18]
    np.testing.assert_array_equal(S.varint_values(data, v.size).reshape(v.shape), v)
    with pytest.raises(ValueError, match="expected"):
        S.varint_values(data[:-1], v.size)


def _fill(out: Path, table: object, teacher: S.TeacherFn, fmt: str) -> TeacherManifest:
    plans = S.plan_shards(table, 12, "train")
    header = TeacherManifest(
        teacher_sha256="a" * 64, k=K, temperature=TAU, vocab_size=CFG.vocab, token_shards_hash="b" * 64,
        topk_format=fmt, shard_schema=TOPK_COMPACT_SHARD if fmt == "compact" else TOPK_SHARD, shards=tuple(plans),
    )  # fmt: skip
    manifest = S.open_manifest(out, header)
    for plan in plans:
        manifest = S.record_shard(
            out, S.write_shard(out, plan, S.compute_shard_rows(table, plan, teacher), CFG.vocab, K, fmt)
        )
    return manifest


def test_compact_shards_round_trip_within_the_stated_error(tmp_path: Path) -> None:
    weights = R.random_weights(CFG, seed=7, dtype=np.float64)
    teacher = lambda ids, mask: reference_topk_batch(weights, CFG, ids, K, TAU, mask=mask)  # noqa: E731
    table = _token_table(8, 0, seed=3)
    plain, compact = _fill(tmp_path / "p", table, teacher, "plain"), _fill(tmp_path / "c", table, teacher, "compact")
    assert S.read_manifest(tmp_path / "c") == compact and compact.format_of("train") == "compact"
    assert S.missing_shards(compact, tmp_path / "c") == [] and S.missing_shards(plain, tmp_path / "p") == []
    for out, want in (("p", TOPK_SHARD), ("c", TOPK_COMPACT_SHARD)):
        rec = next(s for s in (plain if out == "p" else compact).shards if s.n_positions)
        assert pq.read_schema(tmp_path / out / rec.file).metadata[SCHEMA_KEY].decode() == want

    seqs = [5, 0, 3, 7]
    truth = [S.compute_shard_rows(table, p, teacher) for p in plain.shards]
    rows = {int(s): i for i, s in enumerate(np.concatenate([t.seq_id for t in truth]))}
    ids = np.concatenate([t.ids for t in truth])
    lp = np.concatenate([t.logprobs for t in truth])
    tail = np.concatenate([t.tail for t in truth])
    got_p, got_c = S.read_topk(tmp_path / "p", seqs), S.read_topk(tmp_path / "c", seqs)
    np.testing.assert_array_equal(got_c.seq_id, got_p.seq_id)
    np.testing.assert_array_equal(got_c.pos, got_p.pos)
    np.testing.assert_array_equal(got_c.tail, got_p.tail)  # float32, exact
    assert got_c.ids.dtype == np.int32 and got_c.logprobs.dtype == np.float32
    assert (np.diff(got_c.logprobs, axis=1) <= 0).all()  # by descending log-prob, as /1
    key = np.concatenate([t.seq_id for t in truth]) * 1000 + np.concatenate([t.pos for t in truth])
    at = np.searchsorted(key, got_c.seq_id * 1000 + got_c.pos)
    assert rows and (key[at] == got_c.seq_id * 1000 + got_c.pos).all()
    np.testing.assert_array_equal(tail[at], got_c.tail)
    worst_near = worst_far = 0.0
    for j, i in enumerate(at):
        assert sorted(got_c.ids[j]) == sorted(ids[i])
        want = dict(zip(ids[i].tolist(), lp[i].tolist(), strict=True))
        for tok, value in zip(got_c.ids[j].tolist(), got_c.logprobs[j].tolist(), strict=True):
            d, err = lp[i].max() - want[tok], abs(value - want[tok])
            if d < S.NEAR_NATS - 1e-3:
                worst_near = max(worst_near, err)
            elif d < S.MAX_CODED_NATS:
                worst_far = max(worst_far, err)
    assert 0 < worst_near <= S.MAX_NEAR_ERROR + 1e-6 and worst_far <= S.MAX_FAR_ERROR + 1e-6


def test_compact_format_is_refused_with_the_ray_runner() -> None:
    base = RunConfig.model_validate({"model": {"teacher": "t.gguf", "student": "s.gguf"}, "data": {"path": "d"}})
    cfg = base.model_dump()
    assert base.teacher.topk_format == "plain"
    with pytest.raises(ValueError, match="topk_format"):
        RunConfig.model_validate({**cfg, "teacher": {**cfg["teacher"], "topk_format": "compact", "runner": "ray"}})


def test_teacher_key_moves_only_for_the_compact_format(tmp_path: Path) -> None:
    """The format enters the teacher stage's key only when compact (plain runs keep their keys); a plain manifest's
    content has no topk_format, so the keys downstream stay put."""
    from dataclasses import replace

    from stages.keys import content
    from stages.teacher import KEY
    from tests.pipeline_fixtures import tiny_config

    base = tiny_config(tmp_path)
    plain = RunConfig.model_validate(base)
    compact = RunConfig.model_validate({**base, "teacher": {**base["teacher"], "topk_format": "compact"}})
    inputs = {"tokens": {"shards_hash": "0" * 64}}
    assert KEY.key(plain, inputs) == replace(KEY, config_fields_when=()).key(plain, inputs)
    assert KEY.key(compact, inputs) != KEY.key(plain, inputs)
    manifest = TeacherManifest(
        teacher_sha256="0" * 64, k=4, temperature=1.0, vocab_size=300, token_shards_hash="0" * 64, shards=()
    )
    assert "topk_format" not in content(manifest)
    assert content(manifest.model_copy(update={"topk_format": "compact"}))["topk_format"] == "compact"
