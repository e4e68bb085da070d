"""Order of the test modules on several pytest workers (`make test` runs two; pytest-xdist, `--dist loadfile`).

Each module runs whole on one worker (its module fixtures made once), and the workers take modules heaviest first,
so that the last module to start is a short one and the two workers finish together (longest-processing-time
first). xdist's own order is by number of tests, which put the five-test team module, one of the longest, last.
Modules that share one costly session fixture run on the same worker, so the fixture is made once. A serial run
keeps pytest's order.
"""

from __future__ import annotations

from typing import Any

import pytest

# Seconds per module, a serial `make test` on a 2-core box (the rest: under 3 s each). Only the order matters, so
# the figures need refreshing only when a module's weight changes a lot.
MODULE_SECONDS = {
    "test_gpu_tensorcore": 148,
    "test_team": 120,
    "test_bad_inputs": 49,
    "test_faults": 49,
    "test_gpu_int8": 47,
    "test_gpu_matmul": 27,
    "test_deploy": 26,
    "test_ui": 25,
    "test_family_flow": 17,
    "test_fuzz_runs": 16,
    "test_gpu_student": 15,
    "test_infra": 13,
    "test_cli": 13,
    "test_bench_train_step": 13,
    "test_peft_interop": 11,
    "test_tokenizer": 11,
    "test_gpu_gemma3": 10,
    "test_kernel_registry": 10,
    "test_gpu_lora_fused": 10,
    "test_ray_teacher": 9,
    "test_pipeline": 9,
    "test_prefect_store": 9,
    "test_gpu_kd": 8,
    "test_gguf_hostile": 8,
    "test_ray_train": 7,
    "test_quant": 6,
    "test_preference": 5,
}

# Modules run together on one worker, by the session fixture they share: the operations tests' servers
# (tests/server_fixtures.py), the reference flow run (tests/pipeline_fixtures.py), the local Ray cluster.
MODULE_GROUPS = {
    **dict.fromkeys(("test_deploy", "test_ui"), "servers"),
    **dict.fromkeys(("test_bad_inputs", "test_cli", "test_compare", "test_faults", "test_pipeline"), "reference_run"),
    **dict.fromkeys(("test_ray_teacher", "test_ray_train"), "ray_cluster"),
}


def module_name(nodeid: str) -> str:
    """test_x for tests/test_x.py::test_y[...]."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def scope_of(nodeid: str) -> str:
    """The unit one worker runs whole: the module's group, or the module file."""
    group = MODULE_GROUPS.get(module_name(nodeid))
    return f"group:{group}" if group else nodeid.split("::", 1)[0]


def unit_seconds(nodeids: list[str]) -> float:
    """The measured cost of a unit (a group: its modules'), a tenth of a second a test where unmeasured."""
    modules = {module_name(nodeid) for nodeid in nodeids}
    measured = sum(MODULE_SECONDS.get(module, 0.0) for module in modules)
    return measured or 0.1 * len(nodeids)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: the collection by units, heaviest first (the controller schedules in this order)."""
    if not _is_worker(config):
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(scope_of(item.nodeid), []).append(item)
    order = sorted(units, key=lambda scope: -unit_seconds([item.nodeid for item in units[scope]]))
    items[:] = [item for scope in order for item in units[scope]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`: units as `scope_of` says, in the workers' collection order (see above)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CostOrderedScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return CostOrderedScheduling(config, log)
