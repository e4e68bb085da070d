"""Stage cache keys (no Prefect server): which config fields, files and upstream contents each stage's key
reads, the memoised file hashes, and the outputs check that refuses a stale cached result."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.config import RunConfig, load_config
from tasks import caching, evaluate, export, student, teacher, tokenize, train
from tests.pipeline_fixtures import tiny_config, tiny_inputs, write_texts, write_tiny_llama

POLICIES = {
    p.stage: p
    for p in (
        tokenize.POLICY,
        student.POLICY,
        teacher.PLAN,
        train.POLICY,
        evaluate.BASELINE,
        evaluate.EPOCH,
        evaluate.MERGED,
        export.POLICY,
    )
}
# Upstream stage results as the flow passes them (only their manifests count).
UPSTREAM: dict[str, Any] = {
    "tokens": {"dir": "tokens/a", "manifest": {"n": 1}},
    "student": {
        "path": "student/a/student.gguf",
        "manifest": {"file": {"sha256": "1" * 64}},
        "upload": {"s": 1},
    },
    "teacher": {"dir": "teacher/a", "manifest": {"shards": [{"sha256": "2" * 64}]}},
    "checkpoint": {"dir": "train/a/epoch-000", "manifest": {"adapter": {"sha256": "3" * 64}}},
    "merged": {"path": "export/a/merged.gguf", "manifest": {"sha256": "4" * 64}},
    "epoch": 0,
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    """The tiny config with a student file of its own (a copy of the teacher) and its own data file."""
    inputs = tiny_inputs()
    own_student = shutil.copy(inputs / "teacher-f32.gguf", tmp_path / "student.gguf")
    own_data = shutil.copy(inputs / "texts.jsonl", tmp_path / "texts.jsonl")
    cfg = tiny_config(tmp_path / "run", model={"student": str(own_student)}, data={"path": str(own_data)})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _keys(cfg: RunConfig, upstream: dict[str, Any] = UPSTREAM) -> dict[str, str]:
    return {stage: policy.key(cfg, upstream) for stage, policy in POLICIES.items()}


def _changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {stage for stage in a if a[stage] != b[stage]}


@pytest.mark.parametrize(
    ("override", "stages"),
    [
        ("optim.lr=1e-3", {"train"}),
        ("lora.r=8", {"train", "evaluate", "export"}),
        ("teacher.tail=false", {"train"}),
        ("data.seq_len=16", {"tokenize"}),
        ("data.eval_fraction=0.3", {"tokenize"}),
        ("teacher.top_k=4", {"teacher-plan"}),
        ("model.student_quant=[Q8_0]", {"student"}),
        ("eval.eval_batches=1", {"evaluate-baseline", "evaluate", "evaluate-merged"}),
        ("train.batch_size=2", {"train", "evaluate-baseline", "evaluate", "evaluate-merged"}),
        ("export.merge=false", {"export"}),
        # read by no cached stage: selection, bookkeeping, where things run
        ("eval.best_metric=top1", set()),
        ("train.checkpoint_every=3", set()),
        ("teacher.backend=gpu", set()),
        ("run.experiment=other", set()),
    ],
)
def test_one_field_changes_exactly_the_stages_that_read_it(config_file: Path, override: str, stages: set) -> None:
    before = _keys(load_config(config_file))
    after = _keys(load_config(config_file, [override]))
    assert _changed(before, after) == stages


def test_keys_follow_file_and_data_contents_not_paths(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file)
    before = _keys(cfg)
    assert _keys(load_config(config_file)) == before  # stable
    moved = shutil.copy(cfg.model.student, tmp_path / "elsewhere.gguf")
    assert _keys(load_config(config_file, [f"model.student={moved}"])) == before  # same bytes, other path
    write_tiny_llama(Path(cfg.model.student), seed=7)  # new weights, same tokenizer
    assert _changed(before, _keys(load_config(config_file))) == {"tokenize", "student"}
    before = _keys(load_config(config_file))
    write_texts(Path(cfg.data.path), n_docs=12, seed=3)
    assert _changed(before, _keys(load_config(config_file))) == {"tokenize"}


def test_upstream_manifests_count_by_content(config_file: Path) -> None:
    cfg = load_config(config_file)
    before = _keys(cfg)
    moved = {k: ({**v, "dir": "elsewhere"} if isinstance(v, dict) and "dir" in v else v) for k, v in UPSTREAM.items()}
    timings = {**UPSTREAM, "student": {**UPSTREAM["student"], "upload": {"s": 99}}}
    assert _keys(cfg, moved) == before and _keys(cfg, timings) == before
    new_teacher = {
        **UPSTREAM,
        "teacher": {"dir": "teacher/a", "manifest": {"shards": [{"sha256": "5" * 64}]}},
    }
    assert _changed(before, _keys(cfg, new_teacher)) == {
        "train",
        "evaluate-baseline",
        "evaluate",
        "evaluate-merged",
    }
    new_adapter = {**UPSTREAM, "checkpoint": {"dir": "x", "manifest": {"adapter": {"sha256": "6" * 64}}}}
    assert _changed(before, _keys(cfg, new_adapter)) == {"evaluate", "export"}
    # a checkpoint counts by its adapter, not by the metrics (timings) its run recorded
    noisy = {
        **UPSTREAM,
        "checkpoint": {
            **UPSTREAM["checkpoint"],
            "manifest": {**UPSTREAM["checkpoint"]["manifest"], "metrics": {"tokens_per_s": 3.0}},
        },
    }
    assert _keys(cfg, noisy) == before
    assert _changed(before, _keys(cfg, {**UPSTREAM, "epoch": 1})) == {"train"}


def test_content_refuses_bare_paths() -> None:
    with pytest.raises(TypeError, match="bare Path"):
        caching.content({"a": Path("x")})
    assert caching.content({"dir": "x", "manifest": {"path": "y", "sha256": "z"}}) == {"sha256": "z"}


def test_file_hash_is_memoised_by_path_size_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"abc")
    calls = []
    real = caching.sha256_file
    monkeypatch.setattr(caching, "sha256_file", lambda p: calls.append(p) or real(p))
    first = caching.file_sha256(f, tmp_path)
    assert first == real(f) and len(calls) == 1
    assert caching.file_sha256(f, tmp_path) == first and len(calls) == 1  # from <workdir>/.cache/sha256.json
    assert (tmp_path / ".cache" / "sha256.json").is_file()
    f.write_bytes(b"abd")  # same size, new mtime
    assert caching.file_sha256(f, tmp_path) == real(f) != first and len(calls) == 2


def test_stale_cached_result_is_not_used(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(config_file)
    problem: list[str | None] = [None]
    policy = caching.StageCache(stage="s", inputs=("x",), outputs_problem=lambda c, i, k: problem[0])
    inputs = {"cfg": cfg, "x": {"manifest": {"sha256": "7" * 64}}}
    records: set[str] = set()
    monkeypatch.setattr(caching, "_has_record", lambda key: key in records)
    monkeypatch.setattr("prefect.get_run_logger", lambda: __import__("logging").getLogger("t"))
    key = policy.compute_key(None, inputs, {})
    assert key is not None and key.startswith("s-")
    problem[0] = "file gone"
    assert policy.compute_key(None, inputs, {}) == key  # nothing cached yet: compute and cache normally
    records.add(key)
    assert policy.compute_key(None, inputs, {}) is None  # cached, but its outputs are gone: run again
    problem[0] = None
    assert policy.compute_key(None, inputs, {}) == key
