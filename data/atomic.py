"""Atomic files: written under a temporary name in the same folder, fsynced, renamed into place, the folder
fsynced; a reader sees the old file or the whole new one, never a torn one.

The one place a data file is written: an OS error (a full disk, no permission) is a WriteError, one line naming
the final file and the OS error (`[Errno 28] <path>: cannot write: No space left on device`), and the temporary
file is removed. tasks/faults.py's write points fire at its os.replace.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


class WriteError(OSError):
    """A file could not be written (a full disk, no permission): one line naming the file and the OS error."""


def fsync_dir(folder: Path) -> None:
    """fsync a folder (its entries: a rename into it survives a crash); a no-op where folders have no fd."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: Path, exc: OSError) -> WriteError:
    if exc.errno is None:
        return WriteError(f"{path}: cannot write: {exc}")
    return WriteError(exc.errno, f"{path}: cannot write: {exc.strerror or os.strerror(exc.errno)}")


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file handle whose content becomes `path` atomically when the block ends without an error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise _write_error(path, exc) from None
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (atomic_file)."""
    with atomic_file(path) as fh:
        fh.write(data)
