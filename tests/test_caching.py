"""Stage cache keys (no Prefect server): which config fields, files and upstream contents each stage's key
reads (not locations: moved files, data or workdir keep every key), the memoised file hashes, and the outputs
check that refuses a stale cached result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.config import RunConfig, load_config
from schemas.manifests import (
    CheckpointManifest,
    ExportManifest,
    FileRef,
    ShardRecord,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
    TokenSplit,
)
from stages import keys
from stages.graph import Node
from tasks import caching, evaluate, export, student, teacher, tokenize, train
from tasks.records import record_key
from tests.gpu_fixtures import device_or_skip
from tests.pipeline_fixtures import tiny_config, tiny_inputs, write_texts, write_tiny_llama
from training.teacher import teacher_engine

POLICIES = {
    t.cache_policy.stage: t.cache_policy
    for t in (
        tokenize.tokenize,
        student.student,
        teacher.plan_teacher,
        train.train_epoch,
        evaluate.evaluate_baseline,
        evaluate.evaluate_checkpoint,
        evaluate.evaluate_merged,
        export.export_adapter,
    )
}


def _ref(path: str, digit: str) -> FileRef:
    return FileRef(path=path, sha256=digit * 64, bytes=10)


def _upstream(where: str = "", adapter: str = "3", shard: str = "2", metrics: dict | None = None) -> dict[str, Any]:
    """Upstream stage results as the flow passes them; `where` prefixes every location (a moved workdir)."""
    split = TokenSplit(
        shards=(_ref(f"{where}tokens/a/train/x.arrow", "1"),), n_documents=1, n_sequences=2, n_positions=3
    )
    tokens = TokenizeManifest(
        dir=f"{where}tokens/a",
        dataset_fingerprint="fp",
        tokenizer_sha256="1" * 64,
        vocab_size=300,
        seq_len=8,
        train=split,
        eval=split,
    )
    row = ShardRecord(
        shard=0, file="topk.parquet", split="train", seq_start=0, seq_end=2, n_positions=3, sha256=shard * 64,
        complete=True,
    )  # fmt: skip
    ckpt_dir = f"{where}train/a/epoch-000"
    return {
        "tokens": tokens,
        "student": StudentManifest(
            source_sha256="1" * 64,
            file=_ref(f"{where}student/a/student.gguf", "1"),
            requantized=True,
            tensor_types={"Q4_0": 2},
        ),
        "teacher": TeacherManifest(
            dir=f"{where}teacher/a",
            teacher_sha256="1" * 64,
            k=4,
            temperature=1.0,
            vocab_size=300,
            token_shards_hash=tokens.shards_hash(),
            shards=(row,),
        ),
        "checkpoint": CheckpointManifest(
            dir=ckpt_dir,
            epoch=0,
            step=2,
            adapter=_ref(f"{ckpt_dir}/adapter.safetensors", adapter),
            optimizer=_ref(f"{ckpt_dir}/optimizer.safetensors", "5"),
            state=_ref(f"{ckpt_dir}/checkpoint.json", "6"),
            metrics=metrics or {"train_loss": 1.0},
        ),
        "merged": _ref(f"{where}export/a/merged.gguf", "4"),
        "epoch": 0,
    }


UPSTREAM = _upstream()


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
        ("eval.precision=f32", {"evaluate-baseline", "evaluate", "evaluate-merged"}),
        ("train.batch_size=2", {"train", "evaluate-baseline", "evaluate", "evaluate-merged"}),
        ("export.merge=false", {"export"}),
        # read by no cached stage: selection, bookkeeping
        ("eval.best_metric=top1", set()),
        ("train.checkpoint_every=3", set()),
        ("train.precision=auto", {"train", "evaluate-baseline", "evaluate", "evaluate-merged"}),  # numpy teacher
        ("run.experiment=other", set()),
    ],
)
def test_one_field_changes_exactly_the_stages_that_read_it(config_file: Path, override: str, stages: set) -> None:
    before = _keys(load_config(config_file))
    after = _keys(load_config(config_file, [override]))
    assert _changed(before, after) == stages


@pytest.mark.gpu
def test_the_teacher_plan_is_keyed_by_the_engine_that_computes_it(config_file: Path) -> None:
    """numpy and GPU teachers write different bytes: the plan's key holds the resolved engine (a GPU teacher's
    precision as resolved on the adapter: auto is f32 on wgpu-native, so it keeps the key)."""
    device_or_skip()
    assert teacher_engine(load_config(config_file, ["teacher.backend=gpu"])) == "gpu/wgpu/f32"
    assert teacher_engine(load_config(config_file)) == "numpy"
    gpu = _keys(load_config(config_file, ["teacher.backend=gpu"]))
    assert _changed(_keys(load_config(config_file)), gpu) == {"teacher-plan"}
    auto = _keys(load_config(config_file, ["teacher.backend=gpu", "train.precision=auto"]))
    assert _changed(gpu, auto) == {"train", "evaluate-baseline", "evaluate", "evaluate-merged"}


def test_keys_follow_file_and_data_contents_not_paths(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file)
    before = _keys(cfg)
    assert _keys(load_config(config_file)) == before  # stable
    moved = shutil.copy(cfg.model.student, tmp_path / "elsewhere.gguf")
    assert _keys(load_config(config_file, [f"model.student={moved}"])) == before  # same bytes, other path
    (tmp_path / "moved").mkdir()
    moved_data = shutil.copy(cfg.data.path, tmp_path / "moved" / Path(cfg.data.path).name)
    assert _keys(load_config(config_file, [f"data.path={moved_data}"])) == before  # same bytes, other folder
    write_tiny_llama(Path(cfg.model.student), seed=7)  # new weights, same tokenizer
    assert _changed(before, _keys(load_config(config_file))) == {"tokenize", "student"}
    before = _keys(load_config(config_file))
    write_texts(Path(cfg.data.path), n_docs=12, seed=3)
    assert _changed(before, _keys(load_config(config_file))) == {"tokenize"}


def test_upstream_manifests_count_by_content(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file)
    before = _keys(cfg)
    moved = _upstream(where="/elsewhere/")  # every dir and path differs, the content does not
    assert _keys(cfg, moved) == before
    other_workdir = load_config(config_file, [f"run.workdir={tmp_path / 'moved'}"])
    assert _keys(other_workdir) == before  # a moved workdir with the same content keeps every key
    assert _changed(before, _keys(cfg, _upstream(shard="5"))) == {
        "train",
        "evaluate-baseline",
        "evaluate",
        "evaluate-merged",
    }
    assert _changed(before, _keys(cfg, _upstream(adapter="6"))) == {"evaluate", "export"}
    # a checkpoint counts by its adapter, not by the metrics (timings) its run recorded
    assert _keys(cfg, _upstream(metrics={"tokens_per_s": 3.0})) == before
    assert _changed(before, _keys(cfg, {**UPSTREAM, "epoch": 1})) == {"train"}


def test_content_refuses_bare_paths() -> None:
    with pytest.raises(TypeError, match="bare Path"):
        keys.content({"a": Path("x")})
    assert keys.content(_ref("a/b", "7")) == {"sha256": "7" * 64, "bytes": 10}
    assert "dir" not in keys.content(UPSTREAM["tokens"]) and "dir" in UPSTREAM["tokens"].model_dump()


def test_file_hash_is_memoised_by_path_size_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"abc")
    calls = []
    real = keys.sha256_file
    monkeypatch.setattr(keys, "sha256_file", lambda p: calls.append(p) or real(p))
    first = keys.file_sha256(f, tmp_path)
    assert first == real(f) and len(calls) == 1
    assert keys.file_sha256(f, tmp_path) == first and len(calls) == 1  # from <workdir>/.cache/sha256.json
    assert (tmp_path / ".cache" / "sha256.json").is_file()
    f.write_bytes(b"abd")  # same size, new mtime
    assert keys.file_sha256(f, tmp_path) == real(f) != first and len(calls) == 2


def test_stale_cached_result_is_recomputed_and_its_record_dropped(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(config_file)
    problem: list[str | None] = [None]
    node = Node("s", keys.StageKey(stage="s", inputs=("x",)), verify=lambda c, i, r: problem[0])
    policy = caching.StageCache(node=node)
    inputs = {"cfg": cfg, "x": _ref("a", "7")}
    records: dict[str, Any] = {}
    monkeypatch.setattr(caching, "get_result_store", lambda: None)
    monkeypatch.setattr(caching, "_load", lambda store, key: records.get(key))
    monkeypatch.setattr(caching, "_drop_record", lambda key: records.pop(key, None) is not None)
    monkeypatch.setattr("prefect.get_run_logger", lambda: __import__("logging").getLogger("t"))
    key = policy.compute_key(None, inputs, {})
    content_key = policy.key(cfg, inputs)
    # the record key names the result format; its digest is the content key that addresses the stage's folder
    assert key == f"s-typed-{content_key.removeprefix('s-')}" == record_key("s", content_key)
    problem[0] = "file gone"
    assert policy.compute_key(None, inputs, {}) == key  # nothing cached yet: compute and cache normally
    records[key] = "cached manifest"
    with caplog.at_level("WARNING", logger="t"):
        assert policy.compute_key(None, inputs, {}) == key  # cached, outputs broken: record dropped, runs again
    assert key not in records
    assert [r.getMessage() for r in caplog.records] == [
        "s: cached result not used (file gone): recomputing it and what depends on it"
    ]
    records[key] = "cached manifest"
    problem[0] = None
    assert policy.compute_key(None, inputs, {}) == key and key in records  # verified: a hit


def _written(root: Path, name: str, data: bytes) -> FileRef:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return FileRef.of(path.resolve(), root)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_outputs_problem_names_the_damaged_file(tmp_path: Path, damage: str) -> None:
    cfg = RunConfig.model_validate(tiny_config(tmp_path / "run"))
    root = tmp_path / "run"
    refs = [_written(root, f"export/a/{n}", bytes(range(256)) * 8) for n in ("adapter-lora.gguf", "merged.gguf")]
    exported = ExportManifest(dir="export/a", epoch=0, step=2, gguf_lora=refs[0], merged=refs[1])
    assert keys.outputs_problem(cfg, exported) is None
    victim = root / refs[1].path
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:1000])
    elif damage == "flip":
        blob = bytearray(victim.read_bytes())
        blob[700] ^= 0x01
        victim.write_bytes(bytes(blob))
    else:
        victim.unlink()
    problem = keys.outputs_problem(cfg, exported)
    expected = {"truncate": "size 1000 bytes, manifest says 2048", "flip": "sha256", "delete": "file missing"}
    assert problem is not None and str(victim) in problem and expected[damage] in problem


def test_memoised_hash_of_a_large_output_still_sees_a_rewrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above VERIFY_FULL_BYTES the hash comes from the memo (path, size, mtime): a rewrite changes the mtime."""
    monkeypatch.setattr(keys, "VERIFY_FULL_BYTES", 16)
    cfg = RunConfig.model_validate(tiny_config(tmp_path / "run"))
    ref = _written(tmp_path / "run", "student/a/student.gguf", b"x" * 64)
    student = StudentManifest(source_sha256="1" * 64, file=ref, requantized=True, tensor_types={})
    assert keys.outputs_problem(cfg, student) is None
    assert (tmp_path / "run" / keys.MEMO_FILE).is_file()
    (tmp_path / "run" / ref.path).write_bytes(b"y" * 64)
    assert "sha256" in (keys.outputs_problem(cfg, student) or "")


def test_token_split_metadata_is_checked(tmp_path: Path) -> None:
    """The datasets metadata next to the .arrow files is not hashed (it holds a random fingerprint) but must
    still load: state.json names exactly the manifest's files."""
    root = tmp_path / "run"
    cfg = RunConfig.model_validate(tiny_config(root))
    splits = {}
    for split in ("train", "eval"):
        ref = _written(root, f"tokens/a/{split}/data-00000-of-00001.arrow", b"arrow")
        (root / f"tokens/a/{split}/state.json").write_text(
            json.dumps({"_data_files": [{"filename": Path(ref.path).name}]})
        )
        (root / f"tokens/a/{split}/dataset_info.json").write_text(
            json.dumps({"features": {"input_ids": {}, "loss_mask": {}}})
        )
        splits[split] = TokenSplit(shards=(ref,), n_documents=1, n_sequences=1, n_positions=1)
    tokens = TokenizeManifest(
        dir="tokens/a", dataset_fingerprint="f", tokenizer_sha256="1" * 64, vocab_size=9, seq_len=8, **splits
    )
    assert keys.outputs_problem(cfg, tokens) is None
    (root / "tokens/a/eval/state.json").write_text('{"_data_files": [')
    assert "tokens/a/eval: unreadable datasets metadata" in (keys.outputs_problem(cfg, tokens) or "")
    (root / "tokens/a/eval/state.json").write_text(json.dumps({"_data_files": [{"filename": "other.arrow"}]}))
    assert "state.json: lists ['other.arrow']" in (keys.outputs_problem(cfg, tokens) or "")


def test_every_stage_manifest_lists_its_files() -> None:
    up = UPSTREAM
    assert up["tokens"].outputs() == (*up["tokens"].train.shards, *up["tokens"].eval.shards)
    assert up["student"].outputs() == (up["student"].file,)
    ck = up["checkpoint"]
    assert ck.outputs() == (ck.adapter, ck.optimizer, ck.state)
    ex = ExportManifest(dir="e", epoch=0, step=1, peft=(_ref("p/a", "1"), _ref("p/b", "2")), merged=_ref("m", "3"))
    assert [r.path for r in ex.outputs()] == ["p/a", "p/b", "m"]
    assert up["teacher"].outputs() == ()  # shards: verified with their top-k manifest rows (verify_shard)
