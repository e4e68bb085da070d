"""Bad inputs through the real CLI (subprocesses): hostile and unsupported GGUFs, bad or empty data, wrong field
names, absurd values, a corrupt Parquet file, NaN teacher weights, an unwritable workdir, a GPU buffer above the
adapter's binding limit. Each must end in one line `error: ...` naming the file and the config field, with no
traceback anywhere in the output, a non-zero exit status, and nothing marked complete (no stage record of the
stage that failed, no remembered run). Broken stage outputs, by contrast, are not errors: the run rebuilds them
(the last rows). The test writes docs/reliability.md: the table of cases, the error shown and the exit status.

Cases refused by the preflight cost an interpreter start each; those that fail inside a stage run the flow on
the session's Prefect test server; the recoveries start from a copy of the session's reference run. Cases run
three at a time.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType as Q

from data import records
from data.records import DataError, load_records
from model import reference as R
from model.config import ModelConfig
from model.gguf import llama_metadata, write_gguf
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
    tiny_config,
    tiny_inputs,
    tokenizer_metadata,
    write_tiny_llama,
)
from tests.test_security import json_record, pickle_record

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "reliability.md"


@dataclass
class Ctx:
    """Where a case writes its files; `config(**sections)` writes a config with its own workdir."""

    dir: Path
    name: str

    @property
    def workdir(self) -> Path:
        return self.dir / "run"

    def config(self, **sections: dict[str, Any]) -> Path:
        cfg = tiny_config(self.workdir, train={"max_steps_per_epoch": 2}, **sections)
        path = self.dir / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def file(self, name: str, text: str | bytes) -> Path:
        path = self.dir / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path


@dataclass
class Case:
    """One bad input: `build(ctx)` writes what it needs and returns the CLI arguments; the error line must
    contain every phrase of `expect(ctx)` (the config field and the file). `stage`: the stage that fails, as its
    records are named (none of them may exist), None when the preflight refuses it (no stage record at all)."""

    name: str
    build: Callable[[Ctx], list[str]]
    expect: Callable[[Ctx], list[str]]
    stage: str | None = None
    fault: str | None = None  # DISTILLERY_FAULT for the run (tasks/faults.py), e.g. a full disk at a write


def _model(path: Path, *, vocab_extra: tuple[str, ...] = (), meta: dict | None = None, drop: tuple[str, ...] = (),
           qtype: dict[str, Any] | None = None, nan: bool = False) -> Path:  # fmt: skip
    """A tiny llama GGUF like the fixtures', with metadata changed, keys dropped, tensors of other types."""
    md = tokenizer_metadata(vocab_extra)
    mcfg = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=len(md["tokenizer.ggml.tokens"]),
                       context_length=64)  # fmt: skip
    md.update(llama_metadata(mcfg, name="tiny-llama"))
    md.update(meta or {})
    for key in drop:
        md.pop(key, None)
    weights = R.random_weights(mcfg, seed=1, dtype=np.float32)
    if nan:
        weights["output_norm.weight"] = np.full_like(weights["output_norm.weight"], np.nan)

    def tensors() -> Any:
        for name, w in weights.items():
            if qtype and name in qtype:
                yield name, *qtype[name]
            else:
                yield name, w, Q.F32

    write_gguf(path, str(md.pop("general.architecture", "llama")), md, tensors())
    return path


def _iq4_nl(ctx: Ctx) -> list[str]:
    rows = np.zeros((32, 18), np.uint8)  # 32 rows of one IQ4_NL block (32 values in 18 bytes)
    student = _model(ctx.dir / "iq4nl.gguf", qtype={"blk.0.attn_q.weight": (rows, Q.IQ4_NL)})
    return ["run", str(ctx.config(model={"student": str(student)}))]


def _patched(ctx: Ctx, name: str, at: Callable[[bytes], int], value: bytes) -> Path:
    good = (tiny_inputs() / "teacher-f32.gguf").read_bytes()
    pos = at(good)
    return ctx.file(name, good[:pos] + value + good[pos + len(value) :])


def _n_tensors_pos(data: bytes) -> int:
    return 8  # magic (4) + version (4), then n_tensors (u64)


def _texts(ctx: Ctx, lines: list[str], name: str = "data.jsonl") -> Path:
    return ctx.file(name, "\n".join(lines) + "\n")


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _run_with(**sections: dict[str, Any]) -> Callable[[Ctx], list[str]]:
    return lambda ctx: ["run", str(ctx.config(**sections))]


def _set(*overrides: str, command: str = "run") -> Callable[[Ctx], list[str]]:
    def build(ctx: Ctx) -> list[str]:
        args = [command, str(ctx.config())]
        for item in overrides:
            args += ["--set", item]
        return args

    return build


def _config_path(ctx: Ctx) -> str:
    return str(ctx.dir / "config.yaml")


def _data(ctx: Ctx, name: str) -> str:
    return str(ctx.dir / name)


CASES: list[Case] = [
    # --- the config: wrong field names, wrong types, absurd values
    Case("unknown field (--set)", _set("lora.rank=8"), lambda c: ["lora.rank", _config_path(c)]),
    Case(
        "unknown field in the file",
        lambda c: ["run", str(c.file("config.yaml", yaml.safe_dump({**tiny_config(c.workdir), "lora": {"rank": 8}})))],
        lambda c: ["lora.rank", _config_path(c)],
    ),
    Case("wrong type", _set("lora.r=eight"), lambda c: ["lora.r", _config_path(c)]),
    Case("rank 0", _set("lora.r=0"), lambda c: ["lora.r", _config_path(c)]),
    Case("negative learning rate", _set("optim.lr=-1"), lambda c: ["optim.lr", _config_path(c)]),
    Case("NaN learning rate", _set("optim.lr=.nan"), lambda c: ["optim.lr", _config_path(c)]),
    Case("eval fraction 1.5", _set("data.eval_fraction=1.5"), lambda c: ["data.eval_fraction", _config_path(c)]),
    Case("unknown LoRA target", _set("lora.targets=[qq]"), lambda c: ["lora.targets", _config_path(c)]),
    Case("override without a value", _set("lora.r"), lambda c: ["lora.r", _config_path(c)]),
    Case("top-k above the vocabulary", _set("teacher.top_k=100000"), lambda c: ["teacher.top_k", "vocabulary"]),
    Case("LoRA layer outside the model", _set("lora.layers=[7]"), lambda c: ["lora.layers", "blocks 0..1"]),
    Case(
        "sequence longer than the context",
        _set("data.seq_len=4096"),
        lambda c: ["data.seq_len", str(tiny_inputs() / "teacher-f32.gguf")],
    ),
    Case("run name a path (../../x)", _set("run.run_name=../../x"), lambda c: ["run.run_name", _config_path(c)]),
    Case("run name absolute", _set("run.run_name=/tmp/x"), lambda c: ["run.run_name", "not a path"]),
    Case(
        "duplicate section in the file",
        lambda c: ["run", str(c.file("config.yaml", yaml.safe_dump(tiny_config(c.workdir)) + "lora:\n  r: 64\n"))],
        lambda c: [_config_path(c), "duplicate key 'lora'", "first at line"],
    ),
    Case(
        "duplicate key in a section",
        lambda c: [
            "run",
            str(c.file("config.yaml", yaml.safe_dump(tiny_config(c.workdir)).replace("lora:\n", "lora:\n  r: 64\n"))),
        ],
        lambda c: [_config_path(c), "duplicate key 'r'"],
    ),
    Case("YAML 1.1 boolean as a number (epochs=yes)", _set("train.epochs=yes"), lambda c: ["train.epochs", "'yes'"]),
    Case("YAML 1.1 boolean as a number (alpha=on)", _set("lora.alpha=on"), lambda c: ["lora.alpha", "'on'"]),
    Case("boolean as a number (epochs=true)", _set("train.epochs=true"), lambda c: ["train.epochs", "a boolean"]),
    Case(
        "relative data path (relative to the config file)",
        lambda c: ["run", str(c.config(data={"path": "nope.jsonl"}))],
        lambda c: ["data.path", str(c.dir / "nope.jsonl")],
    ),
    Case("config file missing", lambda c: ["run", str(c.dir / "nope.yaml")], lambda c: [str(c.dir / "nope.yaml")]),
    Case(
        "config file not YAML",
        lambda c: ["run", str(c.file("config.yaml", "lora: [r: 8\n  - {"))],
        lambda c: [_config_path(c), "cannot parse"],
    ),
    # --- model files: missing, not GGUF, hostile, unsupported
    Case(
        "student file missing",
        lambda c: ["run", str(c.config(model={"student": str(c.dir / "nope.gguf")}))],
        lambda c: ["model.student", str(c.dir / "nope.gguf")],
    ),
    Case(
        "teacher not a GGUF",
        lambda c: ["run", str(c.config(model={"teacher": str(c.file("t.gguf", '{"text": "hello"}\n'))}))],
        lambda c: ["model.teacher", str(c.dir / "t.gguf")],
    ),
    Case(
        "GGUF header cut short",
        lambda c: ["run", str(c.config(model={"teacher": str(c.file("cut.gguf", b"GGUF\x03\0\0\0" + b"\0" * 9))}))],
        lambda c: ["model.teacher", str(c.dir / "cut.gguf")],
    ),
    Case(
        "GGUF tensor data cut short",
        lambda c: [
            "run",
            str(
                c.config(
                    model={
                        "student": str(c.file("short.gguf", (tiny_inputs() / "teacher-f32.gguf").read_bytes()[:60000]))
                    }
                )
            ),
        ],
        lambda c: ["model.student", str(c.dir / "short.gguf")],
    ),
    Case(
        "GGUF with 2^40 tensors",
        lambda c: [
            "run",
            str(c.config(model={"student": str(_patched(c, "many.gguf", _n_tensors_pos, struct.pack("<Q", 1 << 40)))})),
        ],
        lambda c: ["model.student", str(c.dir / "many.gguf")],
    ),
    Case(
        "an IQ4_NL tensor (unsupported type)", _iq4_nl, lambda c: ["model.student", str(c.dir / "iq4nl.gguf"), "IQ4_NL"]
    ),
    Case(
        "unknown architecture",
        lambda c: [
            "run",
            str(c.config(model={"student": str(_model(c.dir / "arch.gguf", meta={"general.architecture": "mamba"}))})),
        ],
        lambda c: ["model.student", str(c.dir / "arch.gguf"), "mamba"],
    ),
    Case(
        "GGUF without a tokenizer",
        lambda c: [
            "run",
            str(c.config(model={"teacher": str(_model(c.dir / "notok.gguf", drop=("tokenizer.ggml.tokens",)))})),
        ],
        lambda c: ["model.teacher", str(c.dir / "notok.gguf")],
    ),
    Case(
        "teacher and student vocabularies differ",
        lambda c: [
            "run",
            str(c.config(model={"student": str(write_tiny_llama(c.dir / "other.gguf", extra_tokens=("qqq",)))})),
        ],
        lambda c: ["model.student", str(c.dir / "other.gguf"), "first difference"],
    ),
    Case(
        "teacher weights NaN (NaN/Inf logprobs)",
        lambda c: ["run", str(c.config(model={"teacher": str(_model(c.dir / "nan.gguf", nan=True))}))],
        lambda c: ["model.teacher", str(c.dir / "nan.gguf")],
        stage="teacher-shard",
    ),
    # --- data: missing, empty, malformed, wrong field names, corrupt Parquet
    Case(
        "data path missing",
        lambda c: ["run", str(c.config(data={"path": str(c.dir / "nope.jsonl")}))],
        lambda c: ["data.path", str(c.dir / "nope.jsonl")],
    ),
    Case(
        "empty data file",
        lambda c: ["run", str(c.config(data={"path": str(c.file("data.jsonl", ""))}))],
        lambda c: ["data.path", _data(c, "data.jsonl")],
        stage="tokenize",
    ),
    Case(
        "malformed JSON line",
        lambda c: ["run", str(c.config(data={"path": str(_texts(c, ['{"text": "a b c."}', '{"text": "unclosed']))}))],
        lambda c: ["data.path", _data(c, "data.jsonl"), "line 2"],
        stage="tokenize",
    ),
    Case(
        "data file in latin-1 (not UTF-8) on line 2",
        lambda c: [
            "run",
            str(
                c.config(
                    data={"path": str(c.file("data.jsonl", '{"text": "a b"}\n{"text": "caf\xe9"}\n'.encode("latin-1")))}
                )
            ),
        ],
        lambda c: ["data.path", _data(c, "data.jsonl"), "line 2", "not UTF-8"],
        stage="tokenize",
    ),
    Case(
        "data file in UTF-16",
        lambda c: [
            "run",
            str(c.config(data={"path": str(c.file("data.jsonl", '{"text": "a b"}\n'.encode("utf-16")))})),
        ],
        lambda c: ["data.path", _data(c, "data.jsonl"), "UTF-16"],
        stage="tokenize",
    ),
    Case(
        "wrong text field name",
        lambda c: ["run", str(c.config(data={"path": str(tiny_inputs() / "texts.jsonl"), "text_field": "body"}))],
        lambda c: ["data.text_field", str(tiny_inputs() / "texts.jsonl")],
        stage="tokenize",
    ),
    Case(
        "chat record with an unknown role",
        lambda c: [
            "run",
            str(
                c.config(
                    data={"path": str(_texts(c, [json.dumps({"messages": [{"role": "wizard", "content": "hi"}]})]))}
                )
            ),
        ],
        lambda c: ["data", _data(c, "data.jsonl"), "wizard"],
        stage="tokenize",
    ),
    Case(
        "corrupt Parquet data file",
        lambda c: [
            "run",
            str(c.config(data={"path": str(c.file("data.parquet", b"PAR1" + bytes(range(200)) + b"PAR1"))})),
        ],
        lambda c: ["data.path", _data(c, "data.parquet")],
        stage="tokenize",
    ),
    Case(
        "held-out data is the training data",
        lambda c: ["run", str(c.config(data={"eval_path": str(tiny_inputs() / "texts.jsonl")}))],
        lambda c: ["data.eval_path", str(tiny_inputs() / "texts.jsonl"), "held-out data must be other documents"],
    ),
    Case(
        "held-out data is the training data (through a symlink)",
        lambda c: [
            "run",
            str(c.config(data={"eval_path": str(_symlink(c.dir / "eval.jsonl", tiny_inputs() / "texts.jsonl"))})),
        ],
        lambda c: ["data.eval_path", str(c.dir / "eval.jsonl")],
    ),
    # --- where it runs
    Case(
        "disk full while writing a checkpoint",
        _set(),
        lambda c: ["epoch-000/adapter.safetensors: cannot write: No space left on device", "[Errno 28]"],
        stage="train",
        fault="write=epoch-000/adapter.safetensors:enospc",
    ),
    Case(
        "workdir not writable (under a file)",
        lambda c: ["run", str(c.config(run={"workdir": str(c.file("plain-file", "x") / "run")}))],
        lambda c: ["run.workdir", str(c.dir / "plain-file")],
    ),
    Case(
        "GPU buffer above the binding limit",
        _set("train.backend=gpu", "train.batch_size=6000", command="train"),
        lambda c: ["train.batch_size", "binding", str(c.workdir / "student")],
        stage="train",
    ),
]


@dataclass
class Recovery:
    """A finished run's output damaged by `damage(workdir, summary)`: the rerun exits 0, says which file in one
    warning line (containing `says`) and recomputes exactly `ran`."""

    name: str
    damage: Callable[[Path, dict[str, Any]], None]
    says: str
    ran: list[str]
    absent: str | None = None  # a file (relative to the workdir) that must not exist after the rerun


def _checkpoint_dir(wd: Path, s: dict[str, Any], epoch: int) -> Path:
    return wd / s["checkpoints"][epoch]["dir"]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def _export_record(wd: Path) -> Path:
    (record,) = (wd / ".prefect" / "results").glob("export-typed-*")
    return record


RECOVERIES = [
    Recovery(
        "stage record naming pickle (a payload that creates a file)",
        lambda wd, s: _export_record(wd).write_bytes(pickle_record(wd / "pwned")),
        "names the 'pickle' serializer",
        ["export"],
        absent="pwned",
    ),
    Recovery(
        "stage record holding a plain dict",
        lambda wd, s: _export_record(wd).write_bytes(json_record(json.dumps({"dir": "export"}))),
        "holds a plain object",
        ["export"],
    ),
    Recovery(
        "checkpoint missing (epoch 1's folder deleted)",
        lambda wd, s: shutil.rmtree(_checkpoint_dir(wd, s, 1)),
        "adapter.safetensors: file missing",
        ["train-epoch-1"],
    ),
    Recovery(
        "exported GGUF LoRA truncated",
        lambda wd, s: _truncate(wd / s["files"]["gguf_lora"]),
        "adapter-lora.gguf: size 1000 bytes",
        ["export"],
    ),
]


def _records(workdir: Path) -> list[str]:
    results = workdir / ".prefect" / "results"
    return sorted(p.name for p in results.iterdir()) if results.is_dir() else []


@dataclass
class Outcome:
    case: Case | Recovery
    code: int
    output: str
    error: str
    workdir: Path


def _run_case(case: Case, root: Path, api_url: str) -> Outcome:
    ctx = Ctx(root / re.sub(r"[^a-z0-9]+", "-", case.name.lower()).strip("-"), case.name)
    ctx.dir.mkdir(parents=True)
    args = case.build(ctx)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
    env.update(PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="80")
    env.update({"DISTILLERY_FAULT": case.fault} if case.fault else {})
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    return Outcome(case, proc.returncode, output, errors[-1] if errors else "", ctx.workdir)


def _recover(item: Recovery, root: Path, api_url: str, reference: tuple[dict, dict]) -> Outcome:
    """Copy the reference run's workdir (without its MLflow store), damage it, rerun the CLI on the copy."""
    cfg, summary = reference
    ctx = Ctx(root / re.sub(r"[^a-z0-9]+", "-", item.name.lower()).strip("-"), item.name)
    shutil.copytree(
        summary["workdir"], ctx.workdir, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", "*.lock")
    )
    item.damage(ctx.workdir, summary)
    config = ctx.file("config.yaml", yaml.safe_dump({**cfg, "run": {**cfg["run"], "workdir": str(ctx.workdir)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
    env.update(PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="80")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(config)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    said = [line for line in output.splitlines() if "cached result not used" in line]
    return Outcome(item, proc.returncode, output, said[0].split(" - ", 1)[-1] if said else "", ctx.workdir)


@pytest.fixture(scope="module")
def outcomes(
    prefect_harness: None, reference_run: tuple[dict, dict], tmp_path_factory: pytest.TempPathFactory
) -> list[Outcome]:
    import prefect.settings as ps

    api_url = str(ps.PREFECT_API_URL.value())
    root = tmp_path_factory.mktemp("bad-inputs")
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = list(pool.map(lambda case: _run_case(case, root, api_url), CASES))
        done += list(pool.map(lambda item: _recover(item, root, api_url, reference_run), RECOVERIES))
    _write_report(done, {str(root): "<tmp>", str(tiny_inputs()): "<inputs>"})
    return done


def _write_report(done: list[Outcome], short: dict[str, str]) -> None:
    def cell(text: str) -> str:
        for long, name in short.items():
            text = text.replace(long, name)
        return text.replace("|", "\\|")

    errors = [o for o in done if isinstance(o.case, Case)]
    lines = [
        "# Reliability: bad inputs through the CLI",
        "",
        "Generated by `tests/test_bad_inputs.py` (every `make test`): each case runs `python -m flows.cli ...` in a",
        "subprocess. Every bad input ends in one line naming the file and the config field, no traceback, a",
        "non-zero exit status, and nothing marked complete. `<tmp>` is the test's temporary folder, `<inputs>` the",
        "tiny model and texts of tests/pipeline_fixtures.py.",
        "",
        f"{len(errors)} bad inputs:",
        "",
        "| case | error shown | exit code |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(o.case.name)} | {cell(o.error.removeprefix('error: '))} | {o.code} |" for o in errors]
    lines += [
        "",
        f"{len(done) - len(errors)} broken outputs of a finished run, which are not errors: the rerun says which file "
        "in one warning line and recomputes that stage (the same bytes as before):",
        "",
        "| case | warning shown | exit code |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(o.case.name)} | {cell(o.error)} | {o.code} |" for o in done if isinstance(o.case, Recovery)]
    REPORT.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_naming_file_and_field(outcomes: list[Outcome], case: Case) -> None:
    o = next(o for o in outcomes if o.case is case)
    assert o.code != 0, o.output[-3000:]
    assert "Traceback" not in o.output, o.output[-3000:]
    assert o.error, o.output[-3000:]
    assert o.output.rstrip().endswith(o.error.rstrip()), o.output[-1500:]  # the last thing shown
    for phrase in case.expect(Ctx(o.workdir.parent, case.name)):
        assert phrase in o.error, (phrase, o.error)
    records = _records(o.workdir)
    if case.stage is None:
        assert records == [], records  # refused before any stage
    else:
        assert not [r for r in records if r.startswith(f"{case.stage}-typed-")], records
    assert not list((o.workdir / ".cache" / "runs").glob("*.json"))  # no run remembered as complete


@pytest.mark.parametrize("item", RECOVERIES, ids=[r.name for r in RECOVERIES])
def test_broken_output_is_rebuilt_with_one_warning_line(outcomes: list[Outcome], item: Recovery) -> None:
    o = next(o for o in outcomes if o.case is item)
    assert o.code == 0, o.output[-3000:]
    assert item.says in o.error and str(o.workdir) in o.error, o.error
    assert o.output.count("cached result not used") == 1, o.output[-3000:]
    assert f"ran: {', '.join(item.ran)}\n" in o.output, o.output[-1500:]
    assert item.absent is None or not (o.workdir / item.absent).exists()


def test_report_lists_every_case(outcomes: list[Outcome]) -> None:
    text = REPORT.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == len(CASES) + len(RECOVERIES) and f"{len(CASES)} bad inputs:" in text
    assert "<tmp>/" in text and "/tmp/pytest-of" not in text


# ---------------------------------------------------------------------------------------------- data files


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    bom = codecs.BOM_UTF8
    for name, text in (("a.jsonl", '{"text": "the river"}\n'), ("a.json", '[{"text": "the river"}]'),
                       ("a.txt", "the river\n")):  # fmt: skip
        (tmp_path / name).write_bytes(bom + text.encode())
        (doc,) = load_records(tmp_path / name)
        assert doc.text == "the river", name


def test_not_utf8_names_the_file_and_line(tmp_path: Path) -> None:
    for name, data in (("a.jsonl", b'{"text": "a"}\n\n{"text": "caf\xe9"}\n'), ("a.txt", b"a\n\nb\ncaf\xe9\n")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=f"{tmp_path / name} line [34]: not UTF-8 text \\(byte 0xe9"):
            load_records(tmp_path / name)


def test_a_line_without_end_is_refused_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1 << 16)
    path = tmp_path / "huge.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "' + b"x" * (16 << 20))  # 16 MiB on line 2, no newline
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=f"{path} line 2: longer than 0.0625 MiB"):
            load_records(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the 16 MiB line is never held
