"""Fault injection for crash/resume tests: DISTILLERY_FAULT="teacher.shard=1,train.step=3".

`check(point, index)` raises InjectedFault when the variable names that point and index. Points:
  teacher.shard=i   after top-k shard i is written and recorded (the task then fails)
  train.step=n      after optimizer step n (global, 1-based) and any checkpoint of that step
A test sets the variable, runs the flow (which fails), clears it and runs again: the rerun must resume.
"""

from __future__ import annotations

import os

ENV = "DISTILLERY_FAULT"


class InjectedFault(RuntimeError):
    """A failure injected on purpose through DISTILLERY_FAULT."""


def _armed() -> dict[str, set[int]]:
    spec = os.environ.get(ENV, "").strip()
    points: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected point=index items such as teacher.shard=1")
        points.setdefault(name.strip(), set()).add(int(value))
    return points


def check(point: str, index: int) -> None:
    """Raise InjectedFault if DISTILLERY_FAULT arms `point` at `index`."""
    if index in _armed().get(point, set()):
        raise InjectedFault(f"injected fault at {point}={index} ({ENV})")
