"""Where a run's files live: the workdir, and one folder per stage output addressed by its content key.

<workdir>/<folder>/<first 16 hex digits of the key>: a config that differs never overwrites the files another
config's result names, and the same inputs always land in the same folder (which is what makes a rerun resume).
"""

from __future__ import annotations

import re
from pathlib import Path

from schemas.config import RunConfig


def workdir(cfg: RunConfig) -> Path:
    """The run's workdir as an absolute path (created)."""
    path = Path(cfg.run.workdir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def stage_dir(cfg: RunConfig, folder: str, key: str) -> Path:
    """<workdir>/<folder>/<first 16 hex digits of the key '<stage>-<sha256>'>."""
    return workdir(cfg) / folder / key.rsplit("-", 1)[-1][:16]


class OutsideWorkdir(ValueError):
    """A name would place a file outside the run's workdir."""


def inside(root: Path, *parts: str) -> Path:
    """root/parts, refused (OutsideWorkdir) unless it resolves inside root: the one guard of every report, plot
    and artifact path built from a name (a run name, a flow run name from a deployment's form)."""
    base = Path(root).resolve()
    path = base.joinpath(*parts).resolve()
    if not path.is_relative_to(base) or path == base:
        raise OutsideWorkdir(f"{'/'.join(parts)!r}: resolves to {path}, outside the workdir {base}")
    return path


def file_name(name: str) -> str:
    """`name` as one path component: separators and control characters become '_' (a Prefect flow run name
    may be anything a deployment's form was given)."""
    return re.sub(r"[/\\\x00-\x1f\x7f]", "_", name)[:200] or "_"
