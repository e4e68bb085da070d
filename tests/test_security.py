"""Security of a run's files: a name from a config or a deployment's form never places a file outside the
workdir; the stage cache never deserializes code (a result record naming pickle, or holding another object,
is a cache miss with one warning line, never a hit and never executed).
"""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.filesystems import LocalFileSystem
from prefect.serializers import JSONSerializer

from schemas.config import ConfigError, load_config
from schemas.manifests import EvalManifest
from stages.layout import OutsideWorkdir, file_name, inside
from tasks.caching import ManifestStore
from tasks.records import MAX_RECORD_BYTES, BadRecord, manifest_record
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


# ---------------------------------------------------------------------------------------------- the stage cache


def json_record(result: str, serializer: dict | None = None) -> bytes:
    """A Prefect result record's bytes, as ResultRecord.serialize writes them."""
    metadata = {"storage_key": "k", "expiration": None, "serializer": serializer or {"type": "json"}}
    return json.dumps({"metadata": {**metadata, "prefect_version": "3.9.1"}, "result": result}).encode()


class _Touch:
    """A pickle payload that creates a file when loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def pickle_record(target: Path) -> bytes:
    """A record naming Prefect's pickle serializer whose payload creates `target` when deserialized."""
    payload = base64.b64encode(pickle.dumps(_Touch(target))).decode()
    return json_record(payload, {"type": "pickle", "picklelib": "pickle"})


EVAL = EvalManifest(epoch=0, step=2, kl=0.5, top1=0.5, ce=1.0, ppl=2.718, n_positions=10)


def test_a_manifest_record_round_trips_through_prefects_own_writer() -> None:
    record = ResultRecord(metadata=ResultRecordMetadata(serializer=JSONSerializer()), result=EVAL)
    assert manifest_record(record.serialize()) == EVAL


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x80garbage", "not a valid manifest record"),
        (b"[1, 2]", "not a JSON object"),
        (json_record(json.dumps({"path_in": 1})), "a plain object"),
        (json_record(json.dumps({"__class__": "os.system", "data": "touch x"})), "os.system"),
        (json_record(json.dumps({"__class__": "schemas.manifests.EvalManifest", "data": {"kl": 1}})), "not a valid"),
        (json_record("{}", {"type": "json", "object_decoder": "os.system"}), "a plain object"),
        (json_record("x", {"type": "pickle"}), "'pickle' serializer"),
        (b" " * (MAX_RECORD_BYTES + 1), "larger than any manifest record"),
    ],
    ids=["garbage", "a list", "a plain dict", "a foreign class", "an invalid manifest", "a decoder named",
         "pickle", "huge"],
)  # fmt: skip
def test_records_that_are_not_manifests_are_refused(content: bytes, says: str) -> None:
    with pytest.raises(BadRecord) as err:
        manifest_record(content)
    assert says in str(err.value), str(err.value)


def test_the_store_never_runs_a_pickle_record(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "export-typed-0").write_bytes(pickle_record(target))
    store = ManifestStore(result_storage=LocalFileSystem(basepath=str(tmp_path / "results")))
    assert not store.exists("export-typed-0") and not store._exists("missing")
    with pytest.raises(BadRecord):
        store.read("export-typed-0")
    assert not target.exists()
    (tmp_path / "results" / "ok").write_bytes(ResultRecord(metadata=ResultRecordMetadata(), result=EVAL).serialize())
    assert not store.exists("ok")  # Prefect's default serializer is pickle: not ours to read either
    record = ResultRecord(metadata=ResultRecordMetadata(serializer=JSONSerializer()), result=EVAL)
    (tmp_path / "results" / "ok").write_bytes(record.serialize())
    assert store.exists("ok") and store.read("ok").result == EVAL
