"""What Prefect adds to the stages (tests/test_stages.py checks the stages themselves), on the real flow with
the tiny llama under prefect_test_harness: the stage results cached across runs (typed manifests round-trip
through the JSON result store), exactly the dependents of a changed field recomputed, a crash (after a teacher
shard) resumed by a rerun from the cached tasks, bad inputs refused with nothing cached, a corrupt shard and
deleted exports rebuilt instead of their stale cached results used; and the MLflow run and Prefect artifact
of a run."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from data.topk import read_manifest
from flows.distill import run_pipeline
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, ExportManifest, sha256_file
from tasks.cached import cached_run, remember, walk
from tasks.faults import ENV as FAULT_ENV
from tasks.faults import InjectedFault
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
    tiny_config,
    tiny_inputs,
    write_tiny_llama,
)

pytestmark = pytest.mark.gpu

TRAIN_AND_AFTER = [
    "train-epoch-0",
    "train-epoch-1",
    "evaluate-epoch-0",
    "evaluate-epoch-1",
    "export",
    "evaluate-merged",
]


def _run(cfg: dict[str, Any], until: str = "export") -> dict[str, Any]:
    return run_pipeline(RunConfig.model_validate(cfg), until)  # type: ignore[arg-type]


def _adapter_bytes(summary: dict[str, Any]) -> bytes:
    last = CheckpointManifest.model_validate(summary["checkpoints"][-1])
    return last.adapter.verify(summary["workdir"]).read_bytes()


def _results(workdir: Path) -> list[str]:
    """Cached stage results under a workdir: result records named '<stage>-typed-<sha256>' (a failed run leaves
    only records under random ids, which no cache lookup reads)."""
    root = workdir / ".prefect" / "results"
    names = sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []
    return [n for n in names if re.fullmatch(r"[a-z-]+-typed-[0-9a-f]{64}", n)]


def test_full_run_records_everything(reference_run: tuple[dict, dict]) -> None:
    cfg, s = reference_run
    shards = [n for n in s["stages"]["ran"] if n.startswith("teacher-shard-")]
    assert len(shards) >= 4  # the tiny data spans several shards of 96 positions
    assert s["stages"]["ran"] == ["tokenize", "student", "teacher-plan", *shards, *TRAIN_AND_AFTER[:2]] + [
        "evaluate-baseline",
        *TRAIN_AND_AFTER[2:],
    ]
    assert s["stages"]["cached"] == []
    assert s["best"]["kl"] == min(e["kl"] for e in s["evals"])
    assert [c["step"] for c in s["checkpoints"]] == [4, 8]  # train.max_steps_per_epoch
    assert s["teacher_bytes_per_position"] < 4 * 8 + 40
    # the summary's manifests are the stages' own, and name files that verify
    wd = Path(s["workdir"])
    exported = ExportManifest.model_validate(s["export"])
    assert exported.files() == s["files"] and exported.merged is not None
    for ref in (*(exported.peft or ()), exported.gguf_lora, exported.merged):
        assert ref is not None
        ref.verify(wd)

    from tasks.tracking import client_for

    client = client_for(RunConfig.model_validate(cfg))
    run = client.get_run(s["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "4" and run.data.params["model.student_quant"] == "['Q4_0']"
    assert run.data.tags["prefect.flow_run_id"] == s["flow_run_id"]
    assert run.data.tags["teacher.sha256"] == sha256_file(tiny_inputs() / "teacher-f32.gguf")
    steps = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(steps, key=lambda m: m.step)] == list(range(1, s["checkpoints"][-1]["step"] + 1))
    assert run.data.metrics["best/kl"] == pytest.approx(s["best"]["kl"])
    assert run.data.metrics["baseline/kl"] == pytest.approx(s["baseline"]["kl"])

    def listing(path: str | None = None) -> set[str]:
        out = set()
        for item in client.list_artifacts(run.info.run_id, path):
            out |= listing(item.path) if item.is_dir else {item.path}
        return out

    artifacts = listing()
    assert {
        "config.resolved.yaml",
        "plots/loss.png",
        "plots/kl.png",
        "adapter/adapter-lora.gguf",
        "adapter/peft/adapter_model.safetensors",
        "adapter/peft/adapter_config.json",
    } <= artifacts
    assert any(a.startswith("report/") for a in artifacts)
    reg = s["registered_model"]
    version = client.get_model_version(reg["name"], reg["version"])
    assert version.run_id == run.info.run_id and version.source.endswith("/adapter") and reg["new"]
    assert version.tags["adapter.sha256"] == s["checkpoints"][s["evals"].index(s["best"])]["adapter"]["sha256"]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["distill-report"])))
    assert any("before: no adapter" in str(a.data) and s["mlflow"]["run_id"] in str(a.data) for a in arts)
    assert "before: no adapter" in Path(s["report"]).read_text()


def test_identical_rerun_is_fully_cached(reference_run: tuple[dict, dict]) -> None:
    cfg, s = reference_run
    t0 = time.perf_counter()
    again = _run(cfg)
    assert time.perf_counter() - t0 < 10
    assert again["stages"]["ran"] == []
    assert again["stages"]["cached"] == s["stages"]["ran"]
    # the cached results are the same typed manifests (read back from the JSON result store)
    for key in ("checkpoints", "baseline", "evals", "best", "export", "files", "merged"):
        assert again[key] == s[key], key
    assert again["mlflow"] == s["mlflow"] and again["reused"]  # the run that made the results: no new one
    assert again["registered_model"] == {**s["registered_model"], "new": False}  # the same adapter version


def test_changed_field_recomputes_only_dependents(reference_run: tuple[dict, dict]) -> None:
    cfg, s = reference_run
    changed = json.loads(json.dumps(cfg))
    changed["optim"]["lr"] = 2e-3
    out = _run(changed)
    assert out["stages"]["ran"] == TRAIN_AND_AFTER
    assert out["stages"]["cached"] == [n for n in s["stages"]["ran"] if n not in TRAIN_AND_AFTER]
    assert out["baseline"] == s["baseline"]
    assert _adapter_bytes(out) != _adapter_bytes(s)
    # the original setting's files are untouched (outputs are addressed by their cache key)
    assert (Path(s["workdir"]) / s["files"]["peft_dir"]).is_dir()


def test_crash_after_teacher_shard_resumes(
    reference_run: tuple[dict, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = {**reference_run[0], "run": {**reference_run[0]["run"], "workdir": str(tmp_path / "run")}}
    monkeypatch.setenv(FAULT_ENV, "teacher.shard=1")
    with pytest.raises(InjectedFault):
        _run(cfg, "teacher")
    topk = next((tmp_path / "run" / "teacher").iterdir())
    done = [r.shard for r in read_manifest(topk).shards if r.complete]
    assert done == [0, 1]  # shard 1 was written and recorded before the crash
    monkeypatch.delenv(FAULT_ENV)
    out = _run(cfg, "teacher")
    assert out["stages"]["cached"] == ["tokenize", "student", "teacher-plan", "teacher-shard-0"]
    assert out["stages"]["ran"][0] == "teacher-shard-1"  # re-entered, found complete and verified: kept
    assert [n for n in out["stages"]["ran"] if not n.startswith("teacher-shard-")] == []
    # the same shards as the uninterrupted run, byte for byte
    ref = next((Path(reference_run[1]["workdir"]) / "teacher").iterdir())
    assert topk.name == ref.name and read_manifest(topk) == read_manifest(ref)


def test_bad_inputs_fail_clearly_and_cache_nothing(prefect_harness: None, tmp_path: Path) -> None:
    """Refused before any stage (the vocabularies) or by the first stage (no documents): nothing cached.
    tests/test_cli.py and tests/test_stages.py check the other refusals' messages without a flow run."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    other_vocab = write_tiny_llama(tmp_path / "other-vocab.gguf", extra_tokens=("zzz",))
    wd = tmp_path / "run"
    cases = {
        "vocab mismatch": (tiny_config(wd, model={"student": str(other_vocab)}), "first difference at index"),
        "empty dataset": (tiny_config(wd, data={"path": str(empty)}), "empty dataset"),
    }
    for name, (cfg, message) in cases.items():
        with pytest.raises(ValueError) as err:
            _run(cfg)
        assert message in str(err.value), (name, str(err.value))
        assert _results(wd) == [], name


def _damage(path: Path, how: str) -> None:
    blob = bytearray(path.read_bytes())
    if how == "flip":
        blob[len(blob) // 2] ^= 0xFF
    else:
        del blob[len(blob) // 2 :]
    path.write_bytes(bytes(blob))


def test_damaged_outputs_of_every_stage_are_rebuilt_to_the_same_bytes(reference_run: tuple[dict, dict]) -> None:
    """One file of each stage's outputs flipped or truncated, the exports' PEFT dir deleted: the rerun
    recomputes exactly those stages (their rebuilt bytes are the same, so nothing downstream changes) and the
    adapter it logs to MLflow is the verified one, never the broken file."""
    cfg, s = reference_run
    wd = Path(s["workdir"])
    found = walk(RunConfig.model_validate(cfg)).values
    topk = found.teacher.path_in(wd)
    exported = ExportManifest.model_validate(s["export"])
    assert exported.gguf_lora is not None
    victims = {
        "tokenize": (found.tokens.train.shards[0].resolve(wd), "flip"),
        "student": (found.student.path_in(wd), "truncate"),
        "teacher-shard-2": (topk / found.teacher.shards[2].file, "flip"),
        "train-epoch-0": (found.checkpoints[0].adapter.resolve(wd), "flip"),
        "export": (exported.gguf_lora.resolve(wd), "truncate"),
    }
    before = {stage: sha256_file(path) for stage, (path, _) in victims.items()}
    for path, how in victims.values():
        _damage(path, how)
    shutil.rmtree(wd / s["files"]["peft_dir"])
    out = _run(cfg)
    assert out["stages"]["ran"] == list(victims)
    assert {stage: sha256_file(path) for stage, (path, _) in victims.items()} == before
    for key in ("export", "files", "baseline", "evals", "merged"):
        assert out[key] == s[key], key
    for new, old in zip(out["checkpoints"], s["checkpoints"], strict=True):  # the state JSON holds timings
        assert (new["adapter"], new["optimizer"], new["step"]) == (old["adapter"], old["optimizer"], old["step"])
    from mlflow.artifacts import download_artifacts

    logged = download_artifacts(
        run_id=out["mlflow"]["run_id"],
        artifact_path="adapter/adapter-lora.gguf",
        tracking_uri=out["mlflow"]["tracking_uri"],
    )
    assert sha256_file(logged) == before["export"]


def test_cached_walk_is_the_flows_stages_and_answers_a_remembered_run(reference_run: tuple[dict, dict]) -> None:
    """tasks.cached walks the flow's stages in its order over the same records, without Prefect; once a run's
    summary is remembered, a fully cached rerun is that run (its MLflow run reused, every stage cached)."""
    cfg, s = reference_run
    rc = RunConfig.model_validate(cfg)
    w = walk(rc)
    assert [name for name, _ in w.records] == s["stages"]["ran"] + s["stages"]["cached"]
    assert set(_results(Path(s["workdir"]))) >= {key for _, key in w.records}
    assert [c.adapter.sha256 for c in w.values.checkpoints] == [c["adapter"]["sha256"] for c in s["checkpoints"]]
    assert remember(rc, "export", s) is not None
    again = cached_run(rc)
    assert again is not None and again["reused"]
    assert again["stages"] == {"ran": [], "cached": [name for name, _ in w.records]}
    assert again["mlflow"] == s["mlflow"] and again["best"] == s["best"]
    # another `until` is another run: never answered by the export run (other tests may remember their own)
    other = cached_run(rc, "teacher")
    assert other is None or other["mlflow"] != s["mlflow"]
