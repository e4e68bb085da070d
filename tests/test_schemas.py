"""Run config loading/validation, Arrow schema checks, manifest round trips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from model.config import LORA_TARGETS
from schemas import (
    LORA_TARGET_NAMES,
    QUANT_NAMES,
    TOKEN_SHARD_SCHEMA,
    TOPK_MANIFEST,
    CheckpointManifest,
    ConfigError,
    EvalManifest,
    ExportManifest,
    FileRef,
    ManifestError,
    RunConfig,
    RunSection,
    SchemaError,
    ShardRecord,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
    TokenSplit,
    check_token_shard,
    config_fingerprint,
    dump_config,
    load_config,
    topk_schema,
    validate_table,
)

REQUIRED = ["model.student=s.gguf", "model.teacher=t.gguf", "data.path=d.jsonl"]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, [*REQUIRED, *overrides])


def _write_yaml(tmp_path: Path, data: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------------------------- config


def test_every_section_default_validates():
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if field.is_required():
            continue
        default = section()  # validate_default: a default that fails its own validator raises here
        assert section.model_config.get("validate_default") is True, name
        # defaults survive the JSON round trip a deployment's parameters take (YAML/UI -> RunConfig)
        assert section.model_validate(default.model_dump(mode="json")) == default, name
    cfg = _cfg()
    assert cfg.lora.targets == tuple(LORA_TARGETS)
    assert cfg.lora.scale == cfg.lora.alpha / cfg.lora.r
    assert cfg.model.student_quant is None and cfg.export.merge_quant is None


def test_required_fields_named():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.student=s.gguf"])
    msg = str(info.value)
    assert "model.teacher: Field required" in msg and "data: Field required" in msg


def test_names_match_model_and_gguf():
    assert set(LORA_TARGET_NAMES) == set(LORA_TARGETS)
    for name in QUANT_NAMES:
        assert name in gguf.GGMLQuantizationType.__members__, name


def test_yaml_and_overrides(tmp_path):
    path = _write_yaml(
        tmp_path,
        {
            "model": {"student": "s.gguf", "teacher": "t.gguf", "student_quant": "q4_k,q4_0"},
            "data": {"path": "data/", "seq_len": 256},
            "lora": {"r": 4, "targets": ["v", "q"]},
            "optim": {"lr": "1e-4"},  # YAML 1.1 reads 1e-4 as a string; pydantic parses it
        },
    )
    cfg = load_config(path, ["lora.r=8", "lora.targets=[down,q]", "data.max_documents=null", "train.seed=7"])
    assert cfg.lora.r == 8 and isinstance(cfg.lora.r, int)
    assert cfg.lora.targets == ("q", "down")  # canonical order
    assert cfg.data.seq_len == 256 and cfg.data.max_documents is None
    assert cfg.data.path == tmp_path / "data" and cfg.model.student == tmp_path / "s.gguf"  # the file's folder
    assert cfg.train.seed == 7 and cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.model.student_quant == ("Q4_K", "Q4_0")
    assert load_config(path).lora.targets == ("q", "v")
    assert load_config(path, ["data.max_documents=10"]).data.max_documents == 10


def test_json_config_and_dump_round_trip(tmp_path):
    paths = [f"{key}={tmp_path / value}" for key, value in (o.split("=") for o in REQUIRED)]
    extra = [
        f"run.workdir={tmp_path / 'w'}",
        "lora.targets=all",
        "export.merge=true",
        "export.merge_quant=[Q6_K, Q8_0]",
        "optim.betas=[0.8,0.9]",
    ]
    cfg = load_config(None, [*paths, *extra])
    yml = tmp_path / "dumped.yaml"
    yml.write_text(dump_config(cfg))
    assert load_config(yml) == cfg
    js = tmp_path / "cfg.json"
    js.write_text(cfg.model_dump_json())
    assert load_config(js) == cfg
    assert load_config(js).optim.betas == (0.8, 0.9)


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        ("lora.r=-1", "lora.r: Input should be greater than or equal to 1 (got -1)"),
        ("lora.r=0", "lora.r: Input should be greater than or equal to 1 (got 0)"),
        ("teacher.top_k=0", "teacher.top_k: Input should be greater than or equal to 1"),
        ("teacher.top_k=300", "teacher.top_k: Input should be less than or equal to 256 (got 300)"),
        ("lora.targets=[q,qq]", "lora.targets[1]: Input should be 'q', 'k'"),
        ("lora.targets=[q,q]", "lora.targets: duplicate target"),
        ("lora.targets=[]", "lora.targets: give at least one target"),
        ("train.epochs=three", "train.epochs: Input should be a valid integer"),
        ("train.batch_size=2.5", "train.batch_size: Input should be a valid integer"),
        ("loss.kind=kl", "loss.kind: Input should be 'forward_kl', 'reverse_kl' or 'jsd'"),
        ("loss.beta=1.5", "loss.beta: Input should be less than or equal to 1"),
        ("teacher.temperature=0", "teacher.temperature: Input should be greater than 0"),
        ("loss.beta=0", None),
        (
            "loss.kind=jsd;loss.beta=0",
            "loss.beta: must be strictly between 0 and 1 for kind=jsd (at 0 or 1 the JSD vanishes) (got 0)",
        ),
        (
            "loss.kind=jsd;loss.beta=1.0",
            "loss.beta: must be strictly between 0 and 1 for kind=jsd (at 0 or 1 the JSD vanishes) (got 1.0)",
        ),
        ("loss.temperature=2", "loss.temperature: 2.0 differs from teacher.temperature 1.0"),
        ("loss.temperature=2;teacher.temperature=2", None),
        ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
        ("optim.betas=[0.9,1.0]", "optim.betas: each beta must be in [0, 1)"),
        ("data.eval_fraction=0", "data.eval_fraction: Input should be greater than 0"),
        ("model.student_quant=Q3_K", "model.student_quant[0]: Input should be 'F32'"),
        ("export.merge_quant=Q4_0", "export.merge_quant: set, but export.merge is false"),
        ("lora=5", "lora: Input should be a valid dictionary"),
        ("train.kept_blocks=-1", "train.kept_blocks: expected a number of blocks >= 0 or 'auto' (got -1)"),
        ("train.kept_blocks=all", "train.kept_blocks: expected a number of blocks >= 0 or 'auto' (got 'all')"),
        ("train.kept_blocks=true", "train.kept_blocks: a boolean where a number is expected (got True)"),
        ("train.kept_blocks=4", None),
        ("train.kept_blocks=auto", None),
    ],
)
def test_bad_value_names_field(override, expect):
    overrides = override.split(";")
    if expect is None:  # a near miss that is valid
        _cfg(*overrides)
        return
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    msg = str(info.value)
    assert expect in msg, msg
    assert msg.startswith("invalid config (no file):")
    assert len(msg.splitlines()) == 2  # exactly one error line: the other fields are fine
    if not expect.startswith(("export.merge_quant", "loss.temperature")):  # cross-field checks
        assert f"[--set {overrides[-1]}]" in msg


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        ("lora.rank=8", "unknown key 'lora.rank' (valid keys of lora: r, alpha, targets, layers, kind)"),
        ("lorra.r=8", "unknown key 'lorra.r' (valid keys of top level: model, data, teacher"),
        ("lora.r.x=1", "'lora.r' is a value, not a section"),
        ("lora.r", "expected key.sub=value"),
    ],
)
def test_bad_override_key(override, expect):
    with pytest.raises(ConfigError, match="--set") as info:
        _cfg(override)
    assert expect in str(info.value)


def test_yaml_typos_name_file_and_key(tmp_path):
    path = _write_yaml(
        tmp_path,
        {
            "model": {"student": "s.gguf", "teacher": "t.gguf"},
            "data": {"path": "d.jsonl"},
            "lorra": {"r": 8},
            "optim": {"learning_rate": 1e-3},
            "train": {"epochs": 0},
        },
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg.splitlines()[0]
    assert "lorra: unknown key (valid keys here: model, data, teacher" in msg
    assert "optim.learning_rate: unknown key (valid keys here: lr, weight_decay" in msg
    assert "train.epochs: Input should be greater than or equal to 1 (got 0)" in msg
    assert len(msg.splitlines()) == 4


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: cannot parse"):
        load_config(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json: top level must be a mapping"):
        load_config(lst)
    (tmp_path / "x.toml").write_text("")
    with pytest.raises(ConfigError, match="unknown config format '.toml'"):
        load_config(tmp_path / "x.toml")


def test_fingerprint_changes_iff_selected_field_changes():
    cfg = _cfg()
    fields = ["lora", "teacher.top_k", "loss.kind", "data.seq_len"]
    base = config_fingerprint(cfg, fields)
    assert base == config_fingerprint(cfg, list(reversed(fields)))  # order-free
    assert re.fullmatch(r"[0-9a-f]{64}", base), base  # sha256 hex, the form cache keys embed
    changed = [
        ("lora.r=8", True),
        ("lora.targets=[q,v]", True),
        ("lora.alpha=16", True),
        ("teacher.top_k=64", True),
        ("loss.kind=jsd", True),
        ("data.seq_len=256", True),
        ("teacher.shard_tokens=1000", False),
        ("loss.beta=0.1", False),
        ("train.seed=3", False),
        ("run.workdir=elsewhere", False),
        ("lora.targets=[v,k,q,o,gate,up,down]", False),  # same set -> canonical order -> same value
        ("lora.r=16", False),  # the default, written out
    ]
    for override, should_change in changed:
        fp = config_fingerprint(_cfg(override), fields)
        assert (fp != base) == should_change, override
    assert config_fingerprint(cfg, ["teacher.top_k"]) != config_fingerprint(cfg, ["train.batch_size"])
    with pytest.raises(ConfigError, match="teacher.topk"):
        config_fingerprint(cfg, ["teacher.topk"])


def _walk_properties(schema: dict, where: str, out: list[str]) -> None:
    for name, prop in schema.get("properties", {}).items():
        if not prop.get("description"):
            out.append(f"{where}.{name}")


def test_json_schema_describes_every_field():
    schema = RunConfig.model_json_schema()
    missing: list[str] = []
    _walk_properties(schema, "RunConfig", missing)
    defs = schema["$defs"]
    for name, sub in defs.items():
        _walk_properties(sub, name, missing)
    assert not missing, missing
    # every section is reachable and has fields (the walk did look at them)
    n_fields = sum(len(sub.get("properties", {})) for sub in defs.values())
    assert n_fields >= 40 and len(defs) >= 10
    assert defs["LoraSection"]["additionalProperties"] is False


def test_config_frozen_and_helpers(tmp_path):
    cfg = _cfg("optim.lr=1e-3", f"run.workdir={tmp_path}")
    with pytest.raises(ValidationError):
        cfg.lora.r = 3
    assert cfg.eval.higher_is_better is False
    assert _cfg("eval.best_metric=top1").eval.higher_is_better is True
    assert cfg.run.tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert _cfg("run.mlflow_uri=http://x:5000").run.tracking_uri() == "http://x:5000"
    assert _cfg("train.batch_size=4", "train.grad_accum=3").train.sequences_per_step == 12


# ----------------------------------------------------------------------------------------------- arrow


def _token_table(n_ids=(3, 5), n_mask=None) -> pa.Table:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 300, n).tolist() for n in n_ids]
    masks = [[1] * n for n in (n_ids if n_mask is None else n_mask)]
    return pa.table(
        {"input_ids": ids, "loss_mask": masks, "doc_id": [0, 1], "seq_id": [0, 1]}, schema=TOKEN_SHARD_SCHEMA
    )


def test_token_shard_validates_and_round_trips(tmp_path):
    table = _token_table()
    path = tmp_path / "tokens.parquet"
    pq.write_table(table, path)
    read = pq.read_table(path)
    validate_table(read, TOKEN_SHARD_SCHEMA, str(path))
    check_token_shard(read, str(path), seq_len=5)
    with pytest.raises(SchemaError, match="longer than seq_len=4"):
        check_token_shard(read, str(path), seq_len=4)
    with pytest.raises(SchemaError, match=r"tokens.arrow: column 'loss_mask' row 1 has length 2"):
        check_token_shard(_token_table(n_mask=(3, 2)), "tokens.arrow")


def test_validate_table_catches_wrong_type_and_columns():
    good = _token_table()
    wrong = good.set_column(0, "input_ids", good.column("input_ids").cast(pa.list_(pa.int64())))
    with pytest.raises(SchemaError, match=r"shard_0.arrow: column 'input_ids' has type list<item: int64>"):
        validate_table(wrong, TOKEN_SHARD_SCHEMA, "shard_0.arrow")
    with pytest.raises(SchemaError, match=r"s.arrow: missing column\(s\) \['seq_id'\]"):
        validate_table(good.drop_columns(["seq_id"]), TOKEN_SHARD_SCHEMA, "s.arrow")
    with pytest.raises(SchemaError, match=r"unexpected column\(s\) \['extra'\]"):
        validate_table(good.append_column("extra", pa.array([1, 2])), TOKEN_SHARD_SCHEMA, "s.arrow")
    reordered = good.select(["loss_mask", "input_ids", "doc_id", "seq_id"])
    with pytest.raises(SchemaError, match="columns in order"):
        validate_table(reordered, TOKEN_SHARD_SCHEMA, "s.arrow")
    nulls = good.set_column(2, "doc_id", pa.array([None, 1], pa.int64()))
    with pytest.raises(SchemaError, match="column 'doc_id' has 1 null"):
        validate_table(nulls, TOKEN_SHARD_SCHEMA, "s.arrow")


@pytest.mark.parametrize(("vocab", "id_type"), [(300, pa.uint16()), (65536, pa.uint16()), (65537, pa.uint32())])
def test_topk_schema_parquet_round_trip(tmp_path, vocab, id_type):
    k, n = 4, 3
    schema = topk_schema(vocab, k)
    assert schema.field("ids").type == pa.list_(id_type, k)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, (n, k)).astype(id_type.to_pandas_dtype())
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(k + 1), n)[:, :k]), axis=1)[:, ::-1].astype(np.float16)
    table = pa.table(
        {
            "seq_id": pa.array([0, 0, 1], pa.int64()),
            "pos": pa.array([0, 1, 0], pa.int32()),
            "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), k),
            "logprobs": pa.FixedSizeListArray.from_arrays(pa.array(logprobs.ravel()), k),
            "tail": pa.array(np.full(n, 0.125, np.float32)),
        },
        schema=schema,
    )
    path = tmp_path / "topk_00000.parquet"
    pq.write_table(table, path, compression="zstd")
    read = pq.read_table(path)
    validate_table(read, schema, str(path))
    np.testing.assert_array_equal(np.stack(read.column("ids").to_numpy(zero_copy_only=False)), ids)
    with pytest.raises(SchemaError, match="column 'ids' has type fixed_size_list"):
        validate_table(read, topk_schema(vocab, k + 1), str(path))
    other = pa.uint32() if id_type == pa.uint16() else pa.uint16()
    with pytest.raises(SchemaError, match=f"column 'ids' has type .*{id_type}.*expected .*{other}"):
        validate_table(read, topk_schema(300 if other == pa.uint16() else 70000, k), str(path))


def test_topk_schema_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        topk_schema(100, 0)
    with pytest.raises(ValueError, match="k must be"):
        topk_schema(100, 101)


# ----------------------------------------------------------------------------------------------- manifests


def _ref(tmp_path: Path, name: str, payload: bytes) -> FileRef:
    (tmp_path / name).write_bytes(payload)
    return FileRef.of(name, root=tmp_path)


def test_manifests_round_trip_through_json(tmp_path):
    ref = _ref(tmp_path, "a.bin", b"abc")
    assert ref.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad" and ref.bytes == 3
    split = TokenSplit(shards=(ref,), n_documents=2, n_sequences=3, n_positions=40)
    tok = TokenizeManifest(
        dataset_fingerprint="fp",
        tokenizer_sha256=ref.sha256,
        vocab_size=300,
        seq_len=16,
        train=split,
        eval=split,
    )
    shard = ShardRecord(
        shard=0, file="topk_00000.parquet", split="train", seq_start=0, seq_end=3, n_positions=40,
        sha256=ref.sha256, complete=True,
    )  # fmt: skip
    manifests = [
        tok,
        StudentManifest(source_sha256=ref.sha256, file=ref, requantized=True, tensor_types={"Q4_K": 2, "F32": 3}),
        TeacherManifest(
            teacher_sha256=ref.sha256,
            k=4,
            temperature=1.0,
            vocab_size=300,
            token_shards_hash=tok.shards_hash(),
            shards=(shard,),
        ),  # fmt: skip
        CheckpointManifest(epoch=1, step=10, adapter=ref, optimizer=ref, state=ref, metrics={"loss": float("nan")}),
        EvalManifest(epoch=None, step=None, kl=0.5, top1=0.7, ce=3.0, ppl=float(np.exp(3.0)), n_positions=40),
        ExportManifest(epoch=1, step=10, peft=(ref, ref), gguf_lora=ref, merged=None),
    ]
    for manifest in manifests:
        text = manifest.model_dump_json()
        json.loads(text)  # plain JSON (NaN is a JSON constant Python reads)
        back = type(manifest).model_validate_json(text)
        assert back.model_dump_json() == text
        if not isinstance(manifest, CheckpointManifest):  # nan != nan
            assert back == manifest
    # the Arrow manifest row and ShardRecord agree on fields
    assert list(ShardRecord.model_fields) == TOPK_MANIFEST.names
    table = pa.Table.from_pylist([shard.model_dump()], schema=TOPK_MANIFEST)
    assert ShardRecord.model_validate(table.to_pylist()[0]) == shard
    assert manifests[4].metric("top1") == 0.7


def test_manifest_validation_and_verify(tmp_path):
    ref = _ref(tmp_path, "w.bin", b"\x00" * 10)
    with pytest.raises(ValidationError, match="sha256"):
        FileRef(path="x", sha256="abc", bytes=1)
    with pytest.raises(ValidationError, match="extra"):
        FileRef(path="x", sha256=ref.sha256, bytes=1, size=1)
    with pytest.raises(ValidationError):
        ref.bytes = 3
    assert ref.verify(tmp_path) == tmp_path / "w.bin"
    (tmp_path / "w.bin").write_bytes(b"\x01" * 10)
    with pytest.raises(ManifestError, match="w.bin: sha256"):
        ref.verify(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"\x00" * 9)
    with pytest.raises(ManifestError, match="size 9 bytes"):
        ref.verify(tmp_path)
    with pytest.raises(ManifestError, match="missing"):
        ref.verify(tmp_path / "nowhere")
    absolute = FileRef.of(tmp_path / "w.bin", root=tmp_path)
    assert absolute.path == "w.bin"
    teacher = TeacherManifest(
        teacher_sha256=ref.sha256, k=4, temperature=1.0, vocab_size=300, token_shards_hash=ref.sha256,
        shards=(
            ShardRecord(shard=0, file="a", split="eval", seq_start=0, seq_end=1, n_positions=1,
                        sha256=ref.sha256, complete=True),
            ShardRecord(shard=1, file="b", split="eval", seq_start=1, seq_end=2, n_positions=1,
                        sha256=ref.sha256, complete=False),
        ),
    )  # fmt: skip
    assert teacher.complete is False


def test_tracking_uri_prefers_config_then_environment_then_workdir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = RunSection(workdir=tmp_path)
    assert run.tracking_uri() == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert run.tracking_uri() == "http://127.0.0.1:5000"
    assert RunSection(workdir=tmp_path, mlflow_uri="http://team:5000").tracking_uri() == "http://team:5000"


# ---------------------------------------------------------------------------------------------- strict parsing


def test_duplicate_keys_are_errors_naming_file_key_and_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  student: s.gguf\n  teacher: t.gguf\nlora:\n  r: 4\ndata:\n  path: d\nlora:\n  r: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: line 8: duplicate key 'lora' (first at line 4); a key may appear once in a section"
    )
    js = tmp_path / "run.json"
    js.write_text('{"lora": {"r": 4, "r": 64}}')
    with pytest.raises(ConfigError, match=f"{js}: duplicate key 'r'"):
        load_config(js)
    with pytest.raises(ConfigError, match="duplicate key 'r'"):
        load_config(None, [*REQUIRED, "lora={r: 1, r: 2}"])


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("train.epochs=yes", "train.epochs: Input should be a valid integer"),
        ("lora.alpha=on", "lora.alpha: Input should be a valid number"),
        ("train.epochs=true", "train.epochs: a boolean where a number is expected"),
        ("data.max_documents=false", "data.max_documents: a boolean where a number is expected"),
    ],
)
def test_yaml_11_booleans_are_not_numbers(override, says):
    with pytest.raises(ConfigError, match=says):
        _cfg(override)


def test_yaml_12_scalars():
    cfg = _cfg("run.experiment=2024-01-01", "run.run_name=2024", "optim.lr=2e-4", "lora.r=010", "data.pack=false")
    assert cfg.run.experiment == "2024-01-01" and cfg.run.run_name == "2024"  # strings, not a date or an int
    assert cfg.optim.lr == 2e-4 and cfg.lora.r == 10 and cfg.data.pack is False
    assert _cfg("run.experiment=yes").run.experiment == "yes"
    assert _cfg("lora.r=0x10").lora.r == 16 and _cfg("optim.eps=1e-6").optim.eps == 1e-6


def test_relative_paths_in_a_file_are_relative_to_its_folder(tmp_path, monkeypatch):
    sub = tmp_path / "configs"
    sub.mkdir()
    files = {"model": {"student": "../m/s.gguf", "teacher": "/abs/t.gguf"}, "data": {"path": "d.jsonl"}}
    _write_yaml(sub, files)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("configs/run.yaml"), ["data.eval_path=e.jsonl"])
    assert cfg.model.student == tmp_path / "m" / "s.gguf" and cfg.model.teacher == Path("/abs/t.gguf")
    assert cfg.data.path == sub / "d.jsonl" and cfg.run.workdir == Path("runs/default")  # default: cwd
    assert cfg.data.eval_path == tmp_path / "e.jsonl"  # an override: relative to the current directory
    assert load_config(Path("configs/run.yaml"), ["data.path=d.txt"]).data.path == tmp_path / "d.txt"
