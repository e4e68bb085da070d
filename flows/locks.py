"""One run per workdir at a time: runs on the same workdir share stage folders (tokens, top-k shards,
checkpoints), so a second run waits for the first (a flock on <workdir>/.cache/run.lock, dropped by the kernel
however the holder ends, kill -9 included) and then reuses what it cached."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK = Path(".cache") / "run.lock"


@contextlib.contextmanager
def workdir_lock(root: Path, waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the workdir's run lock for the block; `waiting(holder)` is called once if another run holds it."""
    path = root / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                fh.seek(0)
                waiting(fh.read().strip() or "another run")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
