"""A Prefect server's new SQLite database as a copy of an empty, migrated one.

Prefect migrates a new SQLite database when its server first starts on it, ~10 s of a laptop core (each workdir has
its own temporary server home, <workdir>/.prefect). Before Prefect starts, the temporary server (flows/server.py) and
infra/up.sh (`python -m flows.prefect_store HOME`) copy the template of the installed Prefect version into a new
home; where there is none yet, the home's database is migrated here and a copy kept as the template
(tasks/db_template.py: the user's cache folder). A database that exists or is not the home's default (a database
URL of the user's), an unwritable cache: Prefect migrates as before. Prefect registers its block types on every
start in a new home either way (~1 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import sys
from importlib.metadata import version
from pathlib import Path

from tasks.db_template import cache_folder, copy_into_place, row_counts, save_template

log = logging.getLogger(__name__)
DATABASE = "prefect.db"  # Prefect's default database in PREFECT_HOME
SQLITE = "sqlite+aiosqlite:///"
URL_SETTINGS = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")  # the user's own


def template_path() -> Path:
    """The empty migrated database of the installed Prefect version."""
    return cache_folder() / f"prefect-{version('prefect')}-empty.db"


def is_empty_database(path: Path) -> bool:
    """A migrated Prefect database holding nothing but its schema version."""
    counts = row_counts(path)
    return counts.pop("alembic_version", 0) == 1 and bool(counts) and not any(counts.values())


def prepare_database(home: Path) -> str:
    """Before the server starts on `home` (PREFECT_HOME=home, Prefect importable): a new default database is the
    template's copy, else migrated here and kept as the template. What happened: "seeded", "migrated" or "as is".
    An existing database or a database URL in the environment is left alone before Prefect is imported."""
    database = home / DATABASE
    if database.exists() or any(os.environ.get(name) for name in URL_SETTINGS):
        return "as is"
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    if str(PREFECT_API_DATABASE_CONNECTION_URL.value()) != f"{SQLITE}{database}":  # the URL of a profile
        return "as is"
    if seed_database(database):
        return "seeded"
    _migrate_and_keep(database)
    return "migrated"


def seed_database(database: Path) -> bool:
    """Copy the template to `database`; False when there is none yet or it fails."""
    template = template_path()
    try:
        if not (template.is_file() and is_empty_database(template)):
            return False
        copy_into_place(template, database)
    except (OSError, sqlite3.Error) as exc:
        log.debug("Prefect database %s not seeded from the template: %s", database, exc)
        return False
    return True


def _migrate_and_keep(database: Path) -> None:
    """Migrate the new `database` (the configured one) and keep a copy as the template; a failure to keep it is
    logged at debug level and ignored."""
    from prefect.server.database import provide_database_interface

    async def migrate() -> None:
        db = provide_database_interface()
        await db.create_db()
        await (await db.engine()).dispose()

    asyncio.run(migrate())
    try:
        if not is_empty_database(database):
            raise sqlite3.DatabaseError(f"{database}: Prefect's new database is not the empty one expected")
        save_template(database, template_path())
    except (OSError, sqlite3.Error) as exc:
        log.debug("Prefect database template not kept: %s", exc)


def main(argv: list[str]) -> int:
    """`python -m flows.prefect_store HOME` (infra/up.sh, before `prefect server start` with PREFECT_HOME=HOME): a new
    default database there, seeded or migrated (Prefect imported only then)."""
    if len(argv) != 1:
        print("usage: python -m flows.prefect_store PREFECT_HOME", file=sys.stderr)
        return 2
    print(f"database: {prepare_database(Path(argv[0]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
