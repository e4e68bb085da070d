"""One local Ray cluster per test session (2 CPUs, no dashboard), shared by the tests/test_ray_*.py modules that
import the fixture, shut down at the end of the session. Starting it costs ~15 s on the 2-core CI box.

    from tests.ray_fixtures import _ray_cluster  # noqa: F401 (fixture)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session", name="ray_cluster")
def _ray_cluster() -> Iterator[Any]:
    """The ray module, connected to a fresh local cluster of 2 CPUs (distillery's connect() then reuses it)."""
    import ray

    if not ray.is_initialized():  # each importing module holds its own fixture; the first one starts the cluster
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    if ray.is_initialized():  # at the end of the session (session fixtures end together)
        ray.shutdown()
