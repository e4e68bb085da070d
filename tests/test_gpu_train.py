"""training/ on lavapipe: epochs over real token + top-k shards, evaluation against numpy, bitwise resume."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from gguf import GGMLQuantizationType as Q

from data import topk as S
from data.tokens import write_token_shards
from model import reference as R
from model.config import ModelConfig
from model.gguf import GGUFFile, llama_metadata, write_gguf
from model.kd import log_softmax
from model.quant import quantize
from model.teacher_cpu import reference_topk
from schemas.config import RunConfig
from schemas.files import TOKEN_SHARD_SCHEMA
from schemas.manifests import TeacherManifest
from tests.gpu_fixtures import device_or_skip
from training import evaluation as E
from training import loop as T

pytestmark = pytest.mark.gpu

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


@pytest.fixture(scope="module")
def problem(tmp_path_factory: pytest.TempPathFactory) -> dict:
    device_or_skip()
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
    fn = partial(reference_topk, teacher_w, CFG, k=K, temperature=TAU)
    for plan in plans:
        table = train if plan.split == "train" else ev
        S.record_shard(topk, S.write_shard(topk, plan, S.compute_shard_rows(table, plan, fn), CFG.vocab, K))
    cfg = RunConfig.model_validate({
        "model": {"student": str(student), "teacher": str(student)}, "data": {"path": str(root), "seq_len": SEQ},
        "teacher": {"top_k": K, "temperature": TAU}, "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "warmup_steps": 1}, "train": {"epochs": 2, "batch_size": 2, "checkpoint_every": 2},
    })  # fmt: skip
    return {
        "root": root,
        "cfg": cfg,
        "student": student,
        "tok": tok,
        "topk": topk,
        "student_w": student_w,
        "ev": ev,
        "teacher_w": teacher_w,
    }


def _run(p: dict, ckpt: Path, fail_at: int | None = None) -> list:
    def hook(rec: T.StepRecord) -> None:
        if rec.step == fail_at:
            raise RuntimeError(f"injected failure at step {rec.step}")

    return [T.train_epoch(p["cfg"], student_gguf=p["student"], token_dir=p["tok"], topk_dir=p["topk"],
                          ckpt_root=ckpt, epoch=e, on_step=hook) for e in range(2)]  # fmt: skip


def test_baseline_evaluation_matches_numpy(problem: dict) -> None:
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


def test_epochs_reduce_kl_and_resume_is_bitwise(problem: dict) -> None:
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
