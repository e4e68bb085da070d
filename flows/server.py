"""The CLI's temporary Prefect server (when no PREFECT_API_URL is set): one per workdir, shared, gone with its
last user.

Its state is PREFECT_HOME=<workdir>/.prefect (the SQLite database), so only one server may use it at a time:
    server.lock   held (flock) while a run looks for, starts or stops the server: two runs on a new workdir
                  never start two servers (or migrate one database twice)
    server.users  every run using the server holds a shared flock on it for its lifetime; the kernel drops it
                  when the run ends, however it ends (kill -9 included)
    server.json   pid, port and URL of the running server; server.log its output
The server runs `python -m flows.server HOME PORT` in a session of its own (a Ctrl-C in the terminal reaches the
run, which then stops it) with a watchdog thread that stops it once no run holds server.users: a run killed
with -9 never leaves it behind, and a second run on the same workdir reuses it meanwhile. The last run to leave
stops it at once (SIGTERM, then SIGKILL). Start-up waits DISTILLERY_SERVER_TIMEOUT_S seconds (default 180, so a
busy machine is not mistaken for a broken server). A new home's database is a copy of an empty migrated one
(flows/prefect_store.py). This module imports only the standard library until the server process itself starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

TIMEOUT_ENV = "DISTILLERY_SERVER_TIMEOUT_S"
MARK_ENV = "DISTILLERY_PREFECT_SERVER"  # "temporary" while a run uses this server (tasks.tracking: no UI link)
DEFAULT_TIMEOUT_S = 180.0
LOCK_FILE, USERS_FILE, INFO_FILE, LOG_FILE = "server.lock", "server.users", "server.json", "server.log"
WATCHDOG_PERIOD_S = 0.25
STOP_GRACE_S = 10.0


class ServerError(RuntimeError):
    """The temporary Prefect server could not be started; the message names its log."""


def startup_timeout() -> float:
    """Seconds to wait for the server to answer (DISTILLERY_SERVER_TIMEOUT_S, default 180)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ServerError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ServerError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[IO[bytes]]:
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), mode)
        try:
            yield fh
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not a server
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _read_info(home: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((home / INFO_FILE).read_text(encoding="utf-8"))
        return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _stop(pid: int, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; returns once the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)


class TemporaryServer:
    """`with TemporaryServer(home) as api_url:` a Prefect API for this run, started or reused (see module doc).
    `meanwhile(api_url)`, when given, is called as soon as the URL is known, while a new server starts: the run's
    own imports overlap the server's."""

    def __init__(
        self, home: str | Path, timeout: float | None = None, meanwhile: Callable[[str], None] = lambda url: None
    ) -> None:
        self.home = Path(home)
        self.timeout = startup_timeout() if timeout is None else timeout
        self.meanwhile = meanwhile
        self._users: IO[bytes] | None = None
        self.started = False

    def __enter__(self) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        self._users = open(self.home / USERS_FILE, "a+b")
        # Blocks while a server that lost its last user shuts down (its watchdog holds the lock exclusively).
        fcntl.flock(self._users.fileno(), fcntl.LOCK_SH)
        try:
            with _flock(self.home / LOCK_FILE, fcntl.LOCK_EX):
                info = _read_info(self.home)
                if info is not None and _alive(info["pid"]) and _answers(info["url"]):
                    self.meanwhile(str(info["url"]))
                    return str(info["url"])
                return self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _start(self) -> str:
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        log_path = self.home / LOG_FILE
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flows.server", str(self.home), str(port)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches the run, which stops the server
                cwd=Path(__file__).resolve().parents[1],
            )
        info = {"pid": proc.pid, "port": port, "url": url}
        tmp = self.home / f".{INFO_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info), encoding="utf-8")
        os.replace(tmp, self.home / INFO_FILE)
        self.started = True
        deadline = time.monotonic() + self.timeout
        self.meanwhile(url)
        while not _answers(url, timeout=min(5.0, self.timeout)):
            if proc.poll() is not None:
                raise ServerError(
                    f"the temporary Prefect server exited during start-up (code {proc.returncode}); see {log_path}"
                )
            if time.monotonic() > deadline:
                _stop(proc.pid)
                raise ServerError(
                    f"the temporary Prefect server did not answer within {self.timeout:g} s ({TIMEOUT_ENV}); "
                    f"see {log_path}, or start one (infra/up.sh) and set PREFECT_API_URL"
                )
            time.sleep(0.1)
        return url

    def __exit__(self, *exc: object) -> None:
        """Leave the server; the last run to leave stops it (else its watchdog does, within a second)."""
        if self._users is None:
            return
        self._users.close()  # drops this run's shared lock
        self._users = None
        with _flock(self.home / LOCK_FILE, fcntl.LOCK_EX), open(self.home / USERS_FILE, "a+b") as users:
            try:
                fcntl.flock(users.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another run still uses it, or its watchdog is already stopping it
            info = _read_info(self.home)
            if info is not None and _alive(info["pid"]):
                _stop(info["pid"])
            with contextlib.suppress(FileNotFoundError):
                (self.home / INFO_FILE).unlink()


# ---------------------------------------------------------------------------------------------- the server process


def _watchdog(home: Path, stop: threading.Event) -> None:
    """Hold server.users exclusively as soon as no run holds it, then stop the server (exit within 10 s)."""
    users = open(home / USERS_FILE, "a+b")
    while True:
        try:
            fcntl.flock(users.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(WATCHDOG_PERIOD_S)
    stop.set()  # keeps the lock until the process exits: a new run waits, then starts a fresh server
    time.sleep(STOP_GRACE_S)
    os._exit(0)


def serve(home: Path, port: int) -> None:
    """Run the Prefect API (no UI) on 127.0.0.1:port until no run uses it or SIGTERM."""
    stop = threading.Event()
    threading.Thread(target=_watchdog, args=(home, stop), daemon=True, name="users-watchdog").start()
    import uvicorn
    from prefect.server.api.server import create_app

    from flows.prefect_store import prepare_database

    print(f"database: {prepare_database(home)}", flush=True)  # server.log: seeded, migrated or as is
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(ephemeral=True, final=True),
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )

    def stop_when_unused() -> None:
        stop.wait()
        server.should_exit = True

    threading.Thread(target=stop_when_unused, daemon=True, name="stopper").start()
    if stop.is_set():
        return
    server.run()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
