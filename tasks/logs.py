"""Route the library's logging (stages, training, data) to Prefect's run logger while a task body runs, so
stage messages show in the run's log and the Prefect UI."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import get_run_logger

LIBRARY_LOGGERS = ("stages", "training", "data")


class _ToRunLogger(logging.Handler):
    """Re-log records of this thread on a Prefect run logger."""

    def __init__(self, run_logger: Any, thread: int) -> None:
        super().__init__(logging.INFO)
        self.run_logger, self.thread = run_logger, thread

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.run_logger.log(record.levelno, "%s", record.getMessage())


@contextmanager
def prefect_logs() -> Iterator[None]:
    """Within the block, INFO and above from the library loggers go to the current task or flow run's log
    (only there: they do not propagate to the root logger meanwhile)."""
    handler = _ToRunLogger(get_run_logger(), threading.get_ident())
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False  # once, through the run logger (Prefect's root console handler would repeat it)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
