"""Atomic files: every artifact is written to a temporary name next to its place, fsynced, renamed into place
(os.replace, where tasks/faults.py injects its crashes) and its folder fsynced, so a reader sees the old file or
the whole new one, never a part."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def temp_name(path: Path) -> Path:
    """A fresh temporary name next to `path`: .<name>.tmp-<pid>-<random> (a writer clears its own leftovers by
    the prefix .<name>.tmp-)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(folder: Path) -> None:
    """fsync a folder (its renames are durable after this); nothing on platforms without directory fds."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into; on a clean exit it is fsynced, renamed into place and
    its folder fsynced; on an error the temporary file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (atomic_file)."""
    with atomic_file(path) as fh:
        fh.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` as UTF-8 to `path` atomically (atomic_file)."""
    atomic_write_bytes(path, text.encode("utf-8"))
