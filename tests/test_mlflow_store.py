"""A new SQLite MLflow store seeded from the empty migrated template (tasks/mlflow_store.py): the same store MLflow
builds, its Default experiment's artifacts beside it, nothing else touched."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tasks.mlflow_store import seed_store, template_path


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tables(path: Path) -> dict[str, list[str]]:
    """Each table's and index's definition as its sorted lines: MLflow's migrations order a table's constraints
    differently from one build to the next (they run in set order), so two stores MLflow built differ in order."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table', 'index')").fetchall()
    return {name: sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()) for name, sql in rows}


def test_a_seeded_store_is_the_store_mlflow_builds(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    built, seeded = tmp_path / "built.db", tmp_path / "run" / "mlflow.db"
    seeded.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{built}").search_experiments()
    assert seed_store(f"sqlite:///{seeded}") and template_path().is_file()
    assert _tables(seeded) == _tables(built)
    client = MlflowClient(tracking_uri=f"sqlite:///{seeded}")
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == (seeded.parent / "mlartifacts" / "0").as_uri()
    run = client.create_run(client.create_experiment("kd", (tmp_path / "art").as_uri()))
    client.log_metric(run.info.run_id, "kl", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"kl": 0.5}
    assert not list(seeded.parent.glob(".*.tmp"))


def test_an_existing_store_and_other_uris_are_left_to_mlflow(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"a store already")
    assert not seed_store(f"sqlite:///{store}") and store.read_bytes() == b"a store already"
    assert not seed_store(f"sqlite:///{tmp_path / 'no-such-folder' / 'mlflow.db'}")
    assert not seed_store("http://127.0.0.1:5000") and not seed_store("postgresql://u@h/db")
    assert not template_path().exists()  # nothing made for them


def test_a_template_with_runs_is_rebuilt_not_copied(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    assert seed_store(f"sqlite:///{tmp_path / 'a.db'}")
    client = MlflowClient(tracking_uri=f"sqlite:///{template_path()}")
    client.create_run(client.create_experiment("leaked"))
    assert seed_store(f"sqlite:///{tmp_path / 'b.db'}")
    assert [e.name for e in MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b.db'}").search_experiments()] == [
        "Default"
    ]


def test_an_unwritable_cache_leaves_the_store_to_mlflow(tmp_path: Path, own_cache: Path) -> None:
    own_cache.write_text("a file where the cache folder goes")
    assert not seed_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists()
