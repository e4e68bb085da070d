"""infra/compose.yaml without a container runtime: its structure parsed and the authentication wiring checked
(the secrets required from infra/.env, never defaulted or written in the repository; the worker sends what the
servers ask for; ports on loopback), and infra/secret.sh run on a copy to show it writes what compose reads."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
SECRETS = {"DISTILLERY_PREFECT_AUTH", "DISTILLERY_MLFLOW_PASSWORD"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+])?([^}]*)\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "compose.yaml").read_text(encoding="utf-8"))


def _required(value: str, name: str) -> bool:
    """`value` is exactly ${name:?message}: compose refuses to start without it."""
    m = _VAR.fullmatch(value)
    return m is not None and m.group(1) == name and m.group(2) == ":?"


def test_services_and_mounted_files(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "prefect", "mlflow", "worker"}
    for name, service in services.items():
        assert "image" in service, name
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)  # loopback only
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith("."):
                assert (INFRA / source).exists(), (name, volume)
            else:
                assert source in compose["volumes"], (name, volume)
    assert services["prefect"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert set(services["worker"]["depends_on"]) == {"prefect", "mlflow"}


def test_every_secret_is_required_from_the_env_file_and_wired_to_both_ends(compose: dict[str, Any]) -> None:
    text = (INFRA / "compose.yaml").read_text(encoding="utf-8")
    variables = {m.group(1) for m in _VAR.finditer(text)}
    assert variables == SECRETS, variables  # nothing else interpolated
    for m in _VAR.finditer(text):  # required (":?"), never a default (":-") that would start an open server
        assert m.group(2) == ":?", m.group(0)
    prefect, mlflow, worker = (compose["services"][s]["environment"] for s in ("prefect", "mlflow", "worker"))
    assert _required(prefect["PREFECT_SERVER_API_AUTH_STRING"], "DISTILLERY_PREFECT_AUTH")
    assert _required(worker["PREFECT_API_AUTH_STRING"], "DISTILLERY_PREFECT_AUTH")
    assert _required(mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"], "DISTILLERY_MLFLOW_PASSWORD")
    assert _required(worker["MLFLOW_TRACKING_PASSWORD"], "DISTILLERY_MLFLOW_PASSWORD")
    command = " ".join(compose["services"]["mlflow"]["command"])
    assert "--app-name basic-auth" in command and "MLFLOW_FLASK_SERVER_SECRET_KEY" in command
    ini = (INFRA / "mlflow-auth.ini").read_text(encoding="utf-8")
    admin = re.search(r"^admin_username\s*=\s*(\S+)", ini, re.M)
    assert admin is not None and admin.group(1) == worker["MLFLOW_TRACKING_USERNAME"]
    assert not re.search(r"^admin_password", ini, re.M)  # the password comes from the env file only
    assert mlflow["MLFLOW_AUTH_CONFIG_PATH"] == "/etc/mlflow-auth.ini"
    assert "mlflow_auth" in ini and "mlflow_auth" in (INFRA / "postgres-init.sql").read_text(encoding="utf-8")


def test_secret_sh_writes_what_compose_reads_and_the_file_is_ignored(tmp_path: Path) -> None:
    infra = tmp_path / "infra"
    infra.mkdir()
    shutil.copy(INFRA / "secret.sh", infra / "secret.sh")
    for _ in range(2):  # a second run keeps the secrets
        subprocess.run(["bash", str(infra / "secret.sh")], check=True, capture_output=True)
    env_file = infra / ".env"
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert set(values) == SECRETS
    assert re.fullmatch(r"distillery:[0-9a-f]{48}", values["DISTILLERY_PREFECT_AUTH"])
    assert re.fullmatch(r"[0-9a-f]{48}", values["DISTILLERY_MLFLOW_PASSWORD"])
    assert stat.S_IMODE(os.stat(env_file).st_mode) == 0o600
    ignored = subprocess.run(["git", "check-ignore", "-q", "infra/.env"], cwd=ROOT)
    assert ignored.returncode == 0  # never committed
