"""Preference tuning (run.task: dpo) end to end on the tiny llama and docs/examples/prefs.jsonl.

Data: records -> chat-rendered pairs with response-only masks, one-line errors naming file, record and field.
Flow (`distillery run` with run.task=dpo): pairs -> student -> reference -> DPO epochs -> evaluate -> select ->
export through Prefect with MLflow;
the held-out reward accuracy rises from the baseline's 50% (margin 0, no adapter), the KL to the reference
grows from 0, an identical rerun is fully cached, the exported PEFT adapter is the best checkpoint's. The
gradient itself is held to torch autograd through PEFT in tests/test_dpo.py.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from data.preferences import Fields, load_pairs, pair_batch, tokenize_pairs
from data.records import DataError
from model.tokenizer import load_tokenizer
from schemas.config import ConfigError, RunConfig, load_config
from stages.inputs import InputError
from tests.pipeline_fixtures import _prefect_harness, write_tiny_llama  # noqa: F401 (fixture)

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "prefs.jsonl"


@cache
def _model() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="distillery-dpo-"))
    return write_tiny_llama(folder / "tiny.gguf", context_length=128)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- data


def test_pairs_mask_only_the_response(tmp_path: Path) -> None:
    tok = load_tokenizer(_model())
    multi = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "the lake?"},
    ]
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "Where does the river run?", "chosen": "Over stone and sand.", "rejected": "No."},
            {"prompt": multi, "chosen": [{"role": "assistant", "content": "By the shore."}], "rejected": "In a mill."},
        ],
    )
    pairs = load_pairs(path)
    rows = tokenize_pairs(pairs, [0, 1], tok, 128)
    trained = []
    for ids, mask in zip(rows.chosen_ids + rows.rejected_ids, rows.chosen_mask + rows.rejected_mask, strict=True):
        trained.append(tok.decode([int(ids[t + 1]) for t in np.flatnonzero(mask)]))
    assert trained == [
        "Over stone and sand.<|im_end|>",
        "By the shore.<|im_end|>",
        "No.<|im_end|>",
        "In a mill.<|im_end|>",
    ]
    assert "hello there" in tok.decode(rows.chosen_ids[1].tolist())  # the earlier assistant turn: prompt, not trained
    ids, mask = pair_batch(rows, np.array([1]), 2, 128)
    assert ids.shape == mask.shape == (4, 128)
    assert mask[1].sum() == mask[3].sum() == 0  # the missing pair of a partial batch
    assert mask[2].sum() == rows.rejected_mask[1].sum()
    cut = tokenize_pairs(pairs, [0], tok, 24)  # the response starts after token 24: no response token left
    assert len(cut) == 0 and cut.dropped == 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "line 1: no field 'rejected'; available fields: prompt, chosen "
         "(preference.rejected_field)"),
        ({"prompt": "q", "chosen": "a", "rejected": 3}, "line 1: field 'rejected': messages must be a list"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "line 1: field 'chosen' is empty"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "line 1: field 'chosen' must end with an assistant turn"),
        ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
         "field 'prompt': messages[0] has no 'content'"),
        (["q", "a", "b"], "line 1: a preference record must be an object"),
    ],
)  # fmt: skip
def test_malformed_rows_name_file_row_and_field(tmp_path: Path, row: object, message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError) as err:
        load_pairs(path, fields=Fields())
    assert str(err.value).startswith(str(path)) and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_config_checks(tmp_path: Path) -> None:
    base = [f"model.student={_model()}", f"data.path={EXAMPLE}", "run.task=dpo"]
    cfg = load_config(None, base)
    assert cfg.model.teacher == cfg.model.student  # not read by a preference run
    shipped = load_config(EXAMPLE.parents[2] / "configs" / "dpo.yaml")
    assert shipped.run.task == "dpo" and shipped.data.path == EXAMPLE.resolve()  # relative to configs/
    with pytest.raises(ConfigError, match="label_smoothing applies to loss_type sigmoid only"):
        load_config(None, [*base, "preference.loss_type=ipo", "preference.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="gamma is the SimPO margin"):
        load_config(None, [*base, "preference.gamma=0.5"])
    from stages.pairs import check_inputs

    with pytest.raises(InputError, match="train.precision: tensorcore needs the GPU engine"):
        check_inputs(load_config(None, [*base, "train.backend=numpy", "train.precision=tensorcore", "data.seq_len=64"]))
    from typer.testing import CliRunner

    from flows.cli import app

    bad = [*base, "train.backend=numpy", "train.precision=tensorcore", "data.seq_len=64"]
    result = CliRunner().invoke(app, ["run", *(f"--set={x}" for x in bad)])
    assert result.exit_code == 1 and "error: train.precision: tensorcore needs" in result.output, result.output
    other = write_tiny_llama(tmp_path / "other.gguf", context_length=128, extra_tokens=("xyz",))
    with pytest.raises(InputError, match="preference.reference: "):
        check_inputs(load_config(None, [*base, f"preference.reference={other}", "data.seq_len=64"]))


# ---------------------------------------------------------------- the flow


def _config(workdir: Path, **preference: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"student": str(_model()), "student_quant": ["Q4_0"]},
            "data": {"path": str(EXAMPLE), "seq_len": 80, "eval_fraction": 0.25},
            "lora": {"r": 4, "alpha": 8.0, "targets": ["q", "v", "down"]},
            "optim": {"lr": 5e-3, "warmup_steps": 1},
            "train": {"epochs": 2, "batch_size": 4, "max_steps_per_epoch": 3, "backend": "numpy"},
            "preference": {"beta": 0.5, **preference},
            "run": {"workdir": str(workdir), "experiment": "tiny-dpo", "task": "dpo"},
        }
    )


def test_preference_flow_end_to_end(prefect_harness: None, tmp_path: Path) -> None:
    from safetensors.numpy import load_file
    from typer.testing import CliRunner

    from data.adapters import peft_tensors
    from data.checkpoint import load_checkpoint
    from flows.cli import app
    from flows.distill import run_pipeline
    from model.gguf import GGUFFile
    from schemas.config import dump_config
    from schemas.manifests import sha256_file

    cfg = _config(tmp_path / "run")
    path = tmp_path / "dpo.yaml"
    path.write_text(dump_config(cfg), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "held-out preference pairs" in out and "before: no adapter" in out and "(best)" in out, out
    assert "ran: pairs, student, reference, dpo-epoch-0, dpo-epoch-1, evaluate-baseline" in out, out

    summary = run_pipeline(cfg)  # the distill flow (a served deployment's) hands a dpo config to its own flow
    assert summary["stages"]["ran"] == [] and "reference" in summary["stages"]["cached"], summary["stages"]
    p = summary["preference"]
    base, best = p["baseline"], p["best"]
    assert base["reward_accuracy"] == 0.5 and base["margin"] == 0.0 and base["kl_reference"] == 0.0
    assert base["loss"] == pytest.approx(np.log(2))
    assert best["reward_accuracy"] > 0.5 and best["margin"] > 0 and best["kl_reference"] > 0, best
    assert best["loss"] < base["loss"]
    root = Path(summary["workdir"])
    assert summary["pairs"]["n_train"] + summary["pairs"]["n_eval"] == 48
    ref = summary["reference"]
    assert sha256_file(root / ref["file"]["path"]) == ref["file"]["sha256"] and ref["n_pairs"] == 48
    chosen = summary["checkpoints"][p["best_epoch"]]
    exported = root / summary["files"]["peft_dir"] / "adapter_model.safetensors"
    assert exported.is_file()
    adapter = load_checkpoint(root / chosen["dir"])[0]
    assert max(float(np.abs(pair.B).max()) for pair in adapter.values()) > 0  # trained
    with GGUFFile(_model()) as f:
        expect = peft_tensors(adapter, f.config())
    got = load_file(exported)
    assert sorted(got) == sorted(expect) and all(np.array_equal(got[k], expect[k]) for k in expect)

    from tasks.tracking import client_for

    runs = client_for(cfg).search_runs([summary["mlflow"]["experiment_id"]], order_by=["attributes.start_time ASC"])
    run = runs[0]  # the CLI's run, which trained
    assert run.data.metrics["best/reward_accuracy"] == best["reward_accuracy"]
    assert "train/loss" in run.data.metrics and run.data.params["preference.beta"] == "0.5"
    assert "registered model: tiny-dpo-adapter version 1" in out


# ---------------------------------------------------------------- stages without Prefect


class _Crash(Exception):
    pass


def test_resume_is_bitwise_and_variants_run(tmp_path: Path) -> None:
    """A crash after step 2 resumes from the step-2 checkpoint to the same adapter bytes; SimPO skips the
    reference; another reference GGUF is read as the reference (its own KL)."""
    import stages.pairs
    import stages.preference_evaluate
    import stages.preference_train
    import stages.reference
    import stages.student
    from schemas.manifests import sha256_file

    def stages_of(cfg: RunConfig):
        pairs, student = stages.pairs.run(cfg), stages.student.run(cfg)
        ref = None if cfg.preference.reference_free else stages.reference.run(cfg, student, pairs)
        return pairs, student, ref

    cfg = _config(tmp_path / "a")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": 1, "checkpoint_every": 1})})
    pairs, student, ref = stages_of(cfg)
    whole = stages.preference_train.run_epoch(cfg, student, pairs, ref, 0)

    broken = cfg.model_copy(update={"run": cfg.run.model_copy(update={"workdir": tmp_path / "b"})})
    pairs_b, student_b, ref_b = stages_of(broken)

    def crash(rec) -> None:
        if rec.step == 2:
            raise _Crash

    with pytest.raises(_Crash):
        stages.preference_train.run_epoch(broken, student_b, pairs_b, ref_b, 0, on_step=crash)
    resumed = stages.preference_train.run_epoch(broken, student_b, pairs_b, ref_b, 0)
    assert resumed.adapter.sha256 == whole.adapter.sha256 and resumed.step == whole.step == 3

    simpo = _config(tmp_path / "c", reference_free=True, gamma=0.2)
    simpo = simpo.model_copy(update={"train": simpo.train.model_copy(update={"epochs": 1})})
    pairs_c, student_c, ref_c = stages_of(simpo)
    assert ref_c is None
    ckpt = stages.preference_train.run_epoch(simpo, student_c, pairs_c, None, 0)
    ev = stages.preference_evaluate.run(simpo, student_c, pairs_c, None, ckpt)
    assert np.isfinite(ev.loss) and ev.kl_reference > 0 and ev.n_pairs == pairs_c.n_eval

    other = write_tiny_llama(tmp_path / "ref.gguf", seed=7, context_length=128)
    with_ref = _config(tmp_path / "d", reference=str(other))
    pairs_d, student_d, ref_d = stages_of(with_ref)
    assert ref_d.reference == "file" and ref_d.reference_sha256 == sha256_file(other)
    assert ref_d.file.sha256 != ref.file.sha256  # other weights, other log-probs
    base = stages.preference_evaluate.run(with_ref, student_d, pairs_d, ref_d)
    assert base.kl_reference > 0 and base.margin != 0  # the student without adapter is not that reference


def test_pairs_from_parquet_and_a_saved_dataset(tmp_path: Path) -> None:
    import datasets

    rows = [json.loads(line) for line in EXAMPLE.read_text(encoding="utf-8").splitlines()[:5]]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "hf"))
    expect = load_pairs(EXAMPLE, max_pairs=5)
    for path in (tmp_path / "p.parquet", tmp_path / "hf"):
        got = load_pairs(path)
        assert [(p.prompt, p.chosen, p.rejected) for p in got] == [(p.prompt, p.chosen, p.rejected) for p in expect]
    renamed = datasets.Dataset.from_list([{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows])
    renamed.to_parquet(str(tmp_path / "r.parquet"))
    assert len(load_pairs(tmp_path / "r.parquet", fields=Fields("q", "good", "bad"))) == 5
    with pytest.raises(
        DataError,
        match="no field 'prompt' or 'chosen' or 'rejected'; available fields: q, good, bad "
        r"\(preference.prompt_field",
    ):
        load_pairs(tmp_path / "r.parquet")


def test_gpu_backend_trains_as_numpy_does(tmp_path: Path) -> None:
    """train.backend=gpu (lavapipe here): the reference and two steps on GPUStudent + GpuPreference give the numpy
    engine's log-probs and losses (f32 kernels vs BLAS)."""
    import pyarrow.parquet as pq

    import stages.pairs
    import stages.preference_train
    import stages.reference
    import stages.student
    from data.preferences import read_pair_rows

    results = {}
    for backend in ("numpy", "gpu"):
        cfg = _config(tmp_path / backend)
        cfg = cfg.model_copy(
            update={
                "train": cfg.train.model_copy(update={"epochs": 1, "max_steps_per_epoch": 2, "backend": backend}),
                "data": cfg.data.model_copy(update={"max_documents": 12}),  # lavapipe: 12 pairs
            }
        )
        pairs, student = stages.pairs.run(cfg), stages.student.run(cfg)
        ref = stages.reference.run(cfg, student, pairs)
        ckpt = stages.preference_train.run_epoch(cfg, student, pairs, ref, 0)
        table = pq.read_table(ref.file.resolve(tmp_path / backend)).to_pydict()
        results[backend] = (np.array(table["chosen_logp"] + table["rejected_logp"]), ckpt.metrics["train_loss"])
        assert len(read_pair_rows(pairs.train.resolve(tmp_path / backend))) == pairs.n_train
    (lp_np, loss_np), (lp_gpu, loss_gpu) = results["numpy"], results["gpu"]
    assert np.abs(lp_gpu - lp_np).max() <= 1e-4 * np.abs(lp_np).max()
    assert abs(loss_gpu - loss_np) <= 1e-3 * abs(loss_np), (loss_gpu, loss_np)
