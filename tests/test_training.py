"""training/ above the engine interface. Through a recording fake engine (no GPU): the loop's data order, LR per
step, micro-batches, checkpoint cadence and resume cursor, and the evaluation loop's arithmetic; both engines
against the Engine protocol; on lavapipe: evaluation against numpy, epochs that reduce KL, bitwise resume."""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from gguf import GGMLQuantizationType as Q

from cpu.objectives import NumpyKd
from data import topk as S
from data.checkpoint import load_checkpoint, save_checkpoint
from data.tokens import write_token_shards
from model import reference as R
from model.config import ModelConfig
from model.engine_spec import EngineSpec, KdBatch
from model.gguf import GGUFFile, llama_metadata, write_gguf
from model.kd import log_softmax
from model.quant import quantize
from model.teacher_cpu import reference_topk_batch
from schemas.config import RunConfig
from schemas.files import TOKEN_SHARD_SCHEMA
from schemas.manifests import TeacherManifest
from tests.gpu_fixtures import device_or_skip
from training import engines
from training import evaluation as E
from training import loop as T
from training.engine import Engine

CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=256, context_length=64)
SEQ, K, TAU = 16, 8, 1.0


def _write_model(path: Path, weights: dict, qtype: int) -> Path:
    def tensors():
        for name, w in weights.items():
            w = w.astype(np.float32)
            if w.ndim == 2 and name.startswith("blk.") and qtype != Q.F32:
                yield name, quantize(w, qtype), qtype
            else:
                yield name, w, Q.F32

    write_gguf(path, "llama", llama_metadata(CFG), tensors())
    return path


def _split(rng: np.random.Generator, n: int, first: int) -> datasets.Dataset:
    ids = rng.integers(0, CFG.vocab, (n, SEQ))
    mask = (rng.random((n, SEQ)) < 0.8).astype(np.uint8)
    mask[:, -1] = 0
    table = pa.Table.from_pydict(
        {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "doc_id": np.arange(first, first + n),
         "seq_id": np.arange(first, first + n)}, schema=TOKEN_SHARD_SCHEMA)  # fmt: skip
    return datasets.Dataset(table)


def _cfg(root: Path, student: Path, **sections: dict) -> RunConfig:
    raw = {
        "model": {"student": str(student), "teacher": str(student)}, "data": {"path": str(root), "seq_len": SEQ},
        "teacher": {"top_k": K, "temperature": TAU}, "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "warmup_steps": 1},
        "train": {"epochs": 2, "batch_size": 2, "checkpoint_every": 2, "backend": "gpu"},
    }  # fmt: skip
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return RunConfig.model_validate(raw)


@pytest.fixture(scope="module")
def problem(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A student GGUF, token shards (10 train, 3 eval sequences) and the numpy teacher's top-k shards."""
    root = tmp_path_factory.mktemp("train")
    teacher_w = R.random_weights(CFG, seed=1, dtype=np.float64)
    student_w = {n: (w + 0.05 * np.random.default_rng(2).standard_normal(w.shape)) if n.startswith("blk.") and
                 w.ndim == 2 else w for n, w in teacher_w.items()}  # fmt: skip
    student = _write_model(root / "student.gguf", student_w, Q.Q8_0)
    rng = np.random.default_rng(3)
    train, ev = _split(rng, 10, 0), _split(rng, 3, 10)
    tok = root / "tokens"
    write_token_shards(
        train, ev, tok, dataset_fingerprint="0" * 64, tokenizer_sha256="0" * 64, vocab_size=CFG.vocab, seq_len=SEQ
    )
    topk = root / "topk"
    plans = S.plan_all(train, ev, shard_positions=40)
    S.open_manifest(
        topk,
        TeacherManifest(
            teacher_sha256="a" * 64,
            k=K,
            temperature=TAU,
            vocab_size=CFG.vocab,
            token_shards_hash="b" * 64,
            shards=tuple(plans),
        ),
    )

    def fn(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        return reference_topk_batch(teacher_w, CFG, ids, K, TAU, mask=mask)

    for plan in plans:
        table = train if plan.split == "train" else ev
        S.record_shard(topk, S.write_shard(topk, plan, S.compute_shard_rows(table, plan, fn), CFG.vocab, K))
    cfg = _cfg(root, student)
    return {
        "root": root,
        "cfg": cfg,
        "student": student,
        "tok": tok,
        "topk": topk,
        "student_w": student_w,
        "ev": ev,
        "teacher_w": teacher_w,
        "train": train,
    }


@pytest.fixture
def gpu_problem(problem: dict) -> dict:
    device_or_skip()
    return problem


def _run(p: dict, ckpt: Path, fail_at: int | None = None) -> list:
    def hook(rec: T.StepRecord) -> None:
        if rec.step == fail_at:
            raise RuntimeError(f"injected failure at step {rec.step}")

    return [T.train_epoch(p["cfg"], student_gguf=p["student"], token_dir=p["tok"], topk_dir=p["topk"],
                          ckpt_root=ckpt, epoch=e, on_step=hook) for e in range(2)]  # fmt: skip


@pytest.mark.gpu
def test_baseline_evaluation_matches_numpy(gpu_problem: dict) -> None:
    problem = gpu_problem
    got = E.evaluate(problem["cfg"], student_gguf=problem["student"], token_dir=problem["tok"],
                     topk_dir=problem["topk"], checkpoint=None)  # fmt: skip
    with GGUFFile(problem["student"]) as f:
        w = {n: f.tensor_f32(n).astype(np.float64) for n in f.tensors}
    kl = ce = top1 = n = 0.0
    for ids, mask in zip(problem["ev"]["input_ids"], problem["ev"]["loss_mask"], strict=True):
        ids, m = np.asarray(ids), np.asarray(mask) != 0
        ls = log_softmax(R.forward(w, CFG, ids))
        lt = log_softmax(R.forward(problem["teacher_w"], CFG, ids) / TAU)
        tid = np.argsort(-lt, axis=-1, kind="stable")[:, :K]
        pt = np.exp(np.take_along_axis(lt, tid, -1))
        qs = np.exp(np.take_along_axis(ls, tid, -1))
        pt_tail, qs_tail = 1 - pt.sum(-1), 1 - qs.sum(-1)
        row_kl = (pt * np.log(pt / qs)).sum(-1) + pt_tail * np.log(pt_tail / qs_tail)
        kl += row_kl[m].sum()
        ce += -ls[np.arange(SEQ - 1), ids[1:]][m[:-1]].sum()
        top1 += (ls.argmax(-1) == tid[:, 0])[m].sum()
        n += m.sum()
    assert got["tokens"] == n
    assert abs(got["kl"] - kl / n) < 1e-3 * (kl / n) + 1e-4  # teacher log-probs are stored as float16
    assert abs(got["ce"] - ce / n) < 1e-4 * (ce / n)
    assert got["top1"] == top1 / n


@pytest.mark.gpu
def test_epochs_reduce_kl_and_resume_is_bitwise(gpu_problem: dict) -> None:
    problem = gpu_problem
    root = problem["root"]
    full = _run(problem, root / "ckpt-full")
    assert full[-1].epoch == 1
    adapter = (root / "ckpt-full" / "epoch-001" / "adapter.safetensors").read_bytes()
    base = E.evaluate(problem["cfg"], student_gguf=problem["student"], token_dir=problem["tok"],
                      topk_dir=problem["topk"], checkpoint=None)  # fmt: skip
    after = E.evaluate(problem["cfg"], student_gguf=problem["student"], token_dir=problem["tok"],
                       topk_dir=problem["topk"], checkpoint=root / "ckpt-full" / "epoch-001")  # fmt: skip
    assert after["kl"] < base["kl"]
    # a crash at step 3 (epoch 0 has 5 steps: checkpoint after step 2), then a rerun resumes to the same bytes
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        _run(problem, root / "ckpt-crash", fail_at=3)
    _run(problem, root / "ckpt-crash")
    assert (root / "ckpt-crash" / "epoch-001" / "adapter.safetensors").read_bytes() == adapter
    assert (root / "ckpt-crash" / "epoch-001" / "optimizer.safetensors").read_bytes() == (
        root / "ckpt-full" / "epoch-001" / "optimizer.safetensors"
    ).read_bytes()


# ---- the loop through a recording fake engine ----------------------------------------------------------------
@dataclass(frozen=True)
class _Slot:
    d_in: int
    d_out: int


@dataclass(frozen=True)
class _Layout:
    r: int
    slots: dict[tuple[int, str], _Slot]


class RecordingEngine:
    """An Engine with the protocol's members and nothing else. It records every call, and moves its adapter and
    moments by a fixed rule of (lr, batch), so a wrong resume, LR or data order changes the checkpoint bytes.
    A step that contains the row `skip_row` is reported skipped and changes nothing."""

    def __init__(self, cfg: RunConfig, seq_len: int, eval_mode: bool, skip_row: np.ndarray | None) -> None:
        self.cfg = CFG
        self.layout = _Layout(cfg.lora.r, {(layer, t): _Slot(*reversed(CFG.target_shape(t)))
                                           for layer in range(CFG.n_layers) for t in cfg.lora.targets})  # fmt: skip
        self.seq_len, self.eval_mode, self.skip_row = seq_len, eval_mode, skip_row
        self.applied_steps = self.skipped_steps = 0
        self.calls: list[tuple] = []
        self._adapter: dict | None = None
        self._m = np.zeros(8, np.float32)
        self._v = np.zeros(8, np.float32)
        self._batch: tuple | None = None
        self._step_rows: list[np.ndarray] = []

    def set_adapter(self, adapter) -> None:
        self._adapter = {
            k: R.LoraPair(np.array(p.A, np.float32), np.array(p.B, np.float32)) for k, p in adapter.items()
        }
        self.calls.append(("set_adapter", self.get_adapter()))

    def get_adapter(self) -> dict:
        return {k: R.LoraPair(p.A.copy(), p.B.copy()) for k, p in self._adapter.items()}

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {"m": self._m.copy(), "v": self._v.copy()}

    def load_optimizer_state(self, state, applied_steps: int) -> None:
        self._m, self._v = np.array(state["m"], np.float32), np.array(state["v"], np.float32)
        self.applied_steps = applied_steps
        self.calls.append(("load_optimizer_state", applied_steps))

    def gradients(self) -> dict[str, np.ndarray]:
        self.calls.append(("gradients",))
        return {"grads": np.zeros(1, np.float32), "losses": np.zeros(1, np.float32)}

    def set_gradients(self, state) -> None:
        self.calls.append(("set_gradients",))

    def write_batch(self, batch: KdBatch) -> None:
        ids, targets, mask, teacher_ids = batch.ids, batch.targets, batch.mask, batch.teacher_ids
        teacher_logprobs, teacher_tail = batch.teacher_logprobs, batch.teacher_tail
        shapes = (ids.shape, targets.shape, mask.shape, teacher_ids.shape, teacher_logprobs.shape)
        assert shapes == ((2, SEQ), (2, SEQ), (2, SEQ), (2, SEQ, K), (2, SEQ, K))
        assert teacher_tail is None or teacher_tail.shape == (2, SEQ)
        self._batch = (ids.copy(), mask.copy(), teacher_ids.copy())
        self.calls.append(("write_batch", ids.copy(), mask.copy(), teacher_tail is None))

    def accumulate(self, micro: int) -> None:
        ids, mask, _ = self._batch
        self._step_rows += [row for row, m in zip(ids, mask, strict=True) if m.any()]
        self.calls.append(("accumulate", micro))

    def apply(self, lr: float):
        rows, self._step_rows = self._step_rows, []
        loss = float(np.mean([row.mean() for row in rows])) / 100
        skipped = self.skip_row is not None and any(np.array_equal(row, self.skip_row) for row in rows)
        self.calls.append(("apply", lr, skipped))
        if skipped:
            self.skipped_steps += 1
        else:
            self.applied_steps += 1
            self._adapter = {k: R.LoraPair(p.A + np.float32(lr), p.B - np.float32(lr * loss))
                             for k, p in self._adapter.items()}  # fmt: skip
            self._m = np.float32(0.5) * self._m + np.float32(lr * self.applied_steps)
            self._v = self._v + np.float32(loss)
        return _Stats(loss, 10 * loss, skipped)

    def evaluate_batch(self) -> dict[str, np.ndarray]:
        """kd_loss 0.3; ce 2.0 on masked rows (huge elsewhere); top-1 right exactly where the input id is even."""
        ids, mask, tids = (a.reshape(2 * SEQ, -1) for a in self._batch)
        self.calls.append(("evaluate_batch",))
        top1 = np.where(ids[:, 0] % 2 == 0, tids[:, 0], (tids[:, 0] + 1) % CFG.vocab).astype(np.uint32)
        return {"kd_loss": np.array([0.3], np.float32), "ce": np.where(mask[:, 0] != 0, 2.0, 1e6), "top1": top1}


@dataclass(frozen=True)
class _Stats:
    loss: float
    grad_norm: float
    skipped: bool


class _Built(list):
    """The engines built so far, in order; setting skip_row makes the next ones skip the step with that row."""

    skip_row: np.ndarray | None = None


@pytest.fixture
def fake_engines(monkeypatch: pytest.MonkeyPatch) -> _Built:
    """Replace the engine factory of training/ with RecordingEngine; returns every engine it builds."""
    built = _Built()

    def build(
        cfg: RunConfig, student_gguf: Path, seq_len: int, eval_mode: bool = False, start_layer: int = 0
    ) -> RecordingEngine:
        built.append(RecordingEngine(cfg, seq_len, eval_mode, built.skip_row))
        return built[-1]

    monkeypatch.setattr(engines, "build_engine", build)
    return built


def _fake_run(p: dict, cfg: RunConfig, ckpt: Path, fail_at: int | None = None) -> list[T.StepRecord]:
    records: list[T.StepRecord] = []

    def hook(rec: T.StepRecord) -> None:
        records.append(rec)
        if rec.step == fail_at:
            raise RuntimeError(f"injected failure at step {rec.step}")

    for e in range(cfg.train.epochs):
        T.train_epoch(cfg, student_gguf=p["student"], token_dir=p["tok"], topk_dir=p["topk"], ckpt_root=ckpt,
                      epoch=e, on_step=hook)  # fmt: skip
    return records


def _written_rows(p: dict, engine: RecordingEngine) -> list[int]:
    """The train-split row of every non-padding sequence the engine was given, in order."""
    train_ids = np.asarray(p["train"]["input_ids"])
    rows = []
    for call in engine.calls:
        if call[0] == "write_batch":
            for ids, mask in zip(call[1], call[2], strict=True):
                if mask.any():
                    (match,) = np.nonzero((train_ids == ids).all(axis=1))[0]
                    rows.append(int(match))
                else:
                    assert not ids.any()  # the last partial batch is padded with masked-out zeros
    return rows


def _expected_lr(cfg: RunConfig, step: int, total: int) -> float:
    """Linear warmup over warmup_steps, then cosine down to min_lr_ratio * lr at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / (total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def test_engine_is_built_once_per_epoch_and_driven_through_the_protocol(problem: dict, fake_engines: _Built) -> None:
    cfg = _cfg(problem["root"], problem["student"], optim={"warmup_steps": 2, "min_lr_ratio": 0.1})
    ckpt = problem["root"] / "fake-plain"
    records = _fake_run(problem, cfg, ckpt)
    assert len(fake_engines) == 2 and all(isinstance(e, Engine) for e in fake_engines)
    assert [(e.seq_len, e.eval_mode) for e in fake_engines] == [(SEQ, False), (SEQ, False)]
    # epoch 0 starts from the seeded LoRA init; epoch 1 from epoch 0's checkpoint
    first = fake_engines[0].calls[0]
    init = R.init_lora(CFG, list(cfg.lora.targets), cfg.lora.r, cfg.train.seed)
    assert first[0] == "set_adapter" and first[1].keys() == init.keys()
    assert all(np.array_equal(first[1][k].A, init[k].A) and np.array_equal(first[1][k].B, init[k].B) for k in init)
    assert [c[0] for c in fake_engines[1].calls[:2]] == ["set_adapter", "load_optimizer_state"]
    assert fake_engines[1].calls[1][1] == 5
    # 10 sequences, batch 2, no accumulation: 5 steps per epoch, each write -> accumulate(0) -> apply(lr)
    for engine in fake_engines:
        steps = [c[0] for c in engine.calls if c[0] in ("write_batch", "accumulate", "apply")]
        assert steps == ["write_batch", "accumulate", "apply"] * 5
        assert {c[1] for c in engine.calls if c[0] == "accumulate"} == {0}
        assert all(c[3] is False for c in engine.calls if c[0] == "write_batch")  # the tail is passed
    # data order: every epoch visits each sequence once, in the permutation fixed by (seed, epoch)
    for epoch, engine in enumerate(fake_engines):
        want = np.random.default_rng([cfg.train.seed, epoch]).permutation(10).tolist()
        assert _written_rows(problem, engine) == want
    # LR per global step: warmup 2, cosine over the 10 steps of both epochs
    lrs = [c[1] for e in fake_engines for c in e.calls if c[0] == "apply"]
    assert lrs == pytest.approx([_expected_lr(cfg, g, 10) for g in range(10)], rel=1e-12)
    assert [r.step for r in records] == list(range(1, 11)) and [r.lr for r in records] == lrs
    # checkpoints every 2 steps inside an epoch, plus each epoch's end
    names = sorted(d.name for d in ckpt.iterdir())
    assert names == ["epoch-000", "epoch-001", "step-00000002", "step-00000004", "step-00000006", "step-00000008"]
    states = {name: load_checkpoint(ckpt / name)[2] for name in names}
    cursors = {name: (s["epoch"], s["cursor"], s["step"]) for name, s in states.items()}
    assert cursors == {"step-00000002": (0, 2, 2), "step-00000004": (0, 4, 4), "epoch-000": (0, 5, 5),
                       "step-00000006": (1, 1, 6), "step-00000008": (1, 3, 8), "epoch-001": (1, 5, 10)}  # fmt: skip
    adapter, optim, _ = load_checkpoint(ckpt / "epoch-001")
    final = fake_engines[1].get_adapter()
    assert all(np.array_equal(adapter[k].A, final[k].A) for k in final)
    assert np.array_equal(optim["m"], fake_engines[1].optimizer_state()["m"])


def _state(folder: Path) -> dict:
    state = load_checkpoint(folder)[2]
    state["metrics"].pop("tokens_per_s", None)  # wall-clock
    return state


def test_resume_continues_at_the_cursor_with_the_same_bytes(problem: dict, fake_engines: _Built) -> None:
    """grad_accum 2 (3 steps per epoch, the last with a padded micro-batch), no tail, one skipped step; a crash
    after step 3 resumes from step-00000002 at cursor 2 and ends on the same checkpoint bytes and state."""
    cfg = _cfg(problem["root"], problem["student"], train={"grad_accum": 2}, teacher={"tail": False})
    first_row = int(np.random.default_rng([cfg.train.seed, 0]).permutation(10)[0])
    fake_engines.skip_row = np.asarray(problem["train"]["input_ids"][first_row])
    root = problem["root"]
    _fake_run(problem, cfg, root / "fake-full")
    full_engines = list(fake_engines)
    fake_engines.clear()
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        _fake_run(problem, cfg, root / "fake-crash", fail_at=3)
    fake_engines.clear()
    _fake_run(problem, cfg, root / "fake-crash")
    # micro-batches 0, 1 per step; the tail is left out of the loss
    for engine in full_engines:
        assert [c[1] for c in engine.calls if c[0] == "accumulate"] == [0, 1] * 3
        assert all(c[3] for c in engine.calls if c[0] == "write_batch")
    assert [c[2] for c in full_engines[0].calls if c[0] == "apply"] == [True, False, False]
    # the rerun restores step-00000002 (1 applied, 1 skipped) and continues with the rows of step 3
    resumed = fake_engines[0]
    assert [c[0] for c in resumed.calls[:2]] == ["set_adapter", "load_optimizer_state"]
    assert resumed.calls[1][1] == 1
    order = np.random.default_rng([cfg.train.seed, 0]).permutation(10).tolist()
    assert _written_rows(problem, resumed) == order[8:]
    assert _state(root / "fake-crash" / "step-00000002")["skipped_steps_total"] == 1
    for name in ("epoch-000", "epoch-001"):
        for file in ("adapter.safetensors", "optimizer.safetensors"):
            assert (root / "fake-crash" / name / file).read_bytes() == (root / "fake-full" / name / file).read_bytes()
        assert _state(root / "fake-crash" / name) == _state(root / "fake-full" / name)
    assert _state(root / "fake-full" / "epoch-001")["skipped_steps_total"] == 2  # the skipped row, once per epoch


def test_evaluation_loop_through_the_engine(problem: dict, fake_engines: _Built, tmp_path: Path) -> None:
    """Baseline = all-zero adapter of the engine's layout; a checkpoint's adapter otherwise; metrics are the
    masked-position means of what evaluate_batch returned (KL divided by tau^2)."""
    cfg = _cfg(problem["root"], problem["student"], teacher={"temperature": 2.0}, loss={"temperature": 2.0})
    base = E.evaluate(cfg, student_gguf=problem["student"], token_dir=problem["tok"], topk_dir=problem["topk"],
                      checkpoint=None)  # fmt: skip
    engine = fake_engines[0]
    assert (engine.seq_len, engine.eval_mode) == (SEQ, True)
    zeros = engine.calls[0][1]
    assert engine.calls[0][0] == "set_adapter" and zeros.keys() == engine.layout.slots.keys()
    for key, s in engine.layout.slots.items():
        assert zeros[key].A.shape == (4, s.d_in) and zeros[key].B.shape == (s.d_out, 4)
        assert not zeros[key].A.any() and not zeros[key].B.any()
    assert [c[0] for c in engine.calls[1:]] == ["write_batch", "evaluate_batch"] * 2  # 3 sequences, batch 2
    ids, mask = np.asarray(problem["ev"]["input_ids"]), np.asarray(problem["ev"]["loss_mask"]) != 0
    n = int(mask.sum())
    assert base["tokens"] == n
    assert base["kl"] == pytest.approx(float(np.float32(0.3)) / 4.0, rel=1e-12)
    assert base["ce"] == 2.0 and base["ppl"] == pytest.approx(math.exp(2.0))
    assert base["top1"] == pytest.approx(float((ids[mask] % 2 == 0).sum()) / n, rel=1e-12)
    adapter = {k: R.LoraPair(np.full((4, s.d_in), 0.5, np.float32), np.full((s.d_out, 4), -1.0, np.float32))
               for k, s in engine.layout.slots.items()}  # fmt: skip
    save_checkpoint(tmp_path / "ck", adapter, {"m": np.zeros(1, np.float32)}, {"step": 1, "epoch": 0})
    E.evaluate(cfg, student_gguf=problem["student"], token_dir=problem["tok"], topk_dir=problem["topk"],
               checkpoint=tmp_path / "ck")  # fmt: skip
    loaded = fake_engines[1].calls[0][1]
    assert all(np.array_equal(loaded[k].A, adapter[k].A) and np.array_equal(loaded[k].B, adapter[k].B) for k in adapter)


# ---- both engines against the protocol ---------------------------------------------------------------------
def _protocol_methods() -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(Engine).items() if inspect.isfunction(f) and n[0] != "_"}


def _check_engine(engine: object) -> None:
    assert isinstance(engine, Engine)
    for name, want in _protocol_methods().items():
        got = inspect.signature(getattr(type(engine), name))
        assert list(got.parameters) == list(want.parameters), f"{type(engine).__name__}.{name}{got} != {want}"
    for name in ("applied_steps", "skipped_steps"):
        assert isinstance(getattr(engine, name), int)
    assert isinstance(engine.cfg, ModelConfig)
    assert engine.layout.slots and all(s.d_in > 0 and s.d_out > 0 for s in engine.layout.slots.values())


def test_the_numpy_engine_satisfies_the_protocol(problem: dict) -> None:
    from cpu import NumpyEngine
    from model.kd import LossConfig

    _check_engine(
        NumpyEngine(
            problem["student_w"],
            EngineSpec(CFG, targets=("q", "v"), r=4, alpha=8, batch=2, seq_len=SEQ),
            NumpyKd(LossConfig("forward_kl", tau=1.0, use_tail=True), K),
        )
    )


@pytest.mark.gpu
def test_the_wgpu_engine_satisfies_the_protocol(gpu_problem: dict) -> None:
    """The factory's engine for train.backend=gpu (GPUStudent), for training and for evaluation."""
    p = gpu_problem
    for eval_mode in (False, True):
        engine = engines.build_engine(p["cfg"], p["student"], SEQ, eval_mode=eval_mode)
        assert type(engine).__name__ == "GPUStudent"
        _check_engine(engine)


def test_the_factory_builds_the_numpy_engine_without_a_device(
    problem: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """train.backend=numpy builds NumpyEngine and never asks wgpu for an adapter; auto on a CPU-only adapter
    (or none) picks numpy, on a GPU picks gpu; the choice is logged with its reason."""
    import gpu.device

    def no_device(*args: object, **kwargs: object) -> None:
        raise AssertionError("a numpy run asked for a GPU device")

    monkeypatch.setattr(engines, "_DEVICES", {})
    monkeypatch.setattr(engines, "_LOGGED", set())
    monkeypatch.setattr(gpu.device, "Device", no_device)
    cfg = _cfg(problem["root"], problem["student"], train={"backend": "numpy"})
    with caplog.at_level(logging.INFO, logger="training.engines"):
        for eval_mode in (False, True):
            engine = engines.build_engine(cfg, problem["student"], SEQ, eval_mode=eval_mode)
            assert type(engine).__name__ == "NumpyEngine"
            _check_engine(engine)
    assert caplog.text.count("engine: NumpyEngine") == 1 and "train.backend=numpy" in caplog.text

    class FakeDevice:
        def __init__(self, backend: str | None, is_cpu: bool) -> None:
            self.is_cpu, self.adapter = is_cpu, type("Adapter", (), {"summary": "fake adapter"})()

    for is_cpu, want in ((True, "numpy"), (False, "gpu")):
        monkeypatch.setattr(gpu.device, "Device", lambda backend, is_cpu=is_cpu: FakeDevice(backend, is_cpu))
        monkeypatch.setattr(engines, "_DEVICES", {})
        assert engines.resolve_backend("auto")[0] == want

    def no_adapter(backend: str | None) -> None:
        raise gpu.device.DeviceError("no adapter found")

    monkeypatch.setattr(gpu.device, "Device", no_adapter)
    monkeypatch.setattr(engines, "_DEVICES", {})
    backend, why = engines.resolve_backend("auto")
    assert backend == "numpy" and "no GPU adapter" in why
    with pytest.raises(ValueError, match="tensorcore needs the GPU engine"):
        engines.build_engine(_cfg(problem["root"], problem["student"], train={"backend": "numpy",
                             "precision": "tensorcore"}), problem["student"], SEQ)  # fmt: skip
