"""Bad inputs through the real CLI: hostile and unsupported GGUFs, bad or empty data, wrong field
names, absurd values, a corrupt Parquet file, NaN teacher weights, an unwritable workdir, a GPU buffer above the
adapter's binding limit. Each must end in one line `error: ...` naming the file and the config field, with no
traceback anywhere in the output, a non-zero exit status, and nothing marked complete (no stage record of the
stage that failed, no remembered run). Broken stage outputs, by contrast, are not errors: the run rebuilds them
(the last rows). The test writes docs/reliability.md: the table of cases, the error shown and the exit status.

Cases refused by the preflight run the CLI's app in this process (typer's runner; an exception that escapes it
counts as a traceback); those that fail inside a stage run `python -m flows.cli` in a subprocess, the flow on the
session's Prefect test server, three at a time beside the making of the reference run; the recoveries start from
a copy of the session's reference run.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import traceback
import tracemalloc
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml
from gguf import GGMLQuantizationType as Q
from rich.console import Console

from bench.fuzz_runs import TOKENS, mutate_text
from data import records
from data.records import DataError, load_records
from flows.compare import CompareError, compare_runs
from model import reference as R
from model.config import ModelConfig
from model.gguf import llama_metadata, write_gguf
from schemas.config import ConfigError, RunConfig, load_config
from stages.train import warn_small_split
from tasks.tracking import git_commit
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    WORDS,
    _prefect_harness,
    _reference_run,
    tiny_config,
    tiny_inputs,
    tokenizer_metadata,
    write_tiny_llama,
)
from tests.test_security import json_record, pickle_record
from training import engines

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "reliability.md"
CACHE_KEY = re.compile(r"\b[0-9a-f]{16,64}\b")  # a stage's cache key in a path: machine-dependent
FUZZ_RUNS = ROOT / "docs" / "bench" / "2026-12-05-fuzz-runs.json"  # bench/fuzz_runs.py's long pass


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


def _data_case(name: str, content: str | bytes, *says: str, stage: str | None = "tokenize") -> Case:
    """A run whose data.path is a data.jsonl holding `content`, refused by tokenize (or, stage None, by the
    preflight, which reads the first document) with `says` in its line."""
    return Case(
        name,
        lambda c: ["run", str(c.config(data={"path": str(c.file("data.jsonl", content))}))],
        lambda c: ["data.path", _data(c, "data.jsonl"), *says],
        stage=stage,
    )


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
    Case(
        "LoRA rank above the hidden size",
        _set("lora.r=64"),
        lambda c: ["lora.r", "hidden size 32", str(tiny_inputs() / "teacher-f32.gguf")],
    ),
    Case(
        "student_quant Q4_K on rows of 32",
        _set("model.student_quant=[Q4_K]"),
        lambda c: ["model.student_quant", "tensor 'blk.0.", "not a multiple of Q4_K's block 256"],
    ),
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
    _data_case("empty data file", "", stage=None),
    _data_case("malformed JSON line", '{"text": "a b c."}\n{"text": "unclosed\n', "line 2"),
    _data_case(
        "data file in latin-1 (not UTF-8) on line 2",
        '{"text": "a b"}\n{"text": "caf\xe9"}\n'.encode("latin-1"),
        "line 2",
        "not UTF-8",
    ),
    _data_case("data file in UTF-16", '{"text": "a b"}\n'.encode("utf-16"), "UTF-16", stage=None),
    _data_case("whitespace-only documents", '{"text": "  "}\n{"text": "\\n\\t "}\n', "whitespace only"),
    _data_case(
        "chats without an assistant turn (nothing to train)",
        (json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS[:12])}]}) + "\n") * 12,
        "no trainable tokens",
    ),
    Case(
        "wrong text field name",
        lambda c: ["run", str(c.config(data={"path": str(tiny_inputs() / "texts.jsonl"), "text_field": "body"}))],
        lambda c: ["data.text_field", str(tiny_inputs() / "texts.jsonl")],
        stage=None,  # the first document: the preflight
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
        stage=None,  # the first document: the preflight
    ),
    Case(
        "corrupt Parquet data file",
        lambda c: [
            "run",
            str(c.config(data={"path": str(c.file("data.parquet", b"PAR1" + bytes(range(200)) + b"PAR1"))})),
        ],
        lambda c: ["data.path", _data(c, "data.parquet")],
        stage=None,  # the first document: the preflight
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


# Inputs and faults checked by other tests (or by the unit tests at the end of this file): (case, what the user
# sees, the test that checks it). They join the generated table in docs/reliability.md.
ELSEWHERE: list[tuple[str, str, str]] = [
    (
        "team set-up: a worker and its flow run killed with SIGKILL mid-training",
        "the run's heartbeats stop; it is marked Crashed, scheduled again, and the other worker finishes it from the "
        "stage cache with the serial run's adapter bytes, in the same MLflow run",
        "test_team.py::test_killed_worker_is_retried_elsewhere_and_cron_fires_meanwhile",
    ),
    (
        "team set-up: a cron schedule firing while a worker is down",
        "the other worker runs it",
        "test_team.py::test_killed_worker_is_retried_elsewhere_and_cron_fires_meanwhile",
    ),
    (
        "team set-up: two flow runs of one config (and two of another) on one workdir at once, on two workers",
        "one computes each stage, the other waits for the stage's lock and takes the cached result; all end with "
        "the serial runs' adapter bytes, one model version per adapter",
        "test_team.py::test_four_runs_on_two_workers_match_serial_runs",
    ),
    (
        "team set-up: two runs creating the same MLflow experiment at once",
        "both log into the one that exists (no RESOURCE_ALREADY_EXISTS failure)",
        "test_team.py::test_four_runs_on_two_workers_match_serial_runs",
    ),
    (
        "team set-up: a flow run that crashes on every attempt",
        "its fourth start fails: `flow run <name>: attempt 4, more than 3: the earlier ones crashed ...`",
        "test_team.py::test_a_run_crashing_every_time_stops_after_three_attempts",
    ),
    (
        "team set-up: infra/down.sh",
        "workers, servers and PostgreSQL stopped; no process and no port of theirs left",
        "test_team.py::test_down_stops_everything_it_started",
    ),
    (
        "kill -9 at every stage boundary, mid teacher shard, mid checkpoint, mid export",
        "the rerun resumes from the cache and the last checkpoint: the same adapter bytes as an unbroken run",
        "test_faults.py::test_killed_at_every_boundary_and_mid_write_resumes_to_the_reference_bytes",
    ),
    (
        "SIGTERM or SIGHUP during a run",
        "`interrupted by SIGTERM: rerun the same command to resume from the cache`, "
        "exit 143 / 129, the temporary Prefect server stopped",
        "test_faults.py::test_sigterm_and_sighup_stop_the_run_and_its_server_with_the_resume_hint",
    ),
    (
        "two runs on one workdir at once",
        "the second prints `waiting: another run (...) is using <workdir>` and both finish with the same results",
        "test_faults.py::test_concurrent_runs_on_a_new_and_on_a_used_workdir",
    ),
    (
        "disk full (ENOSPC) in any atomic data write",
        "`[Errno 28] <file>: cannot write: No space left on device`, the temporary file removed",
        "test_faults.py::test_a_full_disk_is_one_line_naming_the_file",
    ),
    (
        "a stage record naming pickle, read by the stage store",
        "a cache miss; the payload never runs (it does under Prefect's own store)",
        "test_security.py::test_the_store_never_runs_a_pickle_record",
    ),
    (
        "a stage record of garbage, a list, a dict, a foreign `__class__`, an invalid manifest, a named JSON decoder, "
        "16 MiB+",
        "a cache miss: `cached result not used (<record>: ...)`, the stage recomputes",
        "test_security.py::test_records_that_are_not_manifests_are_refused",
    ),
    (
        "a flow run name that is a path (a deployment's form)",
        "the report is `reports/<name with / as _>.md` inside the workdir",
        "test_security.py::test_report_paths_stay_in_the_workdir",
    ),
    (
        "a report path through a symlink out of the workdir",
        "`OutsideWorkdir: ... outside the workdir <workdir>`",
        "test_security.py::test_inside_refuses_every_escape",
    ),
    (
        "run.run_name '..', 'a/b', 'a\\b', a tab, empty",
        "`run.run_name: must be a plain name, not a path ...`",
        "test_security.py::test_run_name_that_is_a_path_is_refused_at_load",
    ),
    (
        "a duplicate key in a JSON config or a --set mapping",
        "`<file>: duplicate key 'r'; a key may appear once in a section`",
        "test_schemas.py::test_duplicate_keys_are_errors_naming_file_key_and_lines",
    ),
    (
        "`run.experiment=2024-01-01`, `run.run_name=2024`, `yes` for a string",
        "accepted as the strings written",
        "test_schemas.py::test_yaml_12_scalars",
    ),
    (
        "a config run from another directory with relative paths",
        "paths resolve against the config file's folder (a --set value: the current directory)",
        "test_schemas.py::test_relative_paths_in_a_file_are_relative_to_its_folder",
    ),
    (
        "a UTF-8 byte-order mark (jsonl, json, text)",
        "accepted",
        "test_bad_inputs.py::test_a_utf8_byte_order_mark_is_accepted",
    ),
    (
        "non-UTF-8 bytes in a text file",
        "`<file> line 4: not UTF-8 text (byte 0xe9: invalid continuation byte)`",
        "test_bad_inputs.py::test_not_utf8_names_the_file_and_line",
    ),
    (
        "a JSON Lines file with a huge line (no newline)",
        "`<file> line 2: longer than 64 MiB; JSON Lines holds one record per line`, memory bounded by the cap",
        "test_bad_inputs.py::test_a_line_without_end_is_refused_in_bounded_memory",
    ),
    (
        "a text (.txt) file with a huge line, or not UTF-8 on its first line",
        "`<file> line 3: longer than 64 MiB; a text file is read line by line` / `<file> line 1: not UTF-8 text`, "
        "before the rest of the file is read",
        "test_bad_inputs.py::test_a_text_file_is_refused_in_bounded_memory",
    ),
    (
        "anything a run writes (every case above, refused or run, and the recoveries)",
        "nothing created, changed or removed beside the workdir",
        "test_bad_inputs.py::test_nothing_is_written_outside_the_workdir",
    ),
    (
        "some blank documents",
        "one warning line: `<file>: 2 of 3 documents are empty or whitespace only (first: line 2)`",
        "test_bad_inputs.py::test_some_blank_documents_are_a_warning",
    ),
    (
        "a train split smaller than one optimizer step",
        "one warning line: `train: the train split has 5 sequences ..., fewer than one optimizer step's 8`",
        "test_bad_inputs.py::test_a_split_smaller_than_one_step_is_a_warning",
    ),
    (
        "`compare --workdir` of a folder with no runs",
        "`no MLflow store <dir>/mlflow.db: no run was tracked there`, nothing created",
        "test_bad_inputs.py::test_compare_on_a_missing_workdir_creates_nothing",
    ),
    (
        "a damaged output of every stage (deleted, truncated, flipped)",
        "one warning line naming the file; that stage is rebuilt to the same bytes",
        "test_pipeline.py::test_damaged_outputs_of_every_stage_are_rebuilt_to_the_same_bytes",
    ),
    (
        "3,000 random edits of a valid config file and --set overrides (fuzz)",
        "a RunConfig or a ConfigError naming the file and field, never another exception",
        "test_bad_inputs.py::test_fuzzed_configs_load_or_fail_with_a_config_error",
    ),
    (
        "2,000 random byte edits of a JSON Lines / text data file (fuzz)",
        "documents or a DataError naming the file, never another exception",
        "test_bad_inputs.py::test_fuzzed_data_files_load_or_fail_with_a_data_error",
    ),
    (
        "random mutations of the config and the data through full `distillery run`s (fuzz; the long pass: below)",
        "a completed run whose every stage verifies, or one line naming the field or file; a valid config then "
        "completes on the same workdir",
        "test_fuzz_runs.py::test_fuzz_cases_complete_or_refuse_in_one_line",
    ),
    (
        "a lone surrogate (JSON `\\ud800`) in a text or a chat message (fuzz)",
        "`<file> line 4: field 'text' holds an unpaired surrogate \\ud800 (character 10), not Unicode text`",
        "test_fuzz_runs.py::test_a_lone_surrogate_in_the_data_is_one_line_naming_the_record",
    ),
    (
        "run.experiment holding '/' or ':' (fuzz; MLflow refuses them in a model name)",
        "the run completes; the adapter registers as `<experiment with / and : as _>-adapter`",
        "test_fuzz_runs.py::test_an_experiment_name_mlflow_refuses_for_a_model_still_registers",
    ),
    (
        "train.epochs 11111111111111111111, train.batch_size 2^63, train.grad_accum 10^9 (fuzz)",
        "`train.epochs: Input should be less than or equal to 10000`, not a run without end",
        "test_fuzz_runs.py::test_absurd_sizes_are_refused_at_load",
    ),
    (
        "a training batch beyond memory (fuzz: train.batch_size 10^8)",
        "`train.batch_size: ... sequences of data.seq_len ... do not fit in memory (...); lower train.batch_size`",
        "test_fuzz_runs.py::test_a_batch_beyond_memory_is_one_line_naming_the_batch_size",
    ),
    (
        "run.mlflow_uri a path or file:// (fuzz; MLflow's retired file store)",
        "`run.mlflow_uri: '<path>': The filesystem tracking backend (e.g., './mlruns') is in maintenance mode ...; "
        "give a database (sqlite:///<file>) or a server (http://host:port)`",
        "test_fuzz_runs.py::test_a_tracking_uri_mlflow_refuses_is_one_line_naming_the_field",
    ),
    (
        "a JSON line of 100,000 '[' (fuzz)",
        "`<file> line 37: JSON nested too deeply to read (...)`",
        "test_fuzz_runs.py::test_json_nested_beyond_the_recursion_limit_is_a_data_error",
    ),
    (
        "infra/compose.yaml without its secrets (no container runtime here: the file is parsed)",
        "compose refuses to start (`${DISTILLERY_PREFECT_AUTH:?run infra/secret.sh first}`); server and worker "
        "read the same secret",
        "test_compose.py::test_every_secret_is_required_from_the_env_file_and_wired_to_both_ends",
    ),
    (
        "the engine chosen on a machine whose only adapter is a CPU (train.backend=auto)",
        "the numpy engine, without the 'no discrete GPU' warning of the unused kernels",
        "test_bad_inputs.py::test_choosing_the_engine_does_not_warn_about_a_cpu_adapter",
    ),
    (
        "a run started from another git repository",
        "the MLflow tag git.commit is distillery's checkout, not the current directory's",
        "test_bad_inputs.py::test_git_commit_is_the_code_checkouts_not_the_current_directorys",
    ),
    (
        "the Prefect or MLflow API of `DISTILLERY_AUTH=1 infra/up.sh` called without its secret (or a wrong one)",
        "HTTP 401 (health probes stay open); the secrets in DATA_DIR/prefect-auth and DATA_DIR/mlflow-auth, mode 600",
        "test_infra.py::test_up_with_auth_refuses_the_apis_without_their_secrets",
    ),
    (
        "GGUF files truncated at every sixteenth, patched headers, random bytes, mutation fuzz",
        "`model.student: <file>: <where>: <what>` (a GGUFError naming the offset or key)",
        "test_gguf_hostile.py",
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
    outside: list[str] = field(default_factory=list)  # what the run created, changed or removed beside its workdir


def _tree(folder: Path, workdir: Path) -> dict[str, tuple[bool, int, int]]:
    """Every entry under `folder` outside `workdir`: relative path -> (a folder, size, mtime_ns), links not
    followed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != workdir]
        for name in dirnames + filenames:
            st = (here / name).lstat()
            found[str((here / name).relative_to(folder))] = (name in dirnames, st.st_size, st.st_mtime_ns)
    return found


def _changed(before: dict[str, tuple[bool, int, int]], after: dict[str, tuple[bool, int, int]]) -> list[str]:
    """The entries created, removed or changed between two _tree snapshots (a folder's mtime aside: a folder
    changes when its files do, which the files themselves show)."""
    return sorted(
        name
        for name in before.keys() | after.keys()
        if before.get(name) != after.get(name) and not (before.get(name, (0,))[0] and after.get(name, (0,))[0])
    )


def _case_ctx(name: str, root: Path) -> Ctx:
    return Ctx(root / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), name)


def _in_process(args: list[str], fault: str | None) -> tuple[int, str]:
    """(exit status, output) of the CLI's app run in this process (the same code as `python -m flows.cli`, without an
    interpreter start), for the cases the preflight refuses; an exception that escapes the CLI adds its traceback."""
    from typer.testing import CliRunner

    from flows.cli import app

    assert fault is None, "a fault is armed through a subprocess's environment"
    with contextlib.chdir(ROOT):
        result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        output += "".join(traceback.format_exception(result.exception))
    return result.exit_code, output


def _subprocess(api_url: str) -> Callable[[list[str], str | None], tuple[int, str]]:
    """Run `python -m flows.cli` on the session's Prefect server, the fault armed: (exit status, output)."""

    def run(args: list[str], fault: str | None) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
        env.update(PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="80")
        env.update({"DISTILLERY_FAULT": fault} if fault else {})
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        return proc.returncode, proc.stdout + proc.stderr

    return run


def _run_case(case: Case, root: Path, run: Callable[[list[str], str | None], tuple[int, str]]) -> Outcome:
    ctx = _case_ctx(case.name, root)
    ctx.dir.mkdir(parents=True)
    args = case.build(ctx)
    before = _tree(ctx.dir, ctx.workdir)
    code, output = run(args, case.fault)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    outside = _changed(before, _tree(ctx.dir, ctx.workdir))
    return Outcome(case, code, output, errors[-1] if errors else "", ctx.workdir, outside)


def _recover(item: Recovery, root: Path, api_url: str, reference: tuple[dict, dict]) -> Outcome:
    """Copy the reference run's workdir (without its MLflow store), damage it, rerun the CLI on the copy."""
    cfg, summary = reference
    ctx = _case_ctx(item.name, root)
    shutil.copytree(
        summary["workdir"], ctx.workdir, ignore=shutil.ignore_patterns("mlflow.db", "mlartifacts", "*.lock")
    )
    item.damage(ctx.workdir, summary)
    config = ctx.file("config.yaml", yaml.safe_dump({**cfg, "run": {**cfg["run"], "workdir": str(ctx.workdir)}}))
    before = _tree(ctx.dir, ctx.workdir)
    code, output = _subprocess(api_url)(["run", str(config)], None)
    said = [line for line in output.splitlines() if "cached result not used" in line]
    outside = _changed(before, _tree(ctx.dir, ctx.workdir))
    return Outcome(item, code, output, said[0].split(" - ", 1)[-1] if said else "", ctx.workdir, outside)


@pytest.fixture(scope="module")
def outcomes(
    prefect_harness: None, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[Outcome]:
    """Every case and recovery: the cases that reach a stage in subprocesses, three at a time, while this thread
    runs those the preflight refuses (in this process) and then makes the session's reference run (if it is not
    yet); the recoveries once it is there. The outcomes in the order of CASES, then RECOVERIES."""
    import prefect.settings as ps

    api_url = str(ps.PREFECT_API_URL.value())
    root = tmp_path_factory.mktemp("bad-inputs")
    with ThreadPoolExecutor(max_workers=3) as pool:
        in_stage = _subprocess(api_url)
        started = {id(c): pool.submit(_run_case, c, root, in_stage) for c in CASES if c.stage is not None}
        refused = {id(c): _run_case(c, root, _in_process) for c in CASES if c.stage is None}
        reference_run = request.getfixturevalue("reference_run")  # meanwhile, in this thread
        recovered = [pool.submit(_recover, item, root, api_url, reference_run) for item in RECOVERIES]
        done = [refused[id(c)] if id(c) in refused else started[id(c)].result() for c in CASES]
        done += [f.result() for f in recovered]
    _write_report(done, {str(root): "<tmp>", str(tiny_inputs()): "<inputs>"})
    return done


def _write_report(done: list[Outcome], short: dict[str, str]) -> None:
    def cell(text: str) -> str:
        for long, name in short.items():
            text = text.replace(long, name)
        return CACHE_KEY.sub("<key>", text).replace("|", "\\|")

    errors = [o for o in done if isinstance(o.case, Case)]
    lines = [
        "# Reliability: bad inputs and faults",
        "",
        "Generated by `tests/test_bad_inputs.py` (every `make test`): each case runs `python -m flows.cli ...` in a",
        "subprocess. Every bad input ends in one line naming the file and the config field, no traceback, a",
        "non-zero exit status, and nothing marked complete. `<tmp>` is the test's temporary folder, `<inputs>` the",
        "tiny model and texts of tests/pipeline_fixtures.py, `<key>` a stage's cache key (it depends on the versions",
        "installed).",
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
    lines += [
        "",
        f"{len(ELSEWHERE)} more inputs and faults, checked by the tests named (`tests/`):",
        "",
        "| case | what the user sees | test |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(case)} | {cell(sees)} | `{test}` |" for case, sees, test in ELSEWHERE]
    lines += fuzz_section(json.loads(FUZZ_RUNS.read_text(encoding="utf-8")))
    REPORT.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _as_run_from_the_repo(command: str) -> str:
    """A recorded command as a user runs it from a checkout: the script relative to the repository, --out's
    folder left out (the recording machine's paths are not the reader's)."""
    return re.sub(r"(--out )\S*/", r"\1", re.sub(r"\S*/(bench/\S+)", r"\1", command))


def _rerun_line(again: dict[str, Any] | None) -> list[str]:
    if again is None:
        return []
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(again["outcomes"].items()))
    where = f"commit {again['commit']}, `{_as_run_from_the_repo(again['command'])}`"
    return [f"- the pass's failing cases rerun on the fixes ({where}): {outcomes}"]


def fuzz_section(f: dict[str, Any]) -> list[str]:
    """The long fuzz pass of bench/fuzz_runs.py as the report's last section, from its JSON."""
    out, where = f["outcomes"], f["refused_at"]
    rechecks = f["rechecks"]
    return [
        "",
        "## Fuzz through full runs",
        "",
        "`bench/fuzz_runs.py` mutates the tiny config (YAML text edits, `--set` overrides, wrong types, out-of-range "
        "values, missing and extra keys and sections, paths) and its data (truncation, bad JSON lines, encodings, "
        "blank, few or huge documents, wrong field types, formats, held-out files) and runs each case through "
        "`distillery run` in-process (numpy engine); after a share of the cases a valid config runs on the same "
        "workdir, and at each workdir's end every stage record in it must verify. `tests/test_fuzz_runs.py` keeps "
        f"20 of its cases in every `make test`. The long pass ({FUZZ_RUNS.relative_to(ROOT)}):",
        "",
        f"- cases: {f['cases']:,} (seed {f['seed']}; {f['ranges']})",
        f"- completed, every stage verified: {out.get('completed', 0):,}",
        f"- refused in one line naming a field or file: {out.get('refused', 0):,} (at load {where.get('load', 0):,}, "
        f"at preflight {where.get('preflight', 0):,}, in a stage {where.get('stage', 0):,})",
        f"- failures (a traceback, an exception class, a vague or several-line error, unverified outputs, a hang, a "
        f"broken cache): {out.get('failure', 0)}",
        f"- valid runs on the same workdir after a case: {sum(rechecks.values()):,}, {rechecks.get('ok', 0):,} "
        "completed",
        f"- stage records that do not verify at a workdir's end: {len(f['workdir_record_problems'])}",
        f"- wall time: {f['seconds'] / 60:.0f} min, {f['where']}",
        f"- commit {f['commit']}: {'; '.join(f'`{_as_run_from_the_repo(c)}`' for c in f['commands'])}",
        *_rerun_line(f.get("failures_rerun")),
        "",
        "Defects it found, each fixed with a test that fails before the fix (`tests/test_fuzz_runs.py`): "
        + "; ".join(f["defects"])
        + ".",
    ]


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
        assert not o.workdir.exists() or case.name.startswith("workdir"), case.name  # nor a workdir left behind
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


def test_nothing_is_written_outside_the_workdir(outcomes: list[Outcome]) -> None:
    """No case, refused or run (recoveries included), creates, changes or removes anything beside its workdir:
    in its own folder (its config and data files, where `run.run_name=../../x` once wrote x.md) or in the folder
    above, which holds only the cases' folders."""
    assert {o.case.name: o.outside for o in outcomes if o.outside} == {}
    root = outcomes[0].workdir.parent.parent
    assert sorted(p.name for p in root.iterdir()) == sorted(o.workdir.parent.name for o in outcomes)


def test_report_lists_every_case(outcomes: list[Outcome]) -> None:
    text = REPORT.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == len(CASES) + len(RECOVERIES) + len(ELSEWHERE) >= 50 and f"{len(CASES)} bad inputs:" in text
    for _, _, test in ELSEWHERE:  # every test named exists
        file, _, name = test.partition("::")
        assert (ROOT / "tests" / file).is_file(), test
        assert not name or f"def {name}(" in (ROOT / "tests" / file).read_text(), test
    assert "<tmp>/" in text and "/tmp/pytest-of" not in text


# ---------------------------------------------------------------------------------------------- data files


def test_the_preflight_reads_the_first_document_only(tmp_path: Path) -> None:
    """check_first_document refuses what the first record shows, as load_records would, and reads no further: a
    bad line 2 or a huge text file's later lines are left to the tokenize stage."""
    bad_second = tmp_path / "a.jsonl"
    bad_second.write_text('{"text": "the river"}\n{"text": "unclosed\n')
    records.check_first_document(bad_second)
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_records(bad_second)
    field = tmp_path / "b.jsonl"
    field.write_text('{"body": "the river"}\n')
    for check in (records.check_first_document, load_records):
        with pytest.raises(DataError, match=r"b.jsonl line 1: no field 'messages' or 'text'; available fields: body"):
            check(field)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match="empty dataset"):
        records.check_first_document(tmp_path / "empty")
    text = tmp_path / "c.txt"
    text.write_bytes(b"the river\n" + b"\xff" * 100)  # not UTF-8 on line 2 only
    records.check_first_document(text)
    with pytest.raises(DataError, match="line 2: not UTF-8"):
        load_records(text)
    text.write_bytes("the river\n".encode("utf-16"))
    with pytest.raises(DataError, match="UTF-16"):
        records.check_first_document(text)


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


def test_a_text_file_is_refused_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .txt file is read line by line as JSON Lines are: a line without end longer than MAX_LINE_BYTES, or a
    first line that is not UTF-8, is refused before the rest of the file is held (it was read whole: about three
    times the file's size at the peak, then 'not UTF-8' or one huge document)."""
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1 << 16)
    huge, binary = tmp_path / "huge.txt", tmp_path / "binary.txt"
    huge.write_bytes(b"the river\n\n" + b"x" * (16 << 20))  # 16 MiB on line 3, no newline
    binary.write_bytes(b"\xffx\n" + b"x\n" * (8 << 20))  # not UTF-8 on line 1, 16 MiB after it
    for path, says in ((huge, "line 3: longer than 0.0625 MiB; a text file is read line by line"),
                       (binary, "line 1: not UTF-8 text (byte 0xff")):  # fmt: skip
        tracemalloc.start()
        try:
            with pytest.raises(DataError) as err:
                load_records(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(err.value).startswith(f"{path} {says}"), err.value
        assert peak < 4 << 20, (path.name, peak)  # the 16 MiB is never held


def test_text_paragraphs_are_those_of_the_whole_file(tmp_path: Path) -> None:
    """Reading a text file line by line splits it into the same paragraphs, at the same indices, as splitting the
    whole file at blank lines (runs of blank lines, whitespace-only lines, CRLF, no final newline)."""
    rng = np.random.default_rng(0)
    pieces = ["a", "b c", " ", "\t", "\r", "\n", "\n", "\n", "\u00e9"]
    path = tmp_path / "a.txt"
    for _ in range(300):
        text = "x" + "".join(pieces[int(i)] for i in rng.integers(len(pieces), size=int(rng.integers(1, 30))))
        path.write_bytes(text.encode())
        want = [(f"paragraph {i}", p) for i, p in enumerate(q.strip() for q in records._PARAGRAPH.split(text)) if p]
        assert [(d.locator, d.text) for d in load_records(path)] == want, repr(text)


def test_some_blank_documents_are_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "the river"}\n{"text": " \\t"}\n{"messages": [{"role": "user", "content": ""}]}\n')
    with caplog.at_level("WARNING", logger="data.records"):
        assert len(load_records(path)) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 3 documents are empty or whitespace only (first: line 2); they train on whitespace"
    ]


def test_a_split_smaller_than_one_step_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = RunConfig.model_validate(tiny_config(Path("w"), train={"batch_size": 4, "grad_accum": 2}))
    tokens = SimpleNamespace(train=SimpleNamespace(n_sequences=5, n_positions=60))
    with caplog.at_level("WARNING", logger="stages.train"):
        warn_small_split(cfg, tokens)  # type: ignore[arg-type]
        warn_small_split(cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accum": 1})}), tokens)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "5 sequences (60 trained positions), fewer than one optimizer step's 8" in message


def test_compare_on_a_missing_workdir_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CompareError, match=f"no MLflow store {missing / 'mlflow.db'}: no run was tracked there"):
        compare_runs(Console(file=io.StringIO()), [], workdir=missing)
    assert list(tmp_path.iterdir()) == []


def test_git_commit_is_the_code_checkouts_not_the_current_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)  # another repository (no commit yet)
    ours = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert (git_commit() or "").startswith(ours.stdout.strip())


def test_choosing_the_engine_does_not_warn_about_a_cpu_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "_DEVICES", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        backend, why = engines.resolve_backend("auto", "wgpu")
    assert not [w for w in seen if "no discrete GPU" in str(w.message)], (backend, why)


# ---------------------------------------------------------------------------------------------- fuzz


def test_fuzzed_configs_load_or_fail_with_a_config_error(tmp_path: Path) -> None:
    """3,000 random edits of a valid config file and random --set overrides: a RunConfig or a ConfigError."""
    rng = np.random.default_rng(0)
    text = yaml.safe_dump(tiny_config(tmp_path / "run"), sort_keys=False)
    keys = [f"{section}.{name}" for section, cls in RunConfig.model_fields.items()
            for name in getattr(cls.annotation, "model_fields", {})]  # fmt: skip
    path = tmp_path / "config.yaml"
    outcomes = {"loaded": 0, "refused": 0}
    for n in range(3000):
        mutated = text
        for _ in range(int(rng.integers(1, 4))):
            mutated = mutate_text(rng, mutated)
        path.write_text(mutated, encoding="utf-8")
        overrides = [f"{rng.choice(keys)}={rng.choice(TOKENS)}"] if n % 3 == 0 else []
        try:
            load_config(path, overrides)
            outcomes["loaded"] += 1
        except ConfigError as exc:
            assert str(exc).strip(), mutated
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 -- the finding: anything else is a bug
            pytest.fail(f"{type(exc).__name__}: {exc}\n--- config ---\n{mutated}--- overrides: {overrides}")
    assert min(outcomes.values()) > 100, outcomes


def test_fuzzed_data_files_load_or_fail_with_a_data_error(tmp_path: Path) -> None:
    """2,000 random byte edits of a valid JSON Lines file (and as text): documents or a DataError."""
    rng = np.random.default_rng(1)
    good = (tiny_inputs() / "texts.jsonl").read_bytes()[:4000]
    extras = (b"\xff", b"\x00", b"\n", b'"', b"{", b"}", codecs.BOM_UTF8, codecs.BOM_UTF16_LE, b"\\u12", b"\xc3")
    outcomes = {"loaded": 0, "refused": 0}
    for n in range(2000):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 6))):
            pos = int(rng.integers(len(data) + 1))
            if rng.random() < 0.5:
                data[pos:pos] = extras[int(rng.integers(len(extras)))]
            else:
                del data[pos : pos + int(rng.integers(1, 40))]
        path = tmp_path / ("data.jsonl" if n % 4 else "data.txt")
        path.write_bytes(bytes(data))
        try:
            load_records(path)
            outcomes["loaded"] += 1
        except DataError as exc:
            assert str(path) in str(exc), exc
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 -- the finding: anything else is a bug
            pytest.fail(f"{type(exc).__name__}: {exc}\n--- data ---\n{bytes(data)[:300]!r}")
    assert min(outcomes.values()) > 100, outcomes
