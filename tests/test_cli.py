"""The `distillery` CLI: help that teaches, bad inputs as one red line + exit 1 (before any Prefect server),
and a run on the tiny model printing the before/after table, the files and where the records are."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
    tiny_config,
    write_tiny_llama,
)

runner = CliRunner()


@pytest.fixture(autouse=True)
def _prefect_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI points PREFECT_HOME at the workdir when prefect is not imported yet: keep that out of the
    test process's environment."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv("PREFECT_LOCAL_STORAGE_PATH", str(tmp_path / "prefect-home" / "storage"))


def _config(tmp_path: Path, **sections: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", **sections)))
    return path


@pytest.mark.parametrize(
    ("command", "phrase"),
    [
        ("run", "Every stage is cached"),
        ("tokenize", "chat template"),
        ("teacher", "vocabulary mismatch"),
        ("train", "same adapter bytes"),
        ("evaluate", "eval.best_metric"),
        ("export", "llama.cpp"),
        ("merge", "requantized"),
        ("demo", "KJV"),
    ],
)
def test_help_explains_each_command(command: str, phrase: str) -> None:
    result = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert phrase in text
    if command not in ("demo",):
        assert "--set" in text


def test_top_level_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    for command in (
        "run",
        "tokenize",
        "teacher",
        "train",
        "evaluate",
        "export",
        "merge",
        "inspect",
        "doctor",
    ):
        assert command in result.output


def _fails(args: list[str], *phrases: str) -> str:
    result = runner.invoke(app, args, terminal_width=400)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and "Traceback" not in text, text
    for phrase in phrases:
        assert phrase in text, text
    return text


def test_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _fails(["run", str(cfg), "--set", "lora.rank=8"], "unknown key 'lora.rank'")
    _fails(["run", str(cfg), "--set", "lora.r=0"], "lora.r", "[--set lora.r=0]")
    _fails(["run", str(tmp_path / "missing.yaml")], "config file not found")
    _fails(["train", str(cfg), "--set", f"model.student={tmp_path / 'nope.gguf'}"], "model.student", "nope.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    _fails(["teacher", str(cfg), "--set", f"model.teacher={tmp_path / 'bad.gguf'}"], "model.teacher", "bad.gguf")
    other = write_tiny_llama(tmp_path / "other.gguf", extra_tokens=("qqq",))
    _fails(["teacher", str(cfg), "--set", f"model.student={other}"], "vocabularies differ", "first difference")
    _fails(["tokenize", str(cfg), "--set", "data.seq_len=4096"], "data.seq_len", "context length 64")
    # nothing ran: no stage directories were written
    assert not (tmp_path / "run" / "tokens").exists()


@pytest.mark.gpu
def test_run_prints_report_then_single_stage_is_cached(reference_run: tuple[dict, dict], tmp_path: Path) -> None:
    """`run` on the config of the shared reference flow run (so every stage is cached), then `teacher`."""
    cfg, summary = reference_run
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = runner.invoke(app, ["run", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.output
    best = summary["best_epoch"]
    for phrase in (
        "before (no adapter)",
        f"epoch {best} (best)",
        "KL(teacher‖student)",
        f"{summary['baseline']['kl']:.4f} → {summary['best']['kl']:.4f}",
        f"PEFT adapter: {Path(cfg['run']['workdir']) / summary['files']['peft_dir']}",
        "GGUF LoRA:",
        "merged GGUF:",
        "ran: nothing (all cached)",
    ):
        assert phrase in out, phrase
    assert "infra/mlflow-server.sh" in out and "MLflow run" in out and "Prefect flow run" in out
    result = runner.invoke(app, ["teacher", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "ran: nothing (all cached)" in result.output
    assert "cached: tokenize, student, teacher-plan, teacher-shard-0, teacher-shard-1" in result.output
