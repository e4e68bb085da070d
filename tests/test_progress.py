"""Progress on a log (stdout not a TTY): tasks.progress.LogBar's lines, driven by a fake clock."""

from __future__ import annotations

import io
import logging

import pytest
from prefect.logging.configuration import setup_logging
from rich.console import Console

from tasks import progress

setup_logging()  # what Prefect does on its first get_run_logger(): before caplog attaches its handler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_bar_emits_a_line_every_period_with_rate_and_eta() -> None:
    clock, lines = Clock(), []
    bar = progress.LogBar("teacher shard 3", 40, lines.append, clock=clock, period=10.0)
    assert lines == ["teacher shard 3: started, 40 to do"]
    for _ in range(4):  # 4 s: quiet
        clock.now += 1.0
        bar.advance(1)
    assert len(lines) == 1
    for _ in range(6):  # 10 s in, 10 done: one line
        clock.now += 1.0
        bar.advance(1, loss="0.5000")
    assert lines[1] == "teacher shard 3: 10/40 (25%), 1/s, elapsed 10 s, ETA 30 s, loss 0.5000"
    clock.now += 9.0
    bar.advance(10, loss="0.2500")  # 9 s after the last line: quiet
    assert len(lines) == 2
    clock.now += 1.0
    bar.advance(2)  # 10 s after the last line
    assert lines[2] == "teacher shard 3: 22/40 (55%), 1.1/s, elapsed 20 s, ETA 16 s, loss 0.2500"
    clock.now += 130.0
    bar.advance(18)
    assert lines[3] == "teacher shard 3: 40/40 (100%), 0.267/s, elapsed 2 min 30 s, loss 0.2500"
    bar.close()
    assert lines[4] == "teacher shard 3 done: 40/40 (100%), 0.267/s, elapsed 2 min 30 s, loss 0.2500"


def test_log_bar_without_total() -> None:
    clock, lines = Clock(), []
    bar = progress.LogBar("upload", None, lines.append, clock=clock, period=10.0)
    clock.now += 12.0
    bar.advance(3)
    assert lines == ["upload: started", "upload: 3, 0.25/s, elapsed 12 s"]


def test_bar_logs_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Outside a Prefect run the lines go to the module's logger; a failure closes the bar as stopped."""
    monkeypatch.setattr(progress, "_console", Console(file=io.StringIO()))  # like a log file: not a terminal
    with caplog.at_level(logging.INFO, logger="tasks.progress"):
        with progress.bar("evaluate", 2) as b:
            b.advance(2)
        with pytest.raises(RuntimeError), progress.bar("train epoch 0", 5) as b:
            raise RuntimeError("boom")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "evaluate: started, 2 to do"
    assert messages[1].startswith("evaluate done: 2/2 (100%)")
    assert messages[2] == "train epoch 0: started, 5 to do"
    assert messages[3].startswith("train epoch 0 stopped: 0/5 (0%)")
