"""The `distillery` CLI: help that teaches, bad inputs as one red line + exit 1 (before any Prefect server),
and a run on the tiny model printing the before/after table, the files and where the records are."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
    run_summary,
    tiny_config,
    write_tiny_llama,
)

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


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


COMMANDS = {"run", "tokenize", "teacher", "train", "evaluate", "export", "merge", "inspect", "doctor", "demo"}
COMMANDS |= {"serve", "compare"}


def test_top_level_help_lists_commands() -> None:
    """Every registered command is listed with its one-line summary; the known ones are all registered."""
    import typer.main

    registered = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert set(registered) >= COMMANDS
    result = runner.invoke(app, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    listed = set(re.findall(r"^│ ([a-z]+) ", result.output, re.MULTILINE))  # a row's first word (not wrapped text)
    assert listed >= set(registered), sorted(set(registered) - listed)


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


# ---------------------------------------------------------------------------------------------- cached reruns


def _cli_env(api_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _timed_run(config: Path, api_url: str | None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(config)],
        cwd=ROOT,
        env=_cli_env(api_url),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return time.perf_counter() - t0, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_cached_rerun_is_fast_starts_no_server_and_reuses_its_mlflow_run(
    reference_run: tuple[dict, dict], tmp_path: Path
) -> None:
    """The CLI answers a fully cached rerun from the verified records without Prefect: no server started, the
    MLflow run of the run that made the results reused (none created), within 5 s with PREFECT_API_URL set and
    10 s without (whole process, measured here)."""
    import prefect.settings as ps

    from schemas.config import RunConfig
    from tasks.tracking import client_for

    cfg, _ = reference_run
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    api_url = str(ps.PREFECT_API_URL.value())
    _timed_run(config, api_url)  # the flow, all cached, unless an earlier test already remembered this run
    client = client_for(RunConfig.model_validate(cfg))
    exp = client.get_experiment_by_name(cfg["run"]["experiment"])
    runs_before = {r.info.run_id for r in client.search_runs([exp.experiment_id])}
    with_server, out = _timed_run(config, api_url)
    assert "ran: nothing (all cached)" in out and "(reused: nothing logged)" in out, out
    without_server, out = _timed_run(config, None)
    assert "ran: nothing (all cached)" in out and "temporary server" not in out.lower(), out
    assert not (Path(cfg["run"]["workdir"]) / ".prefect" / "server.json").exists()
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == runs_before  # no duplicate
    print(f"cached rerun: {with_server:.1f} s with PREFECT_API_URL, {without_server:.1f} s without")
    assert with_server <= 5.0 and without_server <= 10.0, (with_server, without_server)


# ---------------------------------------------------------------------------------------------- temporary server


def _server_pid(home: Path) -> int:
    return int(json.loads((home / "server.json").read_text())["pid"])


def test_temporary_server_is_shared_and_stops_with_its_last_user(tmp_path: Path) -> None:
    """Two runs on one workdir share one server (the second reuses it); it stops when the last one leaves. Each
    run's `meanwhile` gets the URL, the first's before the new server answers; the server log says its new
    database was a copy of the template or migrated (flows/prefect_store.py)."""
    from flows.server import TemporaryServer, _alive, _answers

    home = tmp_path / ".prefect"
    seen: list[tuple[str, bool]] = []

    def meanwhile(url: str) -> None:
        seen.append((url, _answers(url)))

    first, second = TemporaryServer(home, meanwhile=meanwhile), TemporaryServer(home, meanwhile=meanwhile)
    url = first.__enter__()
    try:
        assert second.__enter__() == url and first.started and not second.started
        assert seen == [(url, False), (url, True)]
        log = (home / "server.log").read_text().splitlines()
        assert {"database: seeded", "database: migrated"} & set(log), log
        pid = _server_pid(home)
        first.__exit__(None, None, None)
        assert _alive(pid) and _answers(url)  # the second run still uses it
    finally:
        second.__exit__(None, None, None)
        first.__exit__(None, None, None)
    assert not _alive(pid) and not (home / "server.json").exists()


def test_temporary_server_timeout_is_configurable_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.server import TIMEOUT_ENV, ServerError, TemporaryServer, startup_timeout

    assert startup_timeout() == 180.0
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ServerError, match=f"{TIMEOUT_ENV}='soon'"):
        startup_timeout()
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    home = tmp_path / ".prefect"
    with pytest.raises(ServerError, match=rf"did not answer within 0.5 s \({TIMEOUT_ENV}\); see .*server.log"):
        with TemporaryServer(home):
            pass
    assert not (home / "server.json").exists()
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(home).encode() in _read(p)]
    assert not left, left  # the server that was starting was stopped


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_report_prefect_link_is_a_page_or_the_way_to_open_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never 'None/flow-runs/...': a server's UI page, or (temporary server, gone) how to reopen its database."""
    from types import SimpleNamespace

    import prefect.settings as ps

    from flows.cli import print_report
    from tasks.tracking import prefect_ui_url

    run = SimpleNamespace(id="abc")
    with ps.temporary_settings(updates={ps.PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert prefect_ui_url(run) == "http://127.0.0.1:4200/runs/flow-run/abc"
        monkeypatch.setenv("DISTILLERY_PREFECT_SERVER", "temporary")
        assert prefect_ui_url(run) is None
    summary = run_summary()
    print_report(summary, Path("/w"))
    out = capsys.readouterr().out
    assert "None/" not in out
    assert "infra/prefect-server.sh  then open http://127.0.0.1:4200/runs/flow-run/abc" in out
    print_report({**summary, "prefect_url": "http://127.0.0.1:4200/runs/flow-run/abc"}, Path("/w"))
    assert "  UI: http://127.0.0.1:4200/runs/flow-run/abc" in capsys.readouterr().out
