"""`distillery serve`: a served deployment on a real Prefect server (127.0.0.1) runs when triggered the way the
UI's run form triggers it and the way `prefect deployment run` does, its parameter schema is RunConfig with
descriptions, it carries the cron schedule, and an unchanged rerun reuses every stage from the workdir's cache.
The servers and the serving process are shared with tests/test_ui.py (tests/server_fixtures.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import yaml

from schemas.config import RunConfig
from tests.pipeline_fixtures import tiny_config
from tests.server_fixtures import (
    CRON,
    DEPLOYMENT,
    FinishedRun,
    Served,
    stage_states,
    wait_run,
)

BIN = Path(sys.executable).parent
SECTIONS = tuple(RunConfig.model_fields)  # every section of the run config is a field of the served form
# Stages whose outputs depend on the served config's optim.lr: computed by the first run with it.
LR_STAGES = {"train-epoch-0", "train-epoch-1", "evaluate-epoch-0", "evaluate-epoch-1", "export", "evaluate-merged"}
OTHER_STAGES = {"tokenize", "student", "teacher-plan", "evaluate-baseline"}


def _check_stage_names(stages: dict[str, str]) -> None:
    shards = {name for name in stages if re.fullmatch(r"teacher-shard-\d+", name)}
    assert shards, stages
    assert set(stages) == LR_STAGES | OTHER_STAGES | shards


def test_served_deployment_has_the_runconfig_schema_and_the_schedule(served: Served) -> None:
    dep = served.deployment
    schema = dep["parameter_openapi_schema"]
    defs = schema.get("definitions") or schema["$defs"]
    assert schema["properties"]["cfg"]["$ref"].rsplit("/", 1)[-1] == "RunConfig"
    run_config = defs["RunConfig"]["properties"]
    assert set(run_config) == set(SECTIONS)
    for section in SECTIONS:
        fields = defs[run_config[section]["$ref"].rsplit("/", 1)[-1]]["properties"]
        undocumented = [name for name, prop in fields.items() if not prop.get("description")]
        assert not undocumented, f"{section}: fields without a description in the run form: {undocumented}"
    assert schema["properties"]["until"]["enum"] == ["tokenize", "teacher", "train", "evaluate", "export"]
    assert dep["parameters"]["cfg"]["run"]["workdir"] == str(served.workdir)
    crons = [s["schedule"].get("cron") for s in dep["schedules"] if s["active"]]
    assert crons == [CRON]


def test_run_from_the_ui_completes_and_an_unchanged_rerun_is_cached(served: Served, default_run: FinishedRun) -> None:
    # The first run (tests/server_fixtures.py: POST /deployments/{id}/create_flow_run, as the UI's form does).
    assert default_run.run["state"]["type"] == "COMPLETED"
    _check_stage_names(default_run.stages)
    assert {default_run.stages[name] for name in LR_STAGES} == {"Completed"}, default_run.stages
    assert list(served.workdir.glob("export/*/adapter-lora.gguf"))
    assert list((served.workdir / ".prefect" / "results").glob("export-*")), "stage cache not in the workdir"

    # Again through the CLI (what a schedule tick does too: a run with the deployment's parameters).
    started = subprocess.run(
        [BIN / "prefect", "deployment", "run", f"distill/{DEPLOYMENT}"],
        env=served.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)  # type: ignore[union-attr]
    rerun = wait_run(served.servers, run_id)
    assert rerun["state"]["type"] == "COMPLETED", rerun["state"]
    stages = stage_states(served.servers, run_id, expect=LR_STAGES | OTHER_STAGES)
    _check_stage_names(stages)
    assert set(stages.values()) == {"Cached"}, stages


def test_retry_of_a_served_run_reruns_it_from_the_cache(served: Served, default_run: FinishedRun) -> None:
    retry_from = datetime.now(UTC)
    retried = subprocess.run(
        [BIN / "prefect", "flow-run", "retry", default_run.id],
        env=served.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert retried.returncode == 0, retried.stdout + retried.stderr
    run = wait_run(served.servers, default_run.id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["run_count"] >= 2
    stages = stage_states(served.servers, default_run.id, since=retry_from, expect=LR_STAGES | OTHER_STAGES)
    _check_stage_names(stages)
    assert set(stages.values()) == {"Cached"}, stages


def _serve_error(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.run(
        [BIN / "distillery", "serve", str(config), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_refuses_without_a_server_or_with_a_bad_cron(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path / "run")), encoding="utf-8")
    home = str(tmp_path / "home")
    no_server = _serve_error(config, PREFECT_HOME=home)
    assert no_server.returncode == 1
    assert "needs a Prefect server" in no_server.stderr and "infra/up.sh" in no_server.stderr
    assert "Traceback" not in no_server.stderr
    bad_cron = _serve_error(config, "--cron", "every day", PREFECT_HOME=home, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert bad_cron.returncode == 1
    assert "--cron 'every day'" in bad_cron.stderr and "Traceback" not in bad_cron.stderr


def test_python_m_flows_deploy_is_kept() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flows.deploy", "--help"], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert "--cron" in result.stdout and "--name" in result.stdout
