"""Fault injection for crash/resume tests: DISTILLERY_FAULT="teacher.shard=1,train.step=3:kill".

Items are `point=value[:mode]`. `check(point, value)` acts when the variable arms that point at that value;
mode `raise` (the default) raises InjectedFault, mode `kill` ends the process at once with SIGKILL (no cleanup,
no flush: what `kill -9` does), mode `enospc` raises the OSError a full disk gives (errno 28), mode `hang` blocks
the first attempt of a flow run until something kills it (a worker dying mid-stage; later attempts pass). Points:
  teacher.shard=i        after top-k shard i is written and recorded (the task then fails)
  train.step=n           after optimizer step n (global, 1-based) and any checkpoint of that step
  after=<task run name>  after that stage ran and its result was stored (a stage boundary), e.g. after=student
  write=<file>           while a file is written atomically: its temp file is complete (mode kill: torn to half
                         its length) but not yet renamed into place. <file> is the final name, or its end
                         (step-00000002/adapter.safetensors), matched at os.replace, which every atomic writer ends with
A test sets the variable, runs the flow (which fails or dies), clears it and runs again: the rerun must resume.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

ENV = "DISTILLERY_FAULT"
MODES = ("raise", "kill", "enospc", "hang")


class InjectedFault(RuntimeError):
    """A failure injected on purpose through DISTILLERY_FAULT."""


def _armed() -> dict[str, dict[str, str]]:
    """{point: {value: mode}} from DISTILLERY_FAULT."""
    spec = os.environ.get(ENV, "").strip()
    points: dict[str, dict[str, str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        value, _, mode = rest.partition(":")
        mode = mode.strip() or "raise"
        if not sep or not name.strip() or not value.strip() or mode not in MODES:
            raise ValueError(f"{ENV}={spec!r}: expected point=value[:{'|'.join(MODES)}] items such as teacher.shard=1")
        points.setdefault(name.strip(), {})[value.strip()] = mode
    return points


def _act(mode: str, where: str) -> None:
    if mode == "hang":
        from prefect.runtime import flow_run

        if int(flow_run.run_count or 1) > 1:
            return
        while True:
            time.sleep(1)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise InjectedFault(f"injected fault at {where} ({ENV})")


def check(point: str, value: int | str) -> None:
    """Raise InjectedFault (or SIGKILL this process) if DISTILLERY_FAULT arms `point` at `value`."""
    mode = _armed().get(point, {}).get(str(value))
    if mode is not None:
        _act(mode, f"{point}={value}")


def _write_mode(destination: str) -> tuple[str, str] | None:
    """(armed value, mode) of a write point matching `destination` (by name or path ending), else None."""
    for value, mode in _armed().get("write", {}).items():
        if destination == value or destination.endswith("/" + value.lstrip("/")):
            return value, mode
    return None


def _install_write_faults() -> None:
    """Wrap os.replace so an armed write point fires before a file is renamed into place (only when armed)."""
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        hit = _write_mode(Path(os.fsdecode(dst)).as_posix())
        if hit is not None:
            value, mode = hit
            source = Path(os.fsdecode(src))
            if mode == "kill" and source.is_file():
                with open(source, "r+b") as fh:  # a torn write: what a crash mid-write leaves
                    fh.truncate(source.stat().st_size // 2)
            _act(mode, f"write={value}")
        real_replace(src, dst, *args, **kwargs)

    os.replace = replace


if "write" in _armed():
    _install_write_faults()
