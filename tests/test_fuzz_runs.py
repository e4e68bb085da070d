"""Fuzz through full runs, kept by CI: cases of bench/fuzz_runs.py (random mutations of the tiny config and data,
each run by `distillery run` in-process) end in a completed run whose stages verify or in one line naming a
field or file, and a valid config then still completes on the same workdir. The long pass (thousands of cases)
is the bench; its numbers are in docs/reliability.md. Below: each defect the fuzz found, as its own case."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.fuzz_runs import Case, base_config, make_case, record_problems, run_case
from data.records import DataError, load_records
from schemas.config import ConfigError, load_config
from tasks.tracking import registered_model_name
from tests.pipeline_fixtures import _prefect_harness, tiny_inputs  # noqa: F401 (the fixture prefect_harness)

SEED = 0
CASES = range(20)


def _tree(root: Path, skip: Path) -> dict[Path, tuple[bool, int, int]]:
    """Every entry under root outside `skip`: path -> (a folder, size, mtime_ns), links not followed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            st = (here / name).lstat()
            found[here / name] = (name in dirnames, st.st_size, st.st_mtime_ns)
    return found


def _written_outside(case: Case, case_dir: Path, before: dict, after: dict) -> list[Path]:
    """What a case created or changed under the test's folder other than its inputs (config, data, links,
    folders: bench/fuzz_runs.materialize, and the recheck's valid.yaml) and its own workdir."""
    try:
        workdir: Path | None = Path(load_config(case_dir / "config.yaml", case.overrides).run.workdir).resolve()
    except Exception:  # noqa: BLE001 -- refused at load: it has no workdir, so it may write nothing
        workdir = None
    inputs = {case_dir / n for n in [*case.files, *case.dirs, *case.links, "config.yaml", "valid.yaml"]}
    inputs |= {parent for path in inputs for parent in path.parents if parent.is_relative_to(case_dir)}
    inputs |= {case_dir.parent}
    changed = [p for p in after.keys() | before.keys() if before.get(p) != after.get(p)]
    return sorted(
        p
        for p in changed
        if not (before.get(p, (0,))[0] and after.get(p, (0,))[0])  # a folder both times: its entries say
        and p not in inputs
        and not (workdir is not None and p.resolve().is_relative_to(workdir))
    )


def test_fuzz_cases_complete_or_refuse_in_one_line(prefect_harness: None, tmp_path: Path) -> None:
    """20 cases of seed 0 on one workdir, every fourth followed by a valid run there; no case writes beside its
    workdir (in its own folder or another case's)."""
    workdir = tmp_path / "run"
    outcomes, outside = [], {}
    for n in CASES:
        case_dir = tmp_path / "cases" / f"{n:05d}"
        case = make_case(SEED, n, case_dir, workdir)
        before = _tree(tmp_path, workdir)
        outcomes.append(run_case(case, case_dir, workdir, n if n % 4 == 3 else None))
        if written := _written_outside(case, case_dir, before, _tree(tmp_path, workdir)):
            outside[f"{n} {case.mutation}"] = [str(p.relative_to(tmp_path)) for p in written]
    failures = [o for o in outcomes if o.outcome == "failure"]
    assert not failures, failures
    assert {o.outcome for o in outcomes} == {"completed", "refused"}, outcomes
    assert [o.recheck for o in outcomes if o.recheck] == ["ok"] * 5
    assert record_problems(workdir) == []
    assert outside == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cases", "run"]


def _case(tmp_path: Path, edit: dict[str, dict[str, Any]], files: dict[str, bytes] | None = None) -> Case:
    cfg = base_config(tmp_path / "run")
    for section, values in edit.items():
        cfg[section].update(values)
    return Case(0, "regression", json.dumps(edit), yaml.safe_dump(cfg), [], files or {})


def test_a_lone_surrogate_in_the_data_is_one_line_naming_the_record(prefect_harness: None, tmp_path: Path) -> None:
    """Found by the fuzz: JSON's "\\ud800" in a text reached the tokenizer as a TypeError (a traceback)."""
    lines = (tiny_inputs() / "texts.jsonl").read_bytes().splitlines()
    data = b"\n".join([*lines[:3], b'{"text": "the river \\ud800"}', *lines[3:]]) + b"\n"
    case = _case(tmp_path, {"data": {"path": str(tmp_path / "case" / "data.jsonl")}}, {"data.jsonl": data})
    out = run_case(case, tmp_path / "case", tmp_path / "run")
    assert (out.outcome, out.where) == ("refused", "stage"), out
    assert f"{tmp_path / 'case' / 'data.jsonl'} line 4: field 'text' holds an unpaired surrogate \\ud800" in out.error

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a \udc80"}]}
    for name, text in (("a.jsonl", json.dumps(chat)), ("a.json", json.dumps([{"text": "\ud83d!"}]))):
        (tmp_path / name).write_text(text, encoding="ascii")  # json.dumps escapes the surrogates
        with pytest.raises(DataError, match=f"{tmp_path / name} .*unpaired surrogate"):
            load_records(tmp_path / name)


def test_an_experiment_name_mlflow_refuses_for_a_model_still_registers(prefect_harness: None, tmp_path: Path) -> None:
    """Found by the fuzz: run.experiment 'a/b' trained, evaluated and exported, then failed registering the
    adapter as the MLflow model 'a/b-adapter' ('/' and ':' are not allowed in a model name)."""
    from mlflow.utils.validation import _validate_model_name

    out = run_case(_case(tmp_path, {"run": {"experiment": "team/x:y"}}), tmp_path / "case", tmp_path / "run")
    assert out.outcome == "completed", out
    for experiment in ("team/x:y", "/abs", "..", "../x", ".", "a//b", ":", "ü ñ"):
        _validate_model_name(registered_model_name(experiment))  # raises MlflowException if refused


@pytest.mark.parametrize("override", ["train.epochs=11111111111111111111", "train.batch_size=9223372036854775808",
                                      "train.grad_accum=1000000000"])  # fmt: skip
def test_absurd_sizes_are_refused_at_load(override: str, tmp_path: Path) -> None:
    """Found by the fuzz: epochs 11111111111111111111 ran without end (a task per epoch), batch_size 2^63 ended
    in 'Maximum allowed dimension exceeded' naming nothing, grad_accum 10^9 ran a forward per micro-batch."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path / "run")))
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"{field}: Input should be less than or equal to"):
        load_config(path, [override])


def test_a_batch_beyond_memory_is_one_line_naming_the_batch_size(
    prefect_harness: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fuzz: train.batch_size 10^8 was a MemoryError traceback from the batch arrays. The allocation
    is injected here (Linux overcommit lets a size that fails elsewhere succeed lazily)."""
    import training.loop

    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise MemoryError("Unable to allocate 143. GiB for an array with shape (100000000, 24, 8)")

    monkeypatch.setattr(training.loop, "train_epoch", no_memory)
    out = run_case(_case(tmp_path, {}), tmp_path / "case", tmp_path / "run")
    assert (out.outcome, out.where) == ("refused", "stage"), out
    assert "train.batch_size: 4 sequences of data.seq_len 24 (teacher.top_k 8) do not fit in memory" in out.error


def test_a_tracking_uri_mlflow_refuses_is_one_line_naming_the_field(prefect_harness: None, tmp_path: Path) -> None:
    """Found by the fuzz: --set run.mlflow_uri=<a path> ended in MLflow's file-store MlflowException traceback."""
    case = _case(tmp_path, {"run": {"mlflow_uri": str(tmp_path / "mlruns")}})
    out = run_case(case, tmp_path / "case", tmp_path / "run")
    assert (out.outcome, out.where) == ("refused", "stage"), out
    assert f"run.mlflow_uri: '{tmp_path / 'mlruns'}': The filesystem tracking backend" in out.error
    assert "give a database (sqlite:///<file>) or a server (http://host:port)" in out.error


def test_json_nested_beyond_the_recursion_limit_is_a_data_error(tmp_path: Path) -> None:
    """Found by the fuzz: a line of 100,000 '[' was a RecursionError traceback from json.loads."""
    good = (tiny_inputs() / "texts.jsonl").read_text(encoding="utf-8")
    for name, text in (("a.jsonl", good + "[" * 100_000 + "\n"), ("a.json", "[" * 100_000)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=f"{tmp_path / name}( line 37)?: JSON nested too deeply to read"):
            load_records(tmp_path / name)
