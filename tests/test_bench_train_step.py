"""bench/train_step.py on lavapipe at the tiny shape, our side only: the JSON rows a user's run prints (the step,
its kept blocks, the --ab variants timed on the same weights, one switch or two at once), and the switches --ab
flips put back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_fixtures import device_or_skip

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_our_side_prints_the_step_and_its_ab_variants() -> None:
    device_or_skip()
    cmd = [sys.executable, str(ROOT / "bench" / "train_step.py"), "--shape", "tiny", "--batch", "1", "--seq", "32"]
    cmd += ["--no-torch", "--no-teacher", "--steps", "1", "--repeats", "1", "--kept-blocks", "1"]
    cmd += ["--ab", "baseline,kd-two-pass,kd-two-pass+lora-dual", "--switch", "lora-fast-paths"]
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    step = next(r for r in rows if r.get("what") == "train_step")
    assert step["switches"] == "lora-fast-paths"
    assert step["kept_blocks"] == 1 and step["kept_bytes"] > 0 and step["skipped_steps"] == 0
    ab = {r["variant"]: r for r in rows if r.get("what") == "train_step_ab"}
    assert set(ab) == {"baseline", "kd-two-pass", "kd-two-pass+lora-dual"}
    for row in ab.values():
        assert row["tokens_per_s"] > 0 and all(math.isfinite(x) for x in row["losses"])
    assert rows[-1]["what"] == "summary" and rows[-1]["ours_loss_finite_and_decreasing"]


def test_ab_switches_are_put_back() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.train_step import AB_SWITCHES, _switch

    for name, (_, _, trial) in AB_SWITCHES.items():
        old = _switch(name)
        assert _switch(name, old) == trial and _switch(name, old) == old, name
