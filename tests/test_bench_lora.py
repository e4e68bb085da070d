"""bench/lora.py on lavapipe: the split sweep prints each product's GPU time (its per-dispatch profiler rides on
gpu/profile.py's hooks) and results within the float64 reference's tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu_fixtures import device_or_skip
from tests.test_bench_train_step import ROOT

pytestmark = pytest.mark.gpu


def test_split_sweep_prints_per_dispatch_times() -> None:
    device_or_skip()
    cmd = [sys.executable, str(ROOT / "bench" / "lora.py"), "--tokens", "64", "--shapes", "64x32", "--no-torch"]
    cmd += ["--no-old", "--splits", "1024:128,64:16", "--seconds", "0.01"]
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][1:]
    assert [(r["target_workgroups"], r["min_chunk"]) for r in rows] == [(1024, 128), (64, 16)]
    for row in rows:
        assert max(row["max_rel_err"].values()) < 1e-4
        assert row["gpu_ms_fwd"] > 0 and len(row["gpu_us_fwd_by_dispatch"]) == row["dispatches"][0]
