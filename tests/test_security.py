"""Security of a run's files: a name from a config or a deployment's form never places a file outside the
workdir; the stage cache never deserializes code (a result record naming pickle, or holding another object,
is a cache miss with one warning line, never a hit and never executed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import ConfigError, load_config
from stages.layout import OutsideWorkdir, file_name, inside
from tasks.tracking import report_paths

BASE = ["model.student=s.gguf", "model.teacher=t.gguf", "data.path=d.jsonl"]


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", "a\\b", "tab\there", ""])
def test_run_name_that_is_a_path_is_refused_at_load(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, f"run.run_name={name!r}" if name else "run.run_name=''"])
    message = str(err.value)
    assert "run.run_name" in message and "not a path" in message, message


def test_plain_run_names_are_accepted() -> None:
    for name in ("nightly", "lr-2e-4 r16", "v1.2", "...x"):
        assert load_config(None, [*BASE, f"run.run_name={name}"]).run.run_name == name


def test_inside_refuses_every_escape(tmp_path: Path) -> None:
    assert inside(tmp_path, "reports", "a.md") == tmp_path.resolve() / "reports" / "a.md"
    for parts in (("reports", "../../x.md"), ("/etc/passwd",), ("..",), ("reports", "..", "..")):
        with pytest.raises(OutsideWorkdir):
            inside(tmp_path, *parts)
    (tmp_path / "link").symlink_to(tmp_path.parent)  # a symlink out of the workdir is outside too
    with pytest.raises(OutsideWorkdir):
        inside(tmp_path, "link", "x.md")


@pytest.mark.parametrize("flow_run_name", ["../../x", "/abs/x", "..", "a\x00b", "nightly"])
def test_report_paths_stay_in_the_workdir(tmp_path: Path, flow_run_name: str) -> None:
    root = tmp_path / "work"
    report, plots = report_paths(root, flow_run_name)
    for path in (report, plots):
        assert path.parent == root.resolve() / "reports", path
    assert report.name == f"{file_name(flow_run_name)}.md" and "/" not in file_name(flow_run_name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing created beside the workdir
