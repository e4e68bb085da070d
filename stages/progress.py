"""Progress of a long stage step (upload, a teacher shard, an epoch): a factory of bars the caller chooses.

A stage opens `with bar(description, total) as b:` and calls `b.advance(n, **fields)`; the default draws
nothing (logging carries the numbers), and tasks/progress.py passes rich bars on a terminal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class Bar(Protocol):
    """One progress line: advance it, optionally with free-text fields (loss, lr, ...)."""

    def advance(self, n: float = 1, **fields: str) -> None: ...


BarFactory = Callable[[str, float | None], AbstractContextManager[Bar]]


class _Silent:
    def advance(self, n: float = 1, **fields: str) -> None:
        pass


@contextmanager
def no_bar(description: str, total: float | None) -> Iterator[Bar]:
    """A bar that shows nothing."""
    yield _Silent()
