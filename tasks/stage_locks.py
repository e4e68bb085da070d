"""Locks of the stage cache's records, so that two flow runs reaching the same stage with the same content key
(two workers, one workdir) compute it once: the first holds the record's lock while it computes, the second
waits and then reads the committed record (Prefect's SERIALIZABLE cache isolation, tasks/caching.py).

Prefect's own FileSystemLockManager keeps a lock until it is released or times out, so a worker killed during a
stage would leave its lock to the next attempt; these are kernel file locks (flock) on
<result storage>/.locks/<record>.lock, dropped by the kernel when the holding process ends, however it ends.
They hold across processes on one machine and, on a shared filesystem, where flock is coherent between clients
(NFSv4, CephFS, Lustre with flock; not NFSv3 without a lock manager, not object stores: docs/team.md).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.2


def _result_folder() -> Path:
    """The current result store's local folder (the workdir's stage cache)."""
    from prefect.results import get_result_store

    resolve = getattr(get_result_store().result_storage, "_resolve_path", None)
    if resolve is None:
        raise RuntimeError("stage locks need local result storage (a folder) for the stage cache")
    return Path(resolve("."))


class FlockLockManager:
    """Prefect LockManager over flock: one lock file per record key under folder() / ".locks"."""

    def __init__(self, folder: Callable[[], Path] = _result_folder) -> None:
        self._folder = folder
        # key -> (file descriptor, holder); single dict operations (atomic in CPython) keep it consistent across
        # threads without a lock object, so Prefect can copy a cache policy that holds this manager
        self._held: dict[str, tuple[int, str]] = {}

    def _path(self, key: str) -> Path:
        d = self._folder() / ".locks"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{key}.lock"

    def _try(self, key: str) -> int | None:
        """An open descriptor holding key's lock, or None when someone else holds it."""
        fd = os.open(self._path(key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def acquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        """Block until key's lock is ours (or acquire_timeout passes: False). hold_timeout is not supported: the
        lock lasts until released or until the holding process ends."""
        if self.is_lock_holder(key, holder):
            return True
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            fd = self._try(key)
            if fd is not None:
                os.ftruncate(fd, 0)
                os.write(fd, f"pid {os.getpid()} holder {holder}\n".encode())
                self._held[key] = (fd, holder)
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    async def aacquire_lock(
        self, key: str, holder: str, acquire_timeout: float | None = None, hold_timeout: float | None = None
    ) -> bool:
        return await asyncio.to_thread(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        held = self._held.get(key)
        if held is None or held[1] != holder:
            raise ValueError(f"stage lock {key!r} is not held by {holder!r}")
        del self._held[key]
        fcntl.flock(held[0], fcntl.LOCK_UN)
        os.close(held[0])

    def is_locked(self, key: str) -> bool:
        if key in self._held:
            return True
        fd = self._try(key)
        if fd is None:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return False

    def is_lock_holder(self, key: str, holder: str) -> bool:
        held = self._held.get(key)
        return held is not None and held[1] == holder

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_locked(key):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.wait_for_lock, key, timeout)


STAGE_LOCKS = FlockLockManager()
