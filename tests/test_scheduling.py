"""tests/scheduling.py: the modules that share a costly session fixture are one unit of work, the units go
heaviest first, and the table names only modules that exist."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.scheduling import MODULE_GROUPS, MODULE_SECONDS, scope_of, unit_seconds

TESTS = Path(__file__).resolve().parent
# session fixture -> the group of the modules that ask for it (directly or through a fixture of their own)
SHARED = {"servers": "servers", "served": "servers", "default_run": "servers"}
SHARED |= {"reference_run": "reference_run", "ray_cluster": "ray_cluster"}


def _parameters(path: Path) -> set[str]:
    """The parameter names of every function in a test module (tests and fixtures ask for fixtures by name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    return {arg.arg for node in nodes for arg in node.args.args + node.args.kwonlyargs}


def test_modules_sharing_a_costly_session_fixture_are_one_unit() -> None:
    users: dict[str, set[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for fixture in _parameters(path) & SHARED.keys():
            users.setdefault(SHARED[fixture], set()).add(path.stem)
    assert users.keys() == set(SHARED.values()), users
    for group, modules in users.items():
        assert {MODULE_GROUPS.get(module) for module in modules} == {group}, (group, modules)
        assert len({scope_of(f"tests/{module}.py::test_x") for module in modules}) == 1


def test_the_table_names_existing_modules_and_other_modules_are_their_own_unit() -> None:
    for module in MODULE_SECONDS.keys() | MODULE_GROUPS.keys():
        assert (TESTS / f"{module}.py").is_file(), module
    assert scope_of("tests/test_quant.py::test_a[x-1]") == "tests/test_quant.py"
    assert scope_of("tests/test_ui.py::test_b") == scope_of("tests/test_deploy.py::test_c") == "group:servers"


def test_a_unit_costs_what_its_modules_were_measured_at() -> None:
    group = ["tests/test_deploy.py::a", "tests/test_ui.py::b", "tests/test_ui.py::c"]
    assert unit_seconds(group) == MODULE_SECONDS["test_deploy"] + MODULE_SECONDS["test_ui"]
    assert unit_seconds(["tests/test_new.py::a", "tests/test_new.py::b"]) == 0.2
    assert unit_seconds(["tests/test_team.py::a"]) > unit_seconds(["tests/test_quant.py::a"])
