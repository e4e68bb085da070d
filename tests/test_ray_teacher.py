"""teacher.runner=ray on a local 2-CPU Ray cluster and the tiny llama: the shards are byte-identical to the local
runner's, also when a worker dies on its first attempt at a shard (Ray retries it); complete shards are never
resubmitted and a lost one is recomputed alone to the same bytes; the shard writer resolves file:// URLs. The same
for teacher.store sampled (train split sampled, eval split top-k): shards and manifest are the local runner's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import stages.teacher
import stages.teacher_ray
import stages.tokenize
from data.topk import read_manifest, verify_shard
from schemas.config import RunConfig
from schemas.manifests import ShardRecord, TeacherManifest
from tests.pipeline_fixtures import tiny_config
from tests.ray_fixtures import _ray_cluster  # noqa: F401 (fixture)

pytestmark = pytest.mark.ray


def _run(root: Path, runner: str, **teacher: Any) -> tuple[RunConfig, TeacherManifest]:
    cfg = RunConfig.model_validate(tiny_config(root, teacher={"runner": runner, **teacher}))
    return cfg, stages.teacher.run(cfg, stages.tokenize.run(cfg))


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, TeacherManifest]:
    return _run(tmp_path_factory.mktemp("local") / "run", "local")


def _shard_bytes(cfg: RunConfig, manifest: TeacherManifest) -> dict[str, bytes]:
    out = manifest.path_in(cfg.run.workdir)
    return {s.file: (out / s.file).read_bytes() for s in manifest.shards}


def _spy_submissions(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The shards of every later Ray submission (appended per call); the fault hook off."""
    submitted: list[list[int]] = []
    real = stages.teacher_ray._run_on_ray

    def spy(cfg: RunConfig, tokens: Any, planned: Any, todo: list[ShardRecord], *rest: Any) -> None:
        submitted.append([s.shard for s in todo])
        real(cfg, tokens, planned, todo, *rest)

    monkeypatch.setattr(stages.teacher_ray, "_run_on_ray", spy)
    monkeypatch.delenv(stages.teacher_ray.FAULT_ENV)
    return submitted


def test_ray_shards_are_byte_identical_with_a_worker_killed(
    local: tuple[RunConfig, TeacherManifest], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(stages.teacher_ray.FAULT_ENV, "shard=1")  # its worker os._exit()s on the first attempt
    cfg, manifest = _run(tmp_path / "run", "ray")
    out = manifest.path_in(cfg.run.workdir)
    assert (out / ".ray-fault-shard-1").is_file()  # the first attempt died: the shard is from Ray's retry
    assert manifest.complete and len(manifest.shards) >= 8
    assert read_manifest(out) == manifest.model_copy(update={"dir": ""})
    assert manifest.model_copy(update={"dir": ""}) == local[1].model_copy(update={"dir": ""})
    ours, theirs = _shard_bytes(cfg, manifest), _shard_bytes(*local)
    assert ours.keys() == theirs.keys() and all(ours[f] == theirs[f] for f in ours)

    # complete shards are never resubmitted; a lost one is recomputed alone, to the same bytes
    submitted = _spy_submissions(monkeypatch)
    assert stages.teacher.run(cfg, stages.tokenize.run(cfg)) == manifest
    victim = manifest.shards[3]
    (out / victim.file).unlink()
    assert stages.teacher.run(cfg, stages.tokenize.run(cfg)) == manifest
    assert submitted == [[victim.shard]]
    assert (out / victim.file).read_bytes() == theirs[victim.file]


def test_shard_writer_takes_file_urls(local: tuple[RunConfig, TeacherManifest], tmp_path: Path) -> None:
    from data.topk import TopkReader

    cfg, manifest = local
    record = manifest.shards[0]
    rows = TopkReader(manifest.path_in(cfg.run.workdir), verify=False).read(range(record.seq_start, record.seq_end))
    url = (tmp_path / "shards").as_uri()
    assert pafs.FileSystem.from_uri(url)[0].type_name == "local"
    pending = record.model_copy(update={"complete": False, "sha256": "0" * 64})
    done = stages.teacher_ray.write_shard_uri(url, pending, rows, manifest.vocab_size, manifest.k)
    assert done == record  # the same sha256 as the local writer's file
    stages.teacher_ray.verify_shard_uri(url, done, manifest.vocab_size, manifest.k)
    verify_shard(tmp_path / "shards" / record.file, done, manifest.vocab_size, manifest.k)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [record.file]  # no temp file left


SAMPLED = {"store": "sampled", "samples": 12, "seed": 2**33 + 5}


def test_ray_writes_the_sampled_store_byte_identical_with_a_worker_killed(
    ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """teacher.store sampled through teacher.runner ray: every shard (train sampled, eval top-k) and the manifest
    are the local runner's, with the worker of a sampled train shard killed on its first attempt; a lost sampled
    shard is recomputed alone to the same bytes."""
    local_cfg, local = _run(tmp_path / "local", "local", **SAMPLED)
    assert local.store_of("train") == "sampled" and local.store_of("eval") == "topk"
    victim = next(s for s in local.shards if s.split == "train" and s.shard > 0)
    assert any(s.split == "eval" for s in local.shards)

    monkeypatch.setenv(stages.teacher_ray.FAULT_ENV, f"shard={victim.shard}")
    cfg, manifest = _run(tmp_path / "ray", "ray", **SAMPLED)
    out = manifest.path_in(cfg.run.workdir)
    assert (out / f".ray-fault-shard-{victim.shard}").is_file()  # the first attempt died: Ray's retry wrote it
    assert manifest.complete and read_manifest(out) == manifest.model_copy(update={"dir": ""})
    assert manifest.model_copy(update={"dir": ""}) == local.model_copy(update={"dir": ""})
    local_out = local.path_in(local_cfg.run.workdir)
    assert (out / "topk_manifest.parquet").read_bytes() == (local_out / "topk_manifest.parquet").read_bytes()
    ours, theirs = _shard_bytes(cfg, manifest), _shard_bytes(local_cfg, local)
    assert ours.keys() == theirs.keys() and all(ours[f] == theirs[f] for f in ours)
    for record in manifest.shards:  # each split in its store's schema (the driver verified these too)
        k, store = manifest.k_of(record.split), manifest.store_of(record.split)
        verify_shard(out / record.file, record, manifest.vocab_size, k, store)

    submitted = _spy_submissions(monkeypatch)
    (out / victim.file).unlink()
    assert stages.teacher.run(cfg, stages.tokenize.run(cfg)) == manifest
    assert submitted == [[victim.shard]]
    assert (out / victim.file).read_bytes() == theirs[victim.file]
