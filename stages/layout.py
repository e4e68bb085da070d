"""Where a run's files live: the workdir, and one folder per stage output addressed by its content key.

<workdir>/<folder>/<first 16 hex digits of the key>: a config that differs never overwrites the files another
config's result names, and the same inputs always land in the same folder (which is what makes a rerun resume).
"""

from __future__ import annotations

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
