"""topk_shard/3 (teacher.topk_format compact): the codes' stated error, the ids' byte planes, and a round trip
through the writer, the manifest and TopkReader beside a plain (topk_shard/1) copy of the same rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import topk as S
from data import topk_codes as C
from model import reference as R
from model.config import ModelConfig
from model.teacher_cpu import reference_topk_batch
from schemas.config import RunConfig
from schemas.files import SCHEMA_KEY, TOPK_COMPACT_SHARD, TOPK_SHARD, topk_rank_width
from schemas.manifests import TeacherManifest
from tests.test_topk_store import _token_table

CFG = ModelConfig(n_layers=1, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=300)
K, TAU = 8, 1.5


def test_logp_codes_hold_the_stated_error() -> None:
    d = np.linspace(0, C.MAX_CODED_NATS, 400_001)
    codes = C.logp_codes(d)
    err = np.abs(C.logp_deltas(codes) - d)
    assert (np.diff(codes.astype(int)) >= 0).all() and codes[0] == 0 and codes[-1] == 255
    assert (err <= C.max_logp_error(d) - C.MAX_TOP_ERROR + 1e-6).all()
    for at, step in ((1.9, 1 / 8), (3.9, 1 / 4), (6.9, 1 / 2), (100.0, 1.0)):  # the segments of the docstring
        assert C.max_logp_error(np.array(at)) == pytest.approx(1 / 512 + step / 2)
    assert C.MAX_CODED_NATS == 232 and C.logp_codes(np.array([C.MAX_CODED_NATS + 50])).item() == 255


def test_top_and_tail_codes_hold_the_stated_error() -> None:
    top = -np.linspace(0, 200, 10_001)
    assert np.abs(C.top_values(C.top_codes(top)) - top).max() <= C.MAX_TOP_ERROR + 1e-12
    tail = np.concatenate([np.geomspace(1e-30, 1.0, 10_001), [0.0, 1.0]])
    got = C.tail_values(C.tail_codes(tail)).astype(np.float64)
    assert got[-2] == 0.0 and got[-1] == 1.0
    assert (np.abs(got[:-2] / tail[:-2] - 1) <= np.exp(C.TAIL_STEP / 2) - 1 + 1e-6).all()


def test_rank_gaps_round_trip_through_byte_planes() -> None:
    assert [topk_rank_width(v) for v in (2, 256, 257, 65536, 65537, 262144)] == [1, 1, 2, 2, 3, 3]
    rng = np.random.default_rng(0)
    for width in (1, 2, 3):
        gaps = rng.integers(0, 256**width, size=(5, 7))
        planes = C.gap_planes(gaps, width)
        assert planes.dtype == np.uint8 and planes.shape == (5, 7 * width)
        np.testing.assert_array_equal(planes[:, :7], gaps & 255)  # the low bytes first
        np.testing.assert_array_equal(C.plane_gaps(planes, width), gaps)


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
    assert np.abs(got_c.tail / got_p.tail - 1).max() <= np.exp(C.TAIL_STEP / 2) - 1 + 1e-6
    assert got_c.ids.dtype == np.int32 and got_c.logprobs.dtype == np.float32
    assert (np.diff(got_c.logprobs, axis=1) <= 0).all()  # by descending log-prob, as /1
    key = np.concatenate([t.seq_id for t in truth]) * 1000 + np.concatenate([t.pos for t in truth])
    at = np.searchsorted(key, got_c.seq_id * 1000 + got_c.pos)
    assert rows and (key[at] == got_c.seq_id * 1000 + got_c.pos).all()
    np.testing.assert_array_equal(got_p.tail, tail[at])
    worst = 0.0
    for j, i in enumerate(at):
        assert sorted(got_c.ids[j]) == sorted(ids[i])
        want = dict(zip(ids[i].tolist(), lp[i].tolist(), strict=True))
        for tok, value in zip(got_c.ids[j].tolist(), got_c.logprobs[j].tolist(), strict=True):
            d, err = lp[i].max() - want[tok], abs(value - want[tok])
            assert err <= C.max_logp_error(np.array(d)) + 1e-6, (tok, d, err)
            worst = max(worst, err)
    assert worst > 0  # the codes are lossy: the comparison above saw them

    # a rank past the shard's dictionary is a corrupt shard, named
    rec = next(s for s in compact.shards if s.n_positions)
    shard = pq.read_table(tmp_path / "c" / rec.file)
    planes = np.full((len(shard), shard.schema.field("ids").type.byte_width), 255, np.uint8)
    bad = shard.set_column(2, "ids", pa.FixedSizeBinaryArray.from_buffers(
        shard.schema.field("ids").type, len(shard), [None, pa.py_buffer(planes.tobytes())]))  # fmt: skip
    with pytest.raises(S.ShardError, match="past the shard's dictionary"):
        S._compact_rows(bad, K, tmp_path / "c" / rec.file)


def test_the_eval_split_stays_plain() -> None:
    manifest = TeacherManifest(
        teacher_sha256="0" * 64, k=4, temperature=1.0, vocab_size=300, token_shards_hash="0" * 64, shards=(),
        topk_format="compact", shard_schema=TOPK_COMPACT_SHARD,
    )  # fmt: skip
    assert (manifest.format_of("train"), manifest.format_of("eval")) == ("compact", "plain")


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
