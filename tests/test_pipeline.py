"""The real flow end to end on a tiny llama (lavapipe for train/eval, numpy teacher) under
prefect_test_harness: every stage, the MLflow run and registered version, exports read back; a fully cached
rerun; one changed field recomputing exactly its dependents; injected crashes (after a teacher shard, at a
train step) followed by a rerun with the same final adapter bytes; bad inputs refused with no stage cached;
a corrupt shard and deleted exports rebuilt; moved data with the same bytes still cached."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from data.topk import read_manifest
from flows.distill import run_pipeline
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import sha256_file
from tasks.faults import ENV as FAULT_ENV
from tasks.faults import InjectedFault
from tests.gpu_fixtures import device_or_skip
from tests.pipeline_fixtures import prefect_harness, tiny_config, tiny_inputs, write_tiny_llama  # noqa: F401

pytestmark = pytest.mark.gpu

TRAIN_AND_AFTER = [
    "train-epoch-0",
    "train-epoch-1",
    "evaluate-epoch-0",
    "evaluate-epoch-1",
    "export",
    "evaluate-merged",
]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> None:
    device_or_skip()
    request.getfixturevalue("prefect_harness")


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_pipeline(RunConfig.model_validate(cfg))


def _adapter_bytes(summary: dict[str, Any]) -> bytes:
    wd = Path(summary["workdir"])
    return (wd / summary["checkpoints"][-1]["dir"] / "adapter.safetensors").read_bytes()


def _results(workdir: Path) -> list[str]:
    """Cached stage results under a workdir: result records named '<stage>-<sha256>' (a failed run leaves
    only records under random ids, which no cache lookup reads)."""
    root = workdir / ".prefect" / "results"
    names = sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []
    return [n for n in names if re.fullmatch(r"[a-z-]+-[0-9a-f]{64}", n)]


@pytest.fixture(scope="module")
def first(server: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The uninterrupted reference run."""
    cfg = tiny_config(tmp_path_factory.mktemp("ref") / "run")
    return cfg, _run(cfg)


def test_full_run_records_everything(first: tuple[dict, dict]) -> None:
    cfg, s = first
    shards = [n for n in s["stages"]["ran"] if n.startswith("teacher-shard-")]
    assert len(shards) >= 4  # the tiny data spans several shards of 96 positions
    assert s["stages"]["ran"] == ["tokenize", "student", "teacher-plan", *shards, *TRAIN_AND_AFTER[:2]] + [
        "evaluate-baseline",
        *TRAIN_AND_AFTER[2:],
    ]
    assert s["stages"]["cached"] == []
    # distillation helped on held-out data, and the best epoch is the one with the lowest KL
    assert s["best"]["kl"] < s["baseline"]["kl"]
    assert s["best"]["kl"] == min(e["kl"] for e in s["evals"])
    assert s["teacher_bytes_per_position"] < 4 * 8 + 40

    from tasks.tracking import client_for

    client = client_for(RunConfig.model_validate(cfg))
    run = client.get_run(s["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "4" and run.data.params["model.student_quant"] == "['Q4_0']"
    assert run.data.tags["prefect.flow_run_id"] == s["flow_run_id"]
    assert run.data.tags["teacher.sha256"] == sha256_file(tiny_inputs() / "teacher-f32.gguf")
    steps = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in sorted(steps, key=lambda m: m.step)] == list(
        range(1, s["checkpoints"][-1]["manifest"]["step"] + 1)
    )
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
    } <= artifacts
    assert {"adapter/peft/adapter_model.safetensors", "adapter/peft/adapter_config.json"} <= artifacts
    assert any(a.startswith("report/") for a in artifacts)
    reg = s["registered_model"]
    version = client.get_model_version(reg["name"], reg["version"])
    assert version.run_id == run.info.run_id and version.source.endswith("/adapter") and reg["new"]

    # the exports read back with our own readers, shaped as the config says
    wd = Path(s["workdir"])
    peft = load_file(wd / s["export"]["peft_dir"] / "adapter_model.safetensors")
    assert len(peft) == 2 * 2 * 3  # 2 blocks x (q, v, down) x (A, B)
    assert peft["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 64)
    assert json.loads((wd / s["export"]["peft_dir"] / "adapter_config.json").read_text())["r"] == 4
    with GGUFFile(wd / s["export"]["gguf_lora"]) as f:
        assert f.metadata["general.type"] == "adapter" and f.metadata["adapter.type"] == "lora"
        assert f.tensors["blk.1.attn_v.weight.lora_b"].shape == (16, 4)  # [out = kv dim, r]
    with GGUFFile(wd / s["export"]["merged"]["path"]) as f:
        assert f.config().n_layers == 2
    assert abs(s["merged"]["kl"] - s["best"]["kl"]) < s["baseline"]["kl"]  # the merge keeps most of the gain

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["distill-report"])))
    assert any("before: no adapter" in str(a.data) and s["mlflow"]["run_id"] in str(a.data) for a in arts)
    assert "before: no adapter" in Path(s["report"]).read_text()


def test_identical_rerun_is_fully_cached(first: tuple[dict, dict]) -> None:
    cfg, s = first
    t0 = time.perf_counter()
    again = _run(cfg)
    assert time.perf_counter() - t0 < 10
    assert again["stages"]["ran"] == []
    assert again["stages"]["cached"] == s["stages"]["ran"]
    assert again["best"] == s["best"] and again["export"] == s["export"]
    assert again["mlflow"]["run_id"] != s["mlflow"]["run_id"]  # one MLflow run per flow run
    assert again["registered_model"] == {**s["registered_model"], "new": False}  # the same adapter version


def test_changed_field_recomputes_only_dependents(first: tuple[dict, dict]) -> None:
    cfg, s = first
    changed = json.loads(json.dumps(cfg))
    changed["optim"]["lr"] = 2e-3
    out = _run(changed)
    assert out["stages"]["ran"] == TRAIN_AND_AFTER
    assert out["stages"]["cached"] == [n for n in s["stages"]["ran"] if n not in TRAIN_AND_AFTER]
    assert out["baseline"] == s["baseline"]
    assert _adapter_bytes(out) != _adapter_bytes(s)
    # the original setting's files are untouched (outputs are addressed by their cache key)
    assert (Path(s["workdir"]) / s["export"]["peft_dir"]).is_dir()


def test_crash_after_teacher_shard_resumes(
    first: tuple[dict, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "teacher.shard=1")
    with pytest.raises(InjectedFault):
        _run(cfg)
    topk = next((tmp_path / "run" / "teacher").iterdir())
    done = [r.shard for r in read_manifest(topk).shards if r.complete]
    assert done == [0, 1]  # shard 1 was written and recorded before the crash
    monkeypatch.delenv(FAULT_ENV)
    out = _run(cfg)
    assert out["stages"]["cached"] == ["tokenize", "student", "teacher-plan", "teacher-shard-0"]
    assert out["stages"]["ran"][0] == "teacher-shard-1"  # re-entered, found complete and verified: kept
    assert _adapter_bytes(out) == _adapter_bytes(first[1])
    wd, ref = Path(out["workdir"]), Path(first[1]["workdir"])
    peft = "adapter_model.safetensors"
    assert (wd / out["export"]["peft_dir"] / peft).read_bytes() == (
        ref / first[1]["export"]["peft_dir"] / peft
    ).read_bytes()


def test_crash_at_train_step_resumes_bitwise(
    first: tuple[dict, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_config(tmp_path / "run")
    steps_per_epoch = first[1]["checkpoints"][0]["manifest"]["step"]
    crash_at = steps_per_epoch + 3  # in epoch 1, one step after the checkpoint at steps_per_epoch + 2
    monkeypatch.setenv(FAULT_ENV, f"train.step={crash_at}")
    with pytest.raises(InjectedFault):
        _run(cfg)
    root = next((tmp_path / "run" / "train").iterdir())
    assert (root / "epoch-000" / "checkpoint.json").is_file() and not (root / "epoch-001").exists()
    assert (root / f"step-{crash_at - 1:08d}" / "checkpoint.json").is_file()
    assert _results(tmp_path / "run")  # the stages before the crash are cached ...
    monkeypatch.delenv(FAULT_ENV)
    out = _run(cfg)
    assert out["stages"]["ran"] == ["train-epoch-1", "evaluate-baseline", *TRAIN_AND_AFTER[2:]]
    assert "train-epoch-0" in out["stages"]["cached"]
    steps = [json.loads(line)["step"] for line in (root / "steps.jsonl").read_text().splitlines()]
    assert steps.count(crash_at) == 2 and steps.count(crash_at - 1) == 1  # resumed after step crash_at - 1
    assert _adapter_bytes(out) == _adapter_bytes(first[1])


def _bad_inputs(tmp: Path) -> dict[str, tuple[dict, str]]:
    inputs = tiny_inputs()
    corrupt = tmp / "corrupt.gguf"
    data = (inputs / "teacher-f32.gguf").read_bytes()
    corrupt.write_bytes(data[: len(data) // 2])
    other_vocab = write_tiny_llama(tmp / "other-vocab.gguf", extra_tokens=("zzz",))
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    wd = tmp / "run"
    return {
        "missing gguf": (tiny_config(wd, model={"student": str(tmp / "nope.gguf")}), "nope.gguf"),
        "corrupt gguf": (tiny_config(wd, model={"teacher": str(corrupt)}), "corrupt.gguf"),
        "vocab mismatch": (tiny_config(wd, model={"student": str(other_vocab)}), "first difference at index"),
        "empty dataset": (tiny_config(wd, data={"path": str(empty)}), "empty dataset"),
        "missing field": (tiny_config(wd, data={"text_field": "body"}), "no field 'messages' or 'body'"),
        "seq_len > context": (tiny_config(wd, data={"seq_len": 65}), "exceeds the context length 64"),
    }


def test_bad_inputs_fail_clearly_and_cache_nothing(server: None, tmp_path: Path) -> None:
    for name, (cfg, message) in _bad_inputs(tmp_path).items():
        with pytest.raises(ValueError) as err:
            _run(cfg)
        assert message in str(err.value), (name, str(err.value))
        assert _results(tmp_path / "run") == [], name


def test_corrupt_shard_and_deleted_exports_are_rebuilt(first: tuple[dict, dict]) -> None:
    cfg, s = first
    wd = Path(s["workdir"])
    topk = next((wd / "teacher").iterdir())
    manifest = read_manifest(topk)
    victim = topk / manifest.shards[2].file
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    shutil.rmtree(wd / s["export"]["dir"])  # and the exports are gone
    out = _run(cfg)
    # both rebuilt, to the same bytes: nothing downstream of them changes
    assert out["stages"]["ran"] == ["teacher-shard-2", "export"]
    assert sha256_file(victim) == manifest.shards[2].sha256
    assert (wd / s["export"]["gguf_lora"]).is_file()
    assert np.isclose(out["best"]["kl"], s["best"]["kl"])


def test_data_moved_with_same_bytes_is_cached(first: tuple[dict, dict], tmp_path: Path) -> None:
    """Keys hash the data's bytes, not its path (tests/test_caching.py checks that new bytes change them)."""
    cfg, s = first
    data = shutil.copy(tiny_inputs() / "texts.jsonl", tmp_path / "texts.jsonl")
    same = _run({**cfg, "data": {**cfg["data"], "path": str(data)}})
    assert same["stages"]["ran"] == [] and same["best"] == s["best"]
