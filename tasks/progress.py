"""Progress of long task bodies (upload, teacher shards, training steps, evaluation): a rich bar with ETA on a
terminal; on a log (stdout not a TTY: a worker, CI, `make demo | tee`) a line at least every PERIOD seconds of
progress with done/total, rate, elapsed time and ETA, through the same Bar API, to the run's logger."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

_console = Console(stderr=True)
log = logging.getLogger(__name__)
PERIOD = 10.0  # seconds between two progress lines on a log


class Bar:
    """One progress line: advance it, and set the free-text fields shown after the bar."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1, **fields: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=n, info=" ".join(f"{k} {v}" for k, v in fields.items()))


def _seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class LogBar(Bar):
    """A bar for logs: `emit` gets a line when it starts, on the first advance at least `period` seconds after
    the last line, and when it closes: '<description>: done/total (pct), rate/s, elapsed, ETA, fields'."""

    def __init__(
        self,
        description: str,
        total: float | None,
        emit: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        period: float = PERIOD,
    ) -> None:
        super().__init__(None, None)
        self.description, self.total, self.emit, self.clock, self.period = description, total, emit, clock, period
        self.done = 0.0
        self.fields: dict[str, str] = {}
        self.start = self.last = clock()
        emit(f"{description}: started" + (f", {_count(total)} to do" if total else ""))

    def advance(self, n: float = 1, **fields: str) -> None:
        self.done += n
        self.fields.update(fields)
        now = self.clock()
        if now - self.last >= self.period:
            self.last = now
            self.emit(self.line(now))

    def line(self, now: float) -> str:
        """The progress line at time `now`."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.description}: {_count(self.done)}"]
        if self.total:
            parts[0] += f"/{_count(self.total)} ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{rate:.3g}/s")
        parts.append(f"elapsed {_seconds(elapsed)}")
        if self.total and rate > 0 and self.done < self.total:
            parts.append(f"ETA {_seconds((self.total - self.done) / rate)}")
        parts += [f"{k} {v}" for k, v in self.fields.items()]
        return ", ".join(parts)

    def close(self, failed: bool = False) -> None:
        """The closing line (always), with the final count and rate; `failed`: the work stopped on an error."""
        word = "stopped" if failed else "done"
        self.emit(self.line(self.clock()).replace(f"{self.description}: ", f"{self.description} {word}: ", 1))


def _count(x: float | None) -> str:
    return f"{x:.0f}" if x is not None and float(x).is_integer() else f"{x:.1f}"


def _emit_to_run_log(line: str) -> None:
    """The current Prefect run's logger (a task or flow run), else this module's logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().info("%s", line)
    except MissingContextError:
        log.info("%s", line)


@contextmanager
def bar(description: str, total: float | None) -> Iterator[Bar]:
    """A transient progress bar with ETA on a terminal; progress lines on the run's log otherwise."""
    if not _console.is_terminal:
        logged = LogBar(description, total, _emit_to_run_log)
        try:
            yield logged
        except BaseException:
            logged.close(failed=True)
            raise
        logged.close()
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=_console,
        transient=True,
    )
    with progress:
        yield Bar(progress, progress.add_task(description, total=total, info=""))
