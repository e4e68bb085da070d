"""train.workers=2 on a local 2-CPU Ray cluster and the tiny llama: the data-parallel run equals the 1-worker run
with the same global batch (NumpyEngine: bitwise, adapter and AdamW moments; GPUStudent on lavapipe: within
1e-6 of each tensor's largest value, bitwise in practice), also with grad_accum not a multiple of the workers,
when a worker is killed mid-run (replaced once from a live one, its two micro-batches of the step rerun) and when
a 1-worker run's checkpoint is resumed by 2 workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stages.student
import stages.teacher
import stages.tokenize
import training.data_parallel as data_parallel
from data.checkpoint import load_checkpoint
from schemas.config import RunConfig
from tests.pipeline_fixtures import tiny_config
from tests.ray_fixtures import _ray_cluster  # noqa: F401 (fixture)
from training.loop import StepRecord, train_epoch

pytestmark = pytest.mark.ray

STEPS = 4


@dataclass(frozen=True)
class Inputs:
    base: dict[str, Any]
    paths: dict[str, Path]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    root = tmp_path_factory.mktemp("dp") / "run"
    train = {"epochs": 1, "batch_size": 2, "grad_accum": 3, "checkpoint_every": 2, "max_steps_per_epoch": STEPS}
    base = tiny_config(root, train=train)
    cfg = RunConfig.model_validate(base)
    tokens = stages.tokenize.run(cfg)
    student = stages.student.run(cfg)
    teacher = stages.teacher.run(cfg, tokens)
    paths = {
        "student_gguf": student.path_in(root),
        "token_dir": tokens.path_in(root),
        "topk_dir": teacher.path_in(root),
    }
    return Inputs(base, paths)


def _train(inputs: Inputs, ckpt: Path, on_step: Any = None, **train: Any) -> dict[str, Any]:
    cfg = RunConfig.model_validate({**inputs.base, "train": {**inputs.base["train"], **train}})
    train_epoch(cfg, ckpt_root=ckpt, epoch=0, on_step=on_step, **inputs.paths)
    adapter, optim, state = load_checkpoint(ckpt / "epoch-000")
    flat = {f"{k}.{ab}": getattr(pair, ab) for k, pair in adapter.items() for ab in ("A", "B")}
    return {**flat, **optim, "losses": np.array(state["losses"]), "applied": state["applied_steps"]}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def one_worker(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(inputs, tmp_path_factory.mktemp("one"), backend="numpy")


def _spy_builds(monkeypatch: pytest.MonkeyPatch) -> list[data_parallel.DataParallelEngine]:
    made: list[data_parallel.DataParallelEngine] = []
    real = data_parallel.build

    def build(*args: Any, **kwargs: Any) -> data_parallel.DataParallelEngine:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(data_parallel, "build", build)
    return made


def test_two_workers_equal_one_worker_bitwise(
    inputs: Inputs, one_worker: dict[str, Any], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _spy_builds(monkeypatch)
    two = _train(inputs, tmp_path, backend="numpy", workers=2)
    assert len(made) == 1 and made[0].n == 2 and len(set(made[0].pids)) == 2  # two processes did the work
    assert one_worker["applied"] == STEPS and len(one_worker["losses"]) == STEPS
    _same(two, one_worker)


def test_a_killed_worker_is_replaced_and_the_result_is_the_same(
    inputs: Inputs, one_worker: dict[str, Any], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _spy_builds(monkeypatch)

    def kill(rec: StepRecord) -> None:
        if rec.step == 2:  # worker 0 dies between steps; step 3's micro-batches 0 and 2 find it dead
            ray_cluster.kill(made[0].workers[0], no_restart=True)

    killed = _train(inputs, tmp_path, kill, backend="numpy", workers=2)
    assert made[0].replaced == 1
    _same(killed, one_worker)


def test_two_workers_resume_a_one_worker_checkpoint(
    inputs: Inputs, one_worker: dict[str, Any], ray_cluster: Any, tmp_path: Path
) -> None:
    class Stop(Exception):
        pass

    def stop(rec: StepRecord) -> None:
        if rec.step == 3:  # after the step-2 checkpoint
            raise Stop

    with pytest.raises(Stop):
        _train(inputs, tmp_path, stop, backend="numpy")
    assert (tmp_path / "step-00000002").is_dir() and not (tmp_path / "epoch-000").exists()
    _same(_train(inputs, tmp_path, backend="numpy", workers=2), one_worker)


@pytest.mark.gpu
def test_two_gpu_workers_equal_one_worker_on_lavapipe(inputs: Inputs, ray_cluster: Any, tmp_path: Path) -> None:
    from tests.gpu_fixtures import device_or_skip

    device_or_skip()
    steps = {"backend": "gpu", "max_steps_per_epoch": 3}
    one = _train(inputs, tmp_path / "one", **steps)
    two = _train(inputs, tmp_path / "two", workers=2, **steps)
    assert one.keys() == two.keys() and one["applied"] == two["applied"] == 3
    for k in one:
        scale = max(float(np.abs(one[k]).max()), 1e-30)
        assert float(np.abs(np.asarray(one[k]) - np.asarray(two[k])).max()) <= 1e-6 * scale, k


def test_the_data_parallel_engine_satisfies_the_protocol(inputs: Inputs, ray_cluster: Any) -> None:
    """DataParallelEngine is an Engine (tests/test_engine_protocol.py holds the others): it takes a KdBatch and
    refuses a PairBatch, evaluates on a worker, and its gathered gradients, handed back by set_gradients, make the
    step its own gather would."""
    from data.topk import TopkReader
    from model.engine_spec import PairBatch
    from tests.test_engine_protocol import _check_protocol
    from training.batches import kd_batch, read_split
    from training.engine import Engine

    cfg = RunConfig.model_validate({**inputs.base, "train": {**inputs.base["train"], "backend": "numpy", "workers": 2}})
    split = read_split(inputs.paths["token_dir"], "train")
    engine = data_parallel.build(cfg, inputs.paths["student_gguf"], split.ids.shape[1])
    try:
        assert isinstance(engine, Engine)
        _check_protocol(type(engine))
        with pytest.raises(TypeError, match="takes a KdBatch"):
            engine.write_batch(PairBatch(split.ids[:2], split.mask[:2]))
        reader, k = TopkReader(inputs.paths["topk_dir"]), cfg.teacher.top_k
        batches = [kd_batch(split, np.arange(2 * m, 2 * m + 2), 2, reader, k) for m in range(cfg.train.grad_accum)]
        engine.write_batch(batches[0])
        out = engine.evaluate_batch()
        assert {"kd_loss", "ce", "top1"} <= set(out) and np.isfinite(out["kd_loss"][0])
        for micro, batch in enumerate(batches):
            engine.write_batch(batch)
            engine.accumulate(micro)
        state = engine.gradients()
        assert state["grads"].shape == (engine.layout.n_params,) and np.isfinite(state["losses"]).all()
        engine.set_gradients(state)
        stats = engine.apply(1e-3)
        assert not stats.skipped and stats.loss == pytest.approx(float(state["losses"].mean()))
        assert engine.applied_steps == 1
    finally:
        engine.close()
