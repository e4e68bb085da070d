"""The pipeline's stages as plain functions (no Prefect, no MLflow) on the tiny llama: tokenize -> student ->
teacher -> train -> evaluate -> export, each checked by the values it produces and the files it leaves, which
verify by sha256; a second call reuses complete teacher shards and rebuilds a corrupt one to the same bytes;
training interrupted at a step resumes to the same adapter bytes in a moved workdir; the exports load."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import stages.evaluate
import stages.export
import stages.student
import stages.teacher
import stages.tokenize
import stages.train
from data.checkpoint import load_checkpoint
from data.records import DataError
from data.tokens import read_token_split, read_tokenize_manifest
from data.topk import read_manifest, verify_shard
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import (
    CheckpointManifest,
    EvalManifest,
    ExportManifest,
    ShardRecord,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
    sha256_file,
)
from stages.inputs import InputError, check_inputs
from stages.layout import stage_dir
from tests.gpu_fixtures import device_or_skip
from tests.pipeline_fixtures import tiny_config, tiny_inputs, tokenizer_metadata
from training.teacher import Teacher

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Chain:
    """Every stage's result of one run of the tiny config, in order."""

    cfg: RunConfig
    root: Path
    tokens: TokenizeManifest
    student: StudentManifest
    teacher: TeacherManifest
    checkpoints: list[CheckpointManifest]
    baseline: EvalManifest
    evals: list[EvalManifest]
    best: int
    exported: ExportManifest
    merged: EvalManifest


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    device_or_skip()
    root = tmp_path_factory.mktemp("stages") / "run"
    cfg = RunConfig.model_validate(tiny_config(root))
    tokens = stages.tokenize.run(cfg)
    student = stages.student.run(cfg)
    teacher = stages.teacher.run(cfg, tokens)
    checkpoints = stages.train.run(cfg, student, tokens, teacher)
    baseline = stages.evaluate.run(cfg, student, tokens, teacher)
    evals = [stages.evaluate.run(cfg, student, tokens, teacher, c) for c in checkpoints]
    best = stages.evaluate.select_best(cfg, evals)
    exported = stages.export.run(cfg, student, checkpoints[best])
    assert exported.merged is not None
    merged = stages.evaluate.run_merged(cfg, exported.merged, tokens, teacher)
    return Chain(cfg, root, tokens, student, teacher, checkpoints, baseline, evals, best, exported, merged)


def _folder(c: Chain, module: object, inputs: dict) -> Path:
    """Where a stage's key says its output goes."""
    return stage_dir(c.cfg, module.FOLDER, module.KEY.key(c.cfg, inputs))  # type: ignore[attr-defined]


def test_tokenize_writes_verified_shards_where_its_key_says(chain: Chain) -> None:
    c, tok = chain, chain.tokens
    assert tok.path_in(c.root) == _folder(c, stages.tokenize, {})
    assert tok.dir == f"tokens/{tok.path_in(c.root).name}"  # stored relative to the workdir
    assert read_tokenize_manifest(tok.path_in(c.root)) == tok.model_copy(update={"dir": ""})
    for split in ("train", "eval"):
        part = getattr(tok, split)
        for ref in part.shards:
            ref.verify(c.root)
        ds = read_token_split(tok.path_in(c.root), split, tok, c.root)
        assert len(ds) == part.n_sequences > 0
        assert sum(int(np.sum(m)) for m in ds["loss_mask"]) == part.n_positions
    assert tok.train.n_documents + tok.eval.n_documents == 36  # every document of texts.jsonl, in one split
    assert tok.seq_len == 24 and tok.vocab_size == len(tokenizer_metadata()["tokenizer.ggml.tokens"])


def test_tokenize_holds_out_a_separate_source(tmp_path: Path) -> None:
    """data.eval_path: every document of data.path trains, every document of eval_path is held out (a split by
    source); the key (and folder) differ from the hash split's; no held-out text is in the train split."""
    texts = [json.loads(line)["text"] for line in (tiny_inputs() / "texts.jsonl").read_text().splitlines()]
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:30]))
    eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[30:]))
    data = {"path": str(train_file), "eval_path": str(eval_file)}
    cfg = RunConfig.model_validate(tiny_config(tmp_path / "run", data=data))
    tok = stages.tokenize.run(cfg)
    assert (tok.train.n_documents, tok.eval.n_documents) == (30, 6)
    plain = RunConfig.model_validate(tiny_config(tmp_path / "run", data={"path": str(train_file)}))
    assert stages.tokenize.KEY.key(cfg, {}) != stages.tokenize.KEY.key(plain, {})
    root = tmp_path / "run"
    train_ids = {tuple(r) for r in read_token_split(tok.path_in(root), "train")["input_ids"]}
    eval_ids = {tuple(r) for r in read_token_split(tok.path_in(root), "eval")["input_ids"]}
    assert train_ids and eval_ids and not train_ids & eval_ids
    missing = RunConfig.model_validate(tiny_config(tmp_path / "run", data={"eval_path": str(tmp_path / "no.jsonl")}))
    with pytest.raises(InputError, match="data.eval_path"):
        check_inputs(missing)


def test_tokenize_names_the_data_file_and_field(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for data, message in (({"path": str(empty)}, "empty dataset"), ({"text_field": "body"}, "no field")):
        cfg = RunConfig.model_validate(tiny_config(tmp_path / "run", data=data))
        with pytest.raises(DataError, match=message):
            stages.tokenize.run(cfg)


def test_student_is_requantized_and_verifies(chain: Chain) -> None:
    c, st = chain, chain.student
    path = st.path_in(c.root)
    assert path == _folder(c, stages.student, {}) / stages.student.STUDENT_FILE
    assert st.file.verify(c.root) == path and st.file.path == path.relative_to(c.root).as_posix()
    assert st.source_sha256 == sha256_file(c.cfg.model.student) != st.file.sha256 and st.requantized
    with GGUFFile(path) as f:
        types = {name: info.type_name for name, info in f.tensors.items()}
    assert st.tensor_types == {t: list(types.values()).count(t) for t in set(types.values())}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"


def test_teacher_shards_are_complete_and_verify(chain: Chain) -> None:
    c, t = chain, chain.teacher
    out = t.path_in(c.root)
    assert out == _folder(c, stages.teacher, stages.teacher.key_inputs(c.cfg, c.tokens))
    assert t.engine == "numpy"  # teacher.backend numpy: recorded, and folded into the plan's key
    assert t.complete and len(t.shards) >= 4 and t.k == 8 and t.vocab_size == c.tokens.vocab_size
    assert read_manifest(out) == t.model_copy(update={"dir": ""})
    for split in ("train", "eval"):
        rows = [s for s in t.shards if s.split == split]
        assert sum(s.n_positions for s in rows) == getattr(c.tokens, split).n_positions
        assert sum(s.seq_end - s.seq_start for s in rows) == getattr(c.tokens, split).n_sequences
    for s in t.shards:
        verify_shard(out / s.file, s, t.vocab_size, t.k)
        assert stages.teacher.shard_problem(c.cfg, t, s) is None


def test_teacher_second_call_reuses_complete_shards(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_teacher(cfg: RunConfig) -> None:
        raise AssertionError("a complete shard was recomputed")

    monkeypatch.setattr(stages.teacher, "teacher_fn", no_teacher)
    assert stages.teacher.run(chain.cfg, chain.tokens) == chain.teacher


def _corrupt(c: Chain, shard: ShardRecord) -> Path:
    """Flip a byte in the middle of the teacher shard's file; its path."""
    path = c.teacher.path_in(c.root) / shard.file
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    return path


def test_teacher_rebuilds_a_corrupt_shard_to_the_same_bytes(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    c, t = chain, chain.teacher
    victim = t.shards[2]
    path = _corrupt(c, victim)
    assert "corrupt shard" in (stages.teacher.shard_problem(c.cfg, t, victim) or "")
    real, calls = stages.teacher.teacher_fn, []

    def counting(cfg: RunConfig, store: str | None = None) -> Teacher:
        teacher = real(cfg, store)
        return dataclasses.replace(teacher, fn=lambda ids, mask: calls.append(len(ids)) or teacher(ids, mask))

    monkeypatch.setattr(stages.teacher, "teacher_fn", counting)
    assert stages.teacher.run(c.cfg, c.tokens) == t
    assert sum(calls) == victim.seq_end - victim.seq_start  # only the corrupt shard's sequences, batched
    assert len(calls) < sum(calls)
    assert sha256_file(path) == victim.sha256


def test_teacher_refuses_rows_of_another_engine(chain: Chain, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard recomputed by a teacher that resolves to another engine than the plan's (another machine's auto, a
    Ray worker with a GPU) is refused, naming both; the plan's own engine then rebuilds it to the same bytes."""
    c, t = chain, chain.teacher
    victim = t.shards[1]
    path = _corrupt(c, victim)
    real = stages.teacher.teacher_fn

    def elsewhere(cfg: RunConfig, store: str | None = None) -> Teacher:
        return dataclasses.replace(real(cfg, store), engine="gpu/dawn/int8")

    monkeypatch.setattr(stages.teacher, "teacher_fn", elsewhere)
    with pytest.raises(ValueError, match=r"teacher.backend: .* on gpu/dawn/int8, the plan's shards on numpy"):
        stages.teacher.run(c.cfg, c.tokens)
    monkeypatch.undo()
    assert stages.teacher.run(c.cfg, c.tokens) == t
    assert sha256_file(path) == victim.sha256


def test_train_checkpoints_every_epoch_with_a_step_log(chain: Chain) -> None:
    c = chain
    steps = stages.train.steps_per_epoch(c.cfg, c.tokens)
    assert steps == -(-c.tokens.train.n_sequences // c.cfg.train.batch_size)
    root = stages.train.checkpoint_root(c.cfg, c.student, c.tokens, c.teacher)
    assert [ck.epoch for ck in c.checkpoints] == list(range(c.cfg.train.epochs))
    for ck in c.checkpoints:
        assert ck.path_in(c.root) == root / f"epoch-{ck.epoch:03d}"
        assert ck.step == (ck.epoch + 1) * steps
        for ref in (ck.adapter, ck.optimizer, ck.state):
            assert ref.verify(c.root).parent == ck.path_in(c.root)
        assert np.isfinite(ck.metrics["train_loss"]) and ck.metrics["skipped_steps"] == 0
    rows = stages.train.read_steps(c.cfg, c.checkpoints[-1])
    assert [r["step"] for r in rows] == list(range(1, c.checkpoints[-1].step + 1))
    first_epoch = [r["loss"] for r in rows[:steps]]
    assert np.mean(first_epoch) == pytest.approx(c.checkpoints[0].metrics["train_loss"], rel=1e-6)
    adapter, _, state = load_checkpoint(c.checkpoints[-1].path_in(c.root))
    assert state["step"] == c.checkpoints[-1].step
    assert any(np.any(pair.B != 0) for pair in adapter.values())  # B starts at zero: training moved it


def test_train_resumes_bitwise_in_a_moved_workdir(chain: Chain, tmp_path: Path) -> None:
    """Interrupted at a step of epoch 1, resumed from its checkpoint: the same adapter bytes. The upstream
    folders are copied to another workdir; the same manifests (paths relative to it) address them there."""
    c = chain
    moved = tmp_path / "moved"
    for m in (c.tokens, c.teacher):
        shutil.copytree(m.path_in(c.root), moved / m.dir)
    shutil.copytree(c.student.path_in(c.root).parent, moved / Path(c.student.file.path).parent)
    cfg = RunConfig.model_validate(tiny_config(moved))
    steps = stages.train.steps_per_epoch(cfg, c.tokens)
    crash_at = steps + 3  # in epoch 1, one step after its checkpoint at steps + 2 (checkpoint_every = 2)

    class Crash(RuntimeError):
        pass

    def crash(rec: object) -> None:
        if rec.step == crash_at:  # type: ignore[attr-defined]
            raise Crash

    with pytest.raises(Crash):
        stages.train.run(cfg, c.student, c.tokens, c.teacher, on_step=crash)
    root = stages.train.checkpoint_root(cfg, c.student, c.tokens, c.teacher)
    assert root.relative_to(moved) == stages.train.checkpoint_root(c.cfg, c.student, c.tokens, c.teacher).relative_to(
        c.root
    )  # the same key: content, not locations
    assert not (root / "epoch-001").exists() and (root / f"step-{crash_at - 1:08d}").is_dir()
    resumed = stages.train.run(cfg, c.student, c.tokens, c.teacher)
    timings = {"metrics", "state"}  # tokens/s differ between runs; the adapter and optimizer may not
    assert [ck.model_dump(exclude=timings) for ck in resumed] == [
        ck.model_dump(exclude=timings) for ck in c.checkpoints
    ]
    assert resumed[-1].adapter.verify(moved).read_bytes() == c.checkpoints[-1].adapter.verify(c.root).read_bytes()
    logged = [json.loads(line)["step"] for line in (root / stages.train.STEPS_FILE).read_text().splitlines()]
    assert logged.count(crash_at) == 2 and logged.count(crash_at - 1) == 1  # resumed after step crash_at - 1


def test_evaluation_shows_distillation_helped(chain: Chain) -> None:
    c = chain
    assert c.baseline.epoch is None and [e.epoch for e in c.evals] == [ck.epoch for ck in c.checkpoints]
    assert [e.step for e in c.evals] == [ck.step for ck in c.checkpoints]
    for e in (c.baseline, *c.evals, c.merged):
        assert e.n_positions == c.tokens.eval.n_positions and e.kl >= 0 and e.ppl == pytest.approx(np.exp(e.ce))
    assert c.best == int(np.argmin([e.kl for e in c.evals]))
    assert c.evals[c.best].kl < c.baseline.kl  # distillation helped on held-out data
    assert abs(c.merged.kl - c.evals[c.best].kl) < c.baseline.kl  # the merge keeps most of the gain


def test_select_best_follows_the_metric_and_skips_diverged(chain: Chain) -> None:
    def ev(epoch: int, kl: float, top1: float) -> EvalManifest:
        return EvalManifest(epoch=epoch, step=epoch, kl=kl, top1=top1, ce=1.0, ppl=float(np.e), n_positions=1)

    evals = [ev(0, 0.5, 0.6), ev(1, float("nan"), 0.9), ev(2, 0.4, 0.5), ev(3, 0.4, 0.7)]
    assert stages.evaluate.select_best(chain.cfg, evals) == 2  # lowest KL; the tie goes to the earlier epoch
    by_top1 = chain.cfg.model_copy(update={"eval": chain.cfg.eval.model_copy(update={"best_metric": "top1"})})
    assert stages.evaluate.select_best(by_top1, evals) == 1
    with pytest.raises(ValueError, match="no evaluated checkpoints"):
        stages.evaluate.select_best(chain.cfg, [])


def test_export_files_verify_and_load(chain: Chain) -> None:
    c, ex = chain, chain.exported
    out = ex.path_in(c.root)
    assert out == _folder(c, stages.export, {"student": c.student, "checkpoint": c.checkpoints[c.best]})
    assert (ex.epoch, ex.step) == (c.checkpoints[c.best].epoch, c.checkpoints[c.best].step)
    assert ex.files() == {
        "peft_dir": f"{ex.dir}/peft",
        "gguf_lora": f"{ex.dir}/adapter-lora.gguf",
        "merged": f"{ex.dir}/merged.gguf",
    }
    assert ex.peft is not None and ex.gguf_lora is not None and ex.merged is not None
    for ref in (*ex.peft, ex.gguf_lora, ex.merged):
        ref.verify(c.root)
    adapter, _, _ = load_checkpoint(c.checkpoints[c.best].path_in(c.root))
    peft = load_file(out / "peft" / "adapter_model.safetensors")
    assert len(peft) == 2 * 2 * 3  # 2 blocks x (q, v, down) x (A, B)
    down = peft["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"]
    assert down.shape == (4, 64) and np.array_equal(down, adapter[(0, "down")].A)
    assert json.loads((out / "peft" / "adapter_config.json").read_text())["r"] == 4
    with GGUFFile(out / "adapter-lora.gguf") as f:
        assert f.metadata["general.type"] == "adapter" and f.metadata["adapter.type"] == "lora"
        assert f.tensors["blk.1.attn_v.weight.lora_b"].shape == (16, 4)  # [out = kv dim, r]
    with GGUFFile(out / "merged.gguf") as f:
        assert f.config().n_layers == 2
    assert ex.merge_report is not None and ex.merge_report["merged"] == 2 * 3
    assert 0 < ex.merge_report["error_rms"] <= ex.merge_report["error_max"]


def test_export_rebuilds_deleted_files_to_the_same_bytes(chain: Chain) -> None:
    c = chain
    shutil.rmtree(c.exported.path_in(c.root))
    assert stages.export.run(c.cfg, c.student, c.checkpoints[c.best]) == c.exported
