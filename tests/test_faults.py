"""Crashes of the real CLI in subprocesses (tasks/faults.py's kill mode: SIGKILL, as `kill -9`): at stage
boundaries and in the middle of writing a teacher shard, a checkpoint and an export, each rerun resumes where
the last one died; the end state is the uninterrupted reference run's, byte for byte (adapter, exports, top-k
manifest: no shard missing or duplicated). Two concurrent runs on a new workdir and on a used one both succeed
(the second waits for the first). No process outlives any of it: the CLI's temporary Prefect server stops when
its run is killed, interrupted by SIGTERM or SIGHUP (exit 143 / 129, the resume hint) or ends.

One shared tiny config (the reference run's, in a workdir of its own); most runs use the session's Prefect test
server (PREFECT_API_URL), those that check the temporary server start their own. The crash chain (one process at a
time) runs in a thread while the other tests run theirs: each test owns a folder and looks only at processes naming
it; the chain is checked by the module's last test.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from data.atomic import WriteError, atomic_write_bytes
from data.topk import read_manifest
from schemas.manifests import CheckpointManifest, ExportManifest, sha256_file
from tests.pipeline_fixtures import (  # noqa: F401 (the fixtures prefect_harness and reference_run)
    _prefect_harness,
    _reference_run,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
KILLED = -signal.SIGKILL


def _env(fault: str | None = None, server: str | None = None) -> dict[str, str]:
    """The subprocess environment: Prefect state under the workdir, the given API URL (None: the CLI starts
    its temporary server), the fault armed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if server:
        env["PREFECT_API_URL"] = server
    if fault:
        env["DISTILLERY_FAULT"] = fault
    return env


def _cli(config: Path, command: str = "run", fault: str | None = None, server: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", command, str(config)],
        cwd=ROOT,
        env=_env(fault, server),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes (not zombies) that mention `text`, this one excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(f"{entry.name}: {cmd.strip()}")
    return found


def _orphans(root: Path, within: float = 20.0) -> list[str]:
    """The processes naming `root` still alive after waiting up to `within` seconds for them to go."""
    deadline = time.monotonic() + within
    while (alive := _processes_naming(str(root))) and time.monotonic() < deadline:
        time.sleep(0.25)
    return alive


def _no_orphans(root: Path, within: float = 20.0) -> None:
    alive = _orphans(root, within)
    assert not alive, alive


@pytest.fixture(scope="module")
def api_url(prefect_harness: None) -> str:
    import prefect.settings as ps

    return str(ps.PREFECT_API_URL.value())


def _config(root: Path, reference_cfg: dict[str, Any]) -> Path:
    """The reference run's config with its own workdir under `root`."""
    cfg = {**reference_cfg, "run": {**reference_cfg["run"], "workdir": str(root / "run")}}
    path = root / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


# Where each run dies, in pipeline order: (DISTILLERY_FAULT, whether the run uses the temporary server). Each
# boundary kind once (a stage's record stored, a teacher shard's, an epoch's, a write under way): every stage's
# boundary is the same hook (tasks/caching.py, once its result is stored), so the student's and the baseline
# evaluation's are not repeated here.
CRASHES = [
    ("after=tokenize:kill", False),
    ("after=teacher-plan:kill", False),
    ("write=topk-train-00001.parquet:kill", True),  # mid-write of a teacher shard, the temporary server up
    ("after=teacher-shard-3:kill", False),
    ("write=step-00000002/adapter.safetensors:kill", False),  # mid-write of a checkpoint, mid-epoch
    ("after=train-epoch-0:kill", False),
    ("write=adapter-lora.gguf:kill", True),  # mid-write of an export
    ("after=export:kill", False),
]


@dataclass
class Step:
    """One run of the crash chain: its fault (None: the last, clean run), exit status, output, and the processes
    naming the chain's folder still alive after it (looked for after the runs on a temporary server)."""

    fault: str | None
    code: int
    out: str
    orphans: list[str]


def _crash_chain(config: Path, api_url: str, stop: threading.Event) -> list[Step]:
    """The runs of CRASHES one after another on one workdir, then one without a fault; stops at the first run
    that does not die as planned (or when `stop` is set)."""
    steps: list[Step] = []
    for fault, temporary in CRASHES:
        if stop.is_set():
            return steps
        code, out = _finish(_cli(config, fault=fault, server=None if temporary else api_url))
        steps.append(Step(fault, code, out, _orphans(config.parent) if temporary else []))
        if code != KILLED:
            return steps
    code, out = _finish(_cli(config))  # the last run: the temporary server, nothing injected
    steps.append(Step(None, code, out, _orphans(config.parent)))
    return steps


@pytest.fixture(scope="module")
def crash_chain(
    reference_run: tuple[dict, dict], api_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Future[list[Step]]]]:
    """(workdir, the crash chain's steps to come): the chain runs in a thread from the first test of this module
    that asks for it, its CLI processes one at a time, while the module's other tests run theirs beside it (each
    test looks only for processes naming its own folder); the test at the module's end checks it."""
    root = tmp_path_factory.mktemp("crashes")
    config = _config(root, reference_run[0])
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_crash_chain, config, api_url, stop)
        yield root / "run", future
        stop.set()  # when the checking test did not run (deselected): end after the run under way


@pytest.mark.usefixtures("crash_chain")  # started first: it runs meanwhile
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_the_run_and_its_server_with_the_resume_hint(
    reference_run: tuple[dict, dict], tmp_path: Path, signum: signal.Signals
) -> None:
    config = _config(tmp_path, reference_run[0])
    proc = _cli(config)
    server_info = tmp_path / "run" / ".prefect" / "server.json"
    deadline = time.monotonic() + 240
    while not server_info.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the server starting, or the flow under way
    proc.send_signal(signum)
    code, out = _finish(proc, timeout=60)
    assert code == 128 + signum, out[-3000:]
    assert f"interrupted by {signum.name}: rerun the same command to resume from the cache" in out
    assert "Traceback" not in out
    _no_orphans(tmp_path)


@pytest.mark.usefixtures("crash_chain")
def test_concurrent_runs_on_a_new_and_on_a_used_workdir(reference_run: tuple[dict, dict], tmp_path: Path) -> None:
    """Two runs at once on a new workdir (each would start a temporary server on the same new Prefect
    database): both succeed, the second after waiting for the first. Then two on the now used workdir.
    (`distillery teacher`: the stages up to the teacher's, enough to share a database, a cache and shards.)"""
    config = _config(tmp_path, reference_run[0])
    first, second = _cli(config, "teacher"), _cli(config, "teacher")
    (code_a, out_a), (code_b, out_b) = _finish(first), _finish(second)
    assert (code_a, code_b) == (0, 0), out_a[-2000:] + out_b[-2000:]
    assert "waiting: another run" in out_a + out_b
    assert "ran: nothing (all cached)" in out_a + out_b  # the one that waited reused what the other made
    again = [_cli(config, "teacher") for _ in range(2)]
    for code, out in map(_finish, again):
        assert code == 0 and "ran: nothing (all cached)" in out, out[-2000:]
    _no_orphans(tmp_path)


def test_a_full_disk_is_one_line_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "step-00000002" / "adapter.safetensors"
    target.parent.mkdir()
    with pytest.raises(WriteError) as err:
        atomic_write_bytes(target, b"x" * 100)
    assert str(err.value) == f"[Errno 28] {target}: cannot write: No space left on device"
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    assert list(target.parent.iterdir()) == []  # the temporary file is gone, nothing in place


def test_killed_at_every_boundary_and_mid_write_resumes_to_the_reference_bytes(
    reference_run: tuple[dict, dict], crash_chain: tuple[Path, Future[list[Step]]]
) -> None:
    wd, future = crash_chain
    steps = future.result(timeout=len(CRASHES) * 300 + 600)
    for step, (fault, _) in zip(steps, CRASHES, strict=False):
        assert (step.fault, step.code) == (fault, KILLED), (fault, step.out[-3000:])
        assert not step.orphans, (fault, step.orphans)  # the killed run's temporary server went with it
    assert len(steps) == len(CRASHES) + 1, [s.fault for s in steps]
    final = steps[-1]  # the clean run on the temporary server
    assert final.code == 0, final.out[-3000:]
    assert not final.orphans, final.orphans
    ran = final.out.split("ran: ", 1)[1].splitlines()[0]
    assert ran == "evaluate-merged", final.out[-2000:]  # every other stage was done by a killed run

    # the end state is the uninterrupted run's, byte for byte
    ref = reference_run[1]
    ref_wd = Path(ref["workdir"])
    last = CheckpointManifest.model_validate(ref["checkpoints"][-1])
    assert sha256_file(wd / last.adapter.path) == last.adapter.sha256
    exported = ExportManifest.model_validate(ref["export"])
    for ref_file in exported.outputs():
        assert sha256_file(wd / ref_file.path) == ref_file.sha256, ref_file.path
    topk = next((wd / "teacher").iterdir())
    manifest = read_manifest(topk)
    assert manifest == read_manifest(ref_wd / topk.relative_to(wd))
    assert [s.shard for s in manifest.shards] == list(range(len(manifest.shards)))  # none missing, none twice
    assert all(s.complete for s in manifest.shards)
    assert sorted(p.name for p in topk.glob("topk-*.parquet")) == sorted(s.file for s in manifest.shards)
