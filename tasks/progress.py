"""Rich progress bars for long task bodies (upload, teacher shards, training steps); silent when not a TTY."""

from __future__ import annotations

from collections.abc import Iterator
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


class Bar:
    """One progress line: advance it, and set the free-text fields shown after the bar."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1, **fields: str) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=n, info=" ".join(f"{k} {v}" for k, v in fields.items()))


@contextmanager
def bar(description: str, total: float | None) -> Iterator[Bar]:
    """A transient progress bar with ETA on a terminal; a no-op Bar otherwise (logs carry the numbers)."""
    if not _console.is_terminal:
        yield Bar(None, None)
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
