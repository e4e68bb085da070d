"""`distillery compare` on two tiny runs (the reference run and a rerun with another optim.lr that reuses its
cached stages): the table shows only the config field that differs and each run's best KL, top-1, tokens/s and gap
closed as the run summaries give them; both runs carry the same metric keys on the same step axes, so the MLflow
UI's compare view lines them up."""

from __future__ import annotations

import copy
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from flows.cli import app
from flows.compare import compare_runs, compare_view_url, differences, tracking_uri
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
)

LR = 2.5e-3


@pytest.fixture(scope="module", name="two_runs")
def _two_runs(reference_run: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict[str, Any], dict, dict]:
    """(config, reference summary, summary of the same config with optim.lr=LR in the same workdir)."""
    from flows.distill import run_pipeline
    from schemas.config import RunConfig

    cfg, first = reference_run
    changed = copy.deepcopy(cfg)
    changed["optim"]["lr"] = LR
    second = run_pipeline(RunConfig.model_validate(changed))
    assert "tokenize" in second["stages"]["cached"] and "train-epoch-0" in second["stages"]["ran"]
    return cfg, first, second


def test_compare_table_shows_differences_and_metrics(two_runs: tuple[dict[str, Any], dict, dict]) -> None:
    cfg, first, second = two_runs
    ids = [first["mlflow"]["run_id"], second["mlflow"]["run_id"]]
    out = StringIO()
    rows = compare_runs(
        Console(file=out, width=200), ids, experiment=cfg["run"]["experiment"], workdir=Path(cfg["run"]["workdir"])
    )
    assert [r.run_id for r in rows] == ids
    assert [r.differences for r in rows] == [{"optim.lr": str(cfg["optim"]["lr"])}, {"optim.lr": str(LR)}]
    for row, summary in zip(rows, (first, second), strict=True):
        assert row.best_kl == pytest.approx(summary["best"]["kl"])
        assert row.top1 == pytest.approx(summary["best"]["top1"])
        assert row.tokens_per_s == pytest.approx(summary["checkpoints"][-1]["metrics"]["tokens_per_s"])
        base = summary["baseline"]["kl"]
        assert row.gap_closed == pytest.approx((base - summary["best"]["kl"]) / base)
    text = out.getvalue()
    assert f"optim.lr={LR}" in text and f"{100 * rows[1].gap_closed:.1f}%" in text
    assert "lora.r" not in text  # equal fields are not shown


def test_compare_cli_by_run_name_and_errors(two_runs: tuple[dict[str, Any], dict, dict]) -> None:
    cfg, first, second = two_runs
    runner = CliRunner()
    args = ["compare", "--workdir", cfg["run"]["workdir"], "--experiment", cfg["run"]["experiment"]]
    result = runner.invoke(app, [*args, first["flow_run_name"], second["mlflow"]["run_id"][:10]], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert first["mlflow"]["run_id"][:12] in result.output and second["mlflow"]["run_id"][:12] in result.output
    assert "gap closed" in result.output
    unknown = runner.invoke(app, [*args, "no-such-run"], terminal_width=200)
    assert unknown.exit_code == 1 and "no run 'no-such-run'" in unknown.output
    no_exp = runner.invoke(app, [*args[:3], "--experiment", "nope"], terminal_width=200)
    assert no_exp.exit_code == 1 and "no MLflow experiment 'nope'" in no_exp.output


def test_runs_share_metric_keys_and_step_axes(two_runs: tuple[dict[str, Any], dict, dict]) -> None:
    from mlflow import MlflowClient

    cfg, first, second = two_runs
    client = MlflowClient(tracking_uri=first["mlflow"]["tracking_uri"])
    runs = [client.get_run(s["mlflow"]["run_id"]) for s in (first, second)]
    keys = [set(r.data.metrics) for r in runs]
    assert keys[0] == keys[1]
    assert {"train/loss", "eval/kl", "epoch/tokens_per_s", "baseline/kl", "best/kl", "best/top1"} <= keys[0]
    for key in sorted(keys[0]):
        steps = [[m.step for m in client.get_metric_history(r.info.run_id, key)] for r in runs]
        assert sorted(steps[0]) == sorted(steps[1]), key
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "eval/kl")] == list(
        range(cfg["train"]["epochs"])
    )


def test_differences_and_compare_view_url() -> None:
    params = [{"lora.r": "4", "optim.lr": "0.005", "run.mlflow_uri": "a"}, {"lora.r": "4", "run.mlflow_uri": "b"}]
    assert differences(params) == [{"optim.lr": "0.005"}, {"optim.lr": "–"}]
    assert compare_view_url("sqlite:///x.db", "1", ["a"]) is None
    url = compare_view_url("http://127.0.0.1:5000/", "3", ["a", "b"])
    assert url == "http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a%22%2C+%22b%22%5D&experiments=%5B%223%22%5D"


def test_tracking_uri_picks_the_named_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri(None, tmp_path, None) == (f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}", None)
    assert tracking_uri(None, None, None) == ("http://127.0.0.1:5999", None)
    assert tracking_uri(None, tmp_path, "http://a:1") == ("http://a:1", None)
