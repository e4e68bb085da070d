"""tasks/tracking.py's run bookkeeping that the flow tests do not reach: a block that raises marks its MLflow run
FAILED and the exception goes on; a block that completes leaves the run's status to finish()."""

from __future__ import annotations

import pytest

from tasks.tracking import failed_on_error


class _Client:
    def __init__(self) -> None:
        self.terminated: list[tuple[str, str]] = []

    def set_terminated(self, run_id: str, status: str) -> None:
        self.terminated.append((run_id, status))


def test_a_raising_block_marks_the_run_failed() -> None:
    client = _Client()
    with pytest.raises(KeyboardInterrupt), failed_on_error(client, "r1"):
        raise KeyboardInterrupt  # BaseException too: an interrupted run is not left RUNNING
    assert client.terminated == [("r1", "FAILED")]


def test_a_completed_block_leaves_the_run_alone() -> None:
    client = _Client()
    with failed_on_error(client, "r1"):
        pass
    assert client.terminated == []
