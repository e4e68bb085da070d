"""A new SQLite MLflow store as a copy of an empty, migrated one.

MLflow builds a new SQLite store by running its schema migrations, ~3 s on a laptop core before a run logs
anything (and each new workdir has its own store). The migrated empty store is made once per MLflow version under
the user's cache folder (tasks/db_template.py) and copied (0.1 s); the copy's Default experiment is given this
store's own artifact folder and creation time. Anything that stops the copy (an unwritable cache, a store that
exists) leaves MLflow to build the store itself, as before.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from tasks.db_template import beside, cache_folder, copy_into_place

log = logging.getLogger(__name__)
_SQLITE = "sqlite:///"


def template_path() -> Path:
    """The empty migrated store of the installed MLflow version."""
    from mlflow.version import VERSION

    return cache_folder() / f"mlflow-{VERSION}-empty.db"


def seed_store(uri: str) -> bool:
    """Make the store of `uri` (sqlite:///<file>) a copy of the empty migrated template when the file does not
    exist yet; True when it did. Any other URI, an existing file, or a failure: False, MLflow builds it."""
    if not uri.startswith(_SQLITE):
        return False
    target = Path(uri[len(_SQLITE) :])
    if target.exists() or not target.parent.is_dir():
        return False
    try:
        template = _template()
        _copy_as_new(template, target)
    except (OSError, sqlite3.Error) as exc:
        log.debug("MLflow store %s not seeded from the template: %s", target, exc)
        return False
    return True


def _template() -> Path:
    """The template, made on first use: MLflow migrates a store in a temporary file, renamed into place."""
    path = template_path()
    if path.is_file() and _is_empty_store(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = beside(path)
    try:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=f"{_SQLITE}{tmp}").search_experiments()  # committed: the file is complete
        if not _is_empty_store(tmp):
            raise sqlite3.DatabaseError(f"{tmp}: MLflow's new store is not the empty store expected")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _is_empty_store(path: Path) -> bool:
    """A migrated MLflow store with no experiment but Default and no run."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        versions = db.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
        experiments = db.execute("SELECT experiment_id FROM experiments").fetchall()
        runs = db.execute("SELECT count(*) FROM runs").fetchone()[0]
    return versions == 1 and experiments == [(0,)] and runs == 0


def _copy_as_new(template: Path, target: Path) -> None:
    """A copy of the template at `target`, its Default experiment given this store's artifact folder and the time
    now."""
    now = int(time.time() * 1000)
    artifacts = (target.parent / "mlartifacts" / "0").as_uri()
    copy_into_place(
        template,
        target,
        lambda db: db.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
            "WHERE experiment_id = 0",
            (artifacts, now, now),
        ),
    )
