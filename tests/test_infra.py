"""infra/up.sh and infra/down.sh against real servers on 127.0.0.1: both answer, with auth only to their secrets, pid
files name them, and down.sh leaves no process of theirs behind; the Prefect UI is told its API on a port other than
4200. up.sh without auth starts the servers of tests/test_deploy.py and tests/test_ui.py (tests/server_fixtures.py)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server_fixtures import free_ports

ROOT = Path(__file__).resolve().parents[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _status(url: str, auth: str | None = None, post: bool = True) -> int:
    """HTTP status of a POST to `url` (an empty filter; a GET with post=False), with basic auth `auth`
    ('user:secret') when given."""
    body = b"{}" if post else None
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_up_with_auth_refuses_the_apis_without_their_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One start of both servers (with auth: the path without it serves tests/test_deploy.py and test_ui.py): they
    answer, the UI is told its API's port, a second up.sh finds them running, down.sh stops exactly them."""
    data = tmp_path / "servers"
    ports = dict(zip(("PREFECT_PORT", "MLFLOW_PORT"), map(str, free_ports(2)), strict=True))
    env = {**os.environ, **ports, "SERVER_WAIT_S": "240", "DISTILLERY_AUTH": "1", "MLFLOW_WORKERS": "1"}
    env.pop("PREFECT_UI_API_URL", None)
    api = f"http://127.0.0.1:{ports['PREFECT_PORT']}/api"
    pids: dict[str, int] = {}
    try:
        up = subprocess.run([ROOT / "infra/up.sh", data], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export PREFECT_API_URL={api} MLFLOW_TRACKING_URI=http://127.0.0.1:{ports['MLFLOW_PORT']}" in up.stdout
        pids = {name: int((data / f"{name}.pid").read_text()) for name in ("prefect", "mlflow")}
        # the UI asks the API on the server's own port (Prefect's default would be 4200)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['PREFECT_PORT']}/ui-settings", timeout=10) as reply:
            assert json.load(reply)["api_url"] == api
        assert f"PREFECT_UI_API_URL={api}" in up.stdout
        secret_file = data / "prefect-auth"
        secret = secret_file.read_text().strip()
        assert secret_file.stat().st_mode & 0o077 == 0 and secret.startswith("distillery:") and len(secret) > 30
        assert f'PREFECT_API_AUTH_STRING="$(cat {secret_file})"' in up.stdout and secret not in up.stdout
        with urllib.request.urlopen(f"{api}/health", timeout=10) as reply:  # probes stay open
            assert reply.status == 200
        assert _status(f"{api}/flows/filter") == 401
        assert _status(f"{api}/flows/filter", "distillery:wrong") == 401
        assert _status(f"{api}/flows/filter", secret) == 200
        # MLflow: its basic-auth app, admin `distillery` with the password in DATA_DIR/mlflow-auth
        mlflow = f"http://127.0.0.1:{ports['MLFLOW_PORT']}"
        password_file = data / "mlflow-auth"
        password = password_file.read_text().strip()
        assert password_file.stat().st_mode & 0o077 == 0 and len(password) >= 30
        assert (data / "mlflow/auth.db").stat().st_mode & 0o077 == 0 and password not in up.stdout
        assert f'MLFLOW_TRACKING_USERNAME=distillery MLFLOW_TRACKING_PASSWORD="$(cat {password_file})"' in up.stdout
        with urllib.request.urlopen(f"{mlflow}/health", timeout=10) as reply:
            assert reply.status == 200
        search = f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _status(search, post=False) == 401
        assert _status(search, "distillery:wrong-password", post=False) == 401
        assert _status(search, f"distillery:{password}", post=False) == 200
        # the MLflow client (tasks/tracking.py, flows/compare.py) reads the printed exports itself
        from mlflow import MlflowClient

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "distillery")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        client = MlflowClient(tracking_uri=mlflow, registry_uri=mlflow)
        run = client.create_run(client.create_experiment("auth"))
        client.log_metric(run.info.run_id, "loss", 1.0)
        assert client.get_run(run.info.run_id).data.metrics == {"loss": 1.0}
        again = subprocess.run([ROOT / "infra/up.sh", data], env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and again.stdout.count("already running") == 2, again.stdout + again.stderr
    finally:
        down = subprocess.run([ROOT / "infra/down.sh", data], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert pids and all(not _group_alive(pgid) for pgid in pids.values()), down.stdout
    assert not list(data.glob("*.pid"))
