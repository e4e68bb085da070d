"""Empty, migrated SQLite databases kept as templates, and new databases made as copies of them (MLflow's store:
tasks/mlflow_store.py; the temporary Prefect server's: flows/prefect_store.py).

Templates live in the user's cache folder ($XDG_CACHE_HOME/distillery, else ~/.cache/distillery), named by the
version of the package whose schema they hold; anything there can be deleted and is rebuilt on next use.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from collections.abc import Callable
from contextlib import closing
from pathlib import Path


def cache_folder() -> Path:
    """Where distillery keeps what it can rebuild: $XDG_CACHE_HOME/distillery, else ~/.cache/distillery."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distillery"


def beside(path: Path) -> Path:
    """A temporary name in `path`'s folder, unique to this process and call (a file made there gets the umask's
    mode)."""
    return path.parent / f".{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def copy_into_place(template: Path, target: Path, adjust: Callable[[sqlite3.Connection], None] | None = None) -> None:
    """Copy the template beside `target`, let `adjust` edit the copy (committed), then link it into place: never
    over a database another process made meanwhile (that one is used as it is)."""
    tmp = beside(target)
    try:
        shutil.copyfile(template, tmp)
        if adjust is not None:
            with closing(sqlite3.connect(tmp)) as db, db:  # closed after the edit is committed
                adjust(db)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def save_template(source: Path, template: Path) -> None:
    """Make `template` a consistent copy of the SQLite database `source` (its write-ahead log included), in rollback
    journal mode (a reader leaves no -wal or -shm file beside it), written beside and renamed into place."""
    template.parent.mkdir(parents=True, exist_ok=True)
    tmp = beside(template)
    try:
        with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as src, closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
        os.replace(tmp, template)
    finally:
        tmp.unlink(missing_ok=True)


def row_counts(path: Path) -> dict[str, int]:
    """{table: rows} of the SQLite database at `path` (read-only)."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: db.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] for name in tables}
