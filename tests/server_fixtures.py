"""Real servers for the operations tests: a Prefect server and an MLflow server on 127.0.0.1 (infra/up.sh on free
ports, stopped by infra/down.sh), `distillery serve` of the tiny config as deployment distill/tiny in a
subprocess, and the REST calls the Prefect UI makes. One of each per test session, shared by
tests/test_deploy.py and tests/test_ui.py (tests/conftest.py registers the fixtures: servers, served, default_run).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from tests.pipeline_fixtures import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = "tiny"
CRON = "0 3 * * *"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
FINAL_STATE_NAMES = {"Completed", "Cached", "Failed", "Crashed", "Cancelled"}
# The last stages of the tiny config's default run (export.merge on): seen in the API once the run is recorded.
LAST_STAGES = ("export", "evaluate-merged")


_GIVEN: set[int] = set()  # ports free_ports handed out in this process (never twice)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 for servers a test starts: below the ephemeral range, where no outgoing
    connection (a health check, a server's own client) can take one between this check and the server's bind (a
    port the kernel hands out for bind(0) lies inside that range: "address already in use" once in a while), held
    open together while they are chosen, and none handed out before in this process."""
    low = _ephemeral_range()[0]
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            port = rng.randrange(10_000, low)
            if port in _GIVEN:
                continue
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            _GIVEN.add(port)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Servers:
    """The two servers infra/up.sh started (state under `data`)."""

    data: Path
    prefect_port: int
    mlflow_port: int

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}"

    @property
    def api_url(self) -> str:
        return f"{self.ui_url}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30)


@contextmanager
def shared(key: str, start: Callable[[], AbstractContextManager[Any]]) -> Iterator[Any]:
    """One `start()` per session, however many test modules import the fixture that asks for it (each module
    that imports a fixture gets its own copy of it): started by the first, stopped when the last ends."""
    if key not in _SHARED:
        stack = ExitStack()
        _SHARED[key] = (stack, stack.enter_context(start()))
    _USERS[key] += 1
    try:
        yield _SHARED[key][1]
    finally:
        _USERS[key] -= 1
        if _USERS[key] == 0:
            _SHARED.pop(key)[0].close()


_SHARED: dict[str, tuple[ExitStack, Any]] = {}
_USERS: Counter[str] = Counter()


@pytest.fixture(scope="session", name="servers")
def _servers() -> Iterator[Servers]:
    """infra/up.sh on free ports in a tmp data dir; infra/down.sh at the end of the session."""
    with shared("servers", start_servers) as servers:
        yield servers


@contextmanager
def start_servers() -> Iterator[Servers]:
    """infra/up.sh on free ports in a tmp data dir; infra/down.sh on exit."""
    servers = Servers(Path(tempfile.mkdtemp(prefix="distillery-servers-")), *free_ports(2))
    env = {
        **os.environ,
        "PREFECT_PORT": str(servers.prefect_port),
        "MLFLOW_PORT": str(servers.mlflow_port),
        "MLFLOW_WORKERS": "1",
        "SERVER_WAIT_S": "240",
        # The UI asks this URL for the API (its default is port 4200).
        "PREFECT_UI_API_URL": servers.api_url,
    }
    try:
        up = subprocess.run([ROOT / "infra/up.sh", servers.data], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, f"infra/up.sh failed:\n{up.stdout}{up.stderr}"
        yield servers
    finally:
        down = subprocess.run([ROOT / "infra/down.sh", servers.data], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr


# ---------------------------------------------------------------------------------------------- the UI's calls


def create_run(servers: Servers, deployment_id: str, parameters: dict[str, Any] | None = None) -> str:
    """Start a run of the deployment as the UI's Run button does (quick run: no parameters, the deployment's
    defaults; custom run: the form's parameters); return the flow run id."""
    body: dict[str, Any] = {"state": {"type": "SCHEDULED", "message": "Run from the Prefect UI"}}
    if parameters is not None:
        body["parameters"] = parameters
    with servers.api() as api:
        # 503: an error the server calls retryable (its database busy); Prefect's own client retries it too
        for attempt in range(6):
            reply = api.post(f"/deployments/{deployment_id}/create_flow_run", json=body)
            if reply.status_code != 503:
                break
            time.sleep(0.5 * 2**attempt)
    assert reply.status_code == 201, reply.text
    return str(reply.json()["id"])


def flow_run(servers: Servers, flow_run_id: str) -> dict[str, Any]:
    with servers.api() as api:
        reply = api.get(f"/flow_runs/{flow_run_id}")
    reply.raise_for_status()
    return reply.json()


def wait_run(servers: Servers, flow_run_id: str, timeout: float = 300) -> dict[str, Any]:
    """The flow run once it reached a final state (fails the test past `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = flow_run(servers, flow_run_id)
        if run["state"]["type"] in FINAL:
            return run
        time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} not finished after {timeout:.0f} s: {run['state']}")


def stage_states(
    servers: Servers,
    flow_run_id: str,
    since: datetime | None = None,
    expect: Iterable[str] = (),
    timeout: float = 120,
) -> dict[str, str]:
    """{task run name: state name} of a flow run's stage tasks (Completed = ran, Cached = reused), of the task
    runs created after `since` (a retried flow run keeps its earlier attempts' task runs).

    Prefect 3 records task runs from the client's events, which can reach the API well after the flow run's own
    final state on a busy machine (a run seen COMPLETED with its last stages missing and a shard still under its
    provisional name): wait, up to `timeout` s, until every name in `expect` is there and every state is final."""
    deadline = time.monotonic() + timeout
    while True:
        stages = _stage_states_now(servers, flow_run_id, since)
        settled = set(expect) <= set(stages) and all(state in FINAL_STATE_NAMES for state in stages.values())
        if settled or time.monotonic() > deadline:
            return stages
        time.sleep(1)


def _stage_states_now(servers: Servers, flow_run_id: str, since: datetime | None) -> dict[str, str]:
    found: list[dict[str, Any]] = []
    with servers.api() as api:
        while True:
            body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200, "offset": len(found)}
            reply = api.post("/task_runs/filter", json=body)
            reply.raise_for_status()
            found += reply.json()
            if len(reply.json()) < 200:
                break
    runs = [t for t in found if since is None or datetime.fromisoformat(t["created"]) >= since]
    return {t["name"]: (t["state"] or {}).get("name", "") for t in runs}  # a run just created has no state yet


# ---------------------------------------------------------------------------------------------- serving


@dataclass(frozen=True)
class Served:
    """`distillery serve` of the tiny config: deployment distill/tiny on `servers`."""

    servers: Servers
    process: subprocess.Popen[bytes]
    deployment: dict[str, Any]
    config: Path
    workdir: Path
    log: Path
    home: Path  # PREFECT_HOME of the serving process and the CLI calls of the tests

    @property
    def deployment_id(self) -> str:
        return str(self.deployment["id"])

    def env(self) -> dict[str, str]:
        """Environment of a Prefect client of this server (the `prefect` CLI)."""
        return {**os.environ, "PREFECT_API_URL": self.servers.api_url, "PREFECT_HOME": str(self.home)}


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _stop(process: subprocess.Popen[bytes]) -> bool:
    """SIGTERM (the runner pauses its deployment and exits), then SIGKILL the process group after 60 s;
    whether SIGTERM sufficed."""
    if process.poll() is not None:
        return True
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return False
    return True


@pytest.fixture(scope="session", name="served")
def _served(servers: Servers) -> Iterator[Served]:
    """`distillery serve CONFIG --cron ... --name tiny` in a subprocess until the end of the session; then
    stopped, with no process of it left behind."""
    from tests.gpu_fixtures import device_or_skip

    device_or_skip()  # the served runs train on the GPU (lavapipe here)
    with shared("served", lambda: serve_tiny(servers)) as served:
        yield served


@contextmanager
def serve_tiny(servers: Servers) -> Iterator[Served]:
    """`distillery serve` of the tiny config as distill/tiny on `servers` (stopped on exit)."""
    root = Path(tempfile.mkdtemp(prefix="distillery-served-"))
    workdir, home, log = root / "run", root / "prefect-home", root / "serve.log"
    config = root / "tiny.yaml"
    cfg = tiny_config(workdir, train={"max_steps_per_epoch": 4}, run={"mlflow_uri": servers.mlflow_url})
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    env = {**os.environ, "PREFECT_API_URL": servers.api_url, "PREFECT_HOME": str(home)}
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # Prefect's default 10 s: each run the tests create starts sooner
    command = [str(Path(sys.executable).parent / "distillery"), "serve", str(config)]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*command, "--cron", CRON, "--name", DEPLOYMENT],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the teardown can reach every child
        )
    descendants: list[psutil.Process] = []
    graceful = False
    try:
        deadline = time.monotonic() + 180
        deployment = None
        with servers.api() as api:
            while deployment is None:
                if process.poll() is not None:
                    pytest.fail(f"distillery serve exited with {process.returncode}:\n{_tail(log)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"distillery serve: no deployment distill/{DEPLOYMENT} after 180 s:\n{_tail(log)}")
                reply = api.get(f"/deployments/name/distill/{DEPLOYMENT}")
                if reply.status_code == 200 and "served and polling" in log.read_text(errors="replace"):
                    deployment = reply.json()
                else:
                    time.sleep(1)
        yield Served(servers, process, deployment, config, workdir, log, home)
        descendants = psutil.Process(process.pid).children(recursive=True)
    finally:
        graceful = _stop(process)
    assert graceful, f"distillery serve ignored SIGTERM for 60 s:\n{_tail(log)}"
    _, alive = psutil.wait_procs(descendants, timeout=30)  # children may take a moment after their parent
    left = [f"{p.pid} {p.cmdline()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of distillery serve still running 30 s after it stopped: {left}"


@dataclass(frozen=True)
class FinishedRun:
    """A flow run of the served deployment, finished."""

    id: str
    run: dict[str, Any]
    stages: dict[str, str]


@pytest.fixture(scope="session", name="default_run")
def _default_run(served: Served) -> FinishedRun:
    """One run of distill/tiny with the deployment's parameters sent the way the UI's form sends them."""
    if "default_run" not in _SHARED:
        _SHARED["default_run"] = (ExitStack(), first_run(served))
    return _SHARED["default_run"][1]  # type: ignore[no-any-return]


def first_run(served: Served) -> FinishedRun:
    """Trigger distill/tiny with its parameters as the UI's run form sends them; wait until it finishes."""
    run_id = create_run(served.servers, served.deployment_id, served.deployment["parameters"])
    run = wait_run(served.servers, run_id)
    assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{_tail(served.log)}"
    return FinishedRun(run_id, run, stage_states(served.servers, run_id, expect=LAST_STAGES))
