"""bench/dispatch_cost.py on lavapipe: a row per case and size, each dispatch's share of its pass's GPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_fixtures import device_or_skip

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_prints_the_three_cases_per_size() -> None:
    device_or_skip()
    cmd = [sys.executable, str(ROOT / "bench" / "dispatch_cost.py"), "--dispatches", "6", "--elements", "256,1000"]
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    done = subprocess.run([*cmd, "--reps", "1"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert "device" in rows[0]
    timed = rows[1:]
    assert [(r["case"], r["elements"]) for r in timed] == [
        (case, n) for n in (256, 1000) for case in ("chain", "independent", "alone")
    ]
    for r in timed:
        assert r["dispatches"] == 6 and r["workgroups"] == -(-r["elements"] // 256)
        assert r["gpu_us"] > 0 and abs(r["us_per_dispatch"] * 6 - r["gpu_us"]) <= 0.01 * r["gpu_us"] + 0.01
