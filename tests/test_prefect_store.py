"""A new temporary Prefect server home's database (flows/prefect_store.py): migrated once and kept as the template,
then copied; the copy is the database Prefect made, and nothing else is touched."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flows.prefect_store import DATABASE, is_empty_database, prepare_database, seed_database, template_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _schema(path: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT name, sql FROM sqlite_master").fetchall()
        rows.append(("alembic_version", str(db.execute("SELECT * FROM alembic_version").fetchall())))
    return dict(rows)


def _prepare(home: Path, url: str | None = None) -> str:
    """prepare_database(home) under PREFECT_HOME=home and the given database URL, else the default one (the session's
    Prefect test server sets its own)."""
    import prefect.settings as ps

    database_url = ps.PREFECT_API_DATABASE_CONNECTION_URL
    if url is None:
        settings = ps.temporary_settings(updates={ps.PREFECT_HOME: str(home)}, restore_defaults={database_url})
    else:
        settings = ps.temporary_settings(updates={ps.PREFECT_HOME: str(home), database_url: url})
    with settings:
        return prepare_database(home)


def test_the_first_home_is_migrated_and_kept_the_next_is_its_copy(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    code = "import sys, pathlib, flows.prefect_store as s; print(s.prepare_database(pathlib.Path(sys.argv[1])))"
    migrated = subprocess.run(
        [sys.executable, "-c", code, str(first)],
        env={**env, "PREFECT_HOME": str(first)}, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert migrated.returncode == 0 and migrated.stdout.split()[-1] == "migrated", migrated.stdout + migrated.stderr
    assert is_empty_database(template_path()) and _schema(template_path()) == _schema(first / DATABASE)
    assert _prepare(second) == "seeded"
    assert _schema(second / DATABASE) == _schema(first / DATABASE)
    assert not list(second.glob(".*.tmp"))
    assert [p.name for p in template_path().parent.iterdir()] == [template_path().name]  # no -wal, -shm, .tmp
    assert _prepare(second) == "as is"


def test_a_template_that_gained_rows_is_not_copied(tmp_path: Path) -> None:
    template = template_path()
    template.parent.mkdir(parents=True)
    with sqlite3.connect(template) as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("CREATE TABLE flow (id CHAR(36), name VARCHAR)")
        db.execute("INSERT INTO alembic_version VALUES ('abc')")
        db.execute("INSERT INTO flow VALUES ('1', 'leaked')")
    target = tmp_path / DATABASE
    assert not is_empty_database(template) and not seed_database(target) and not target.exists()
    with sqlite3.connect(template) as db:
        db.execute("DELETE FROM flow")
    assert is_empty_database(template) and seed_database(target)  # the same file, emptied: copied
    assert _schema(target) == _schema(template)


def test_an_existing_database_or_a_url_of_the_users_is_left_as_it_is(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / DATABASE).write_bytes(b"a database already")
    assert _prepare(home) == "as is" and (home / DATABASE).read_bytes() == b"a database already"
    other = tmp_path / "other"
    other.mkdir()
    assert _prepare(other, url=f"sqlite+aiosqlite:///{tmp_path / 'elsewhere.db'}") == "as is"
    assert not list(other.iterdir()) and not (tmp_path / "elsewhere.db").exists()
    assert not template_path().exists()  # nothing made for them
