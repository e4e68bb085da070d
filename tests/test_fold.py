"""The exact fold of a mergeable adapter (model/fold.py, data/adapters.py merge_adapter(fold=True)): for every type
the reader supports, the folded tensor decodes to the stored base + dW within that type's stated rounding (f16
rounding of the offset, of Q4_K's sub-block scale, half an 8-bit step where the sum is re-encoded), while
re-quantizing W + dW to 4 bits loses most of dW; and the merged GGUF's logits equal the adapter's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from data.adapters import merge_adapter
from model import quant as qc
from model import reference as R
from model.config import LORA_TARGETS
from model.fold import FOLD_TYPE, FoldError, fold
from model.gguf import GGUFFile
from tests.pipeline_fixtures import run_summary
from tests.test_export import CFG, IDS, _assert_copied, _base_logits, _merged_weights, write_tiny_gguf

F16_ULP = 2.0**-11  # relative rounding of an f16 (half an ulp of 2^-10)


def _group_delta(rng: np.random.Generator, rows: int, n_in: int, rms: float) -> np.ndarray:
    return np.repeat(rng.normal(0, rms, (rows, n_in // qc.QK)), qc.QK, axis=1)


def _bound(qtype: Q, data: np.ndarray, out: Q, folded: np.ndarray) -> np.ndarray:
    """The stated per-element error bound of a fold from `qtype` into `out` (data: the folded bytes)."""
    eps32 = 4e-7 * np.abs(folded) + 1e-30  # f32 arithmetic of the decoder
    if out == Q.F32:
        return eps32
    if out == Q.F16:
        return F16_ULP * np.abs(folded) + 1e-7
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape((-1, qc.type_size(out)))
    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float64).reshape(-1, 1)
    shape = folded.shape
    if out == Q.Q8_0:  # re-encoded: half a step, plus the f16 rounding of the step times the code
        step = np.abs(folded).reshape(-1, 32).max(axis=1, keepdims=True) / 127
        return (0.5 * step + 127 * F16_ULP * step + 1e-7).repeat(32, axis=1).reshape(shape)
    m = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float64).reshape(-1, 1)
    # _1 types: the offset's f16 rounding; from Q4_K also the sub-block scale's (times the largest code, 15)
    scale_rounding = 15 * F16_ULP * np.abs(d) if qtype == Q.Q4_K else 0.0
    per_block = F16_ULP * np.abs(m) + scale_rounding
    return (per_block + np.zeros((1, 32))).reshape(shape) + eps32


@pytest.mark.parametrize("qtype", list(qc.SUPPORTED_TYPES), ids=lambda t: t.name)
def test_fold_is_base_plus_delta_within_its_rounding(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    rows, n_in = 6, 512
    w = rng.normal(0, 0.05, (rows, n_in)).astype(np.float32)
    raw = w.view(np.uint8) if qtype == Q.F32 else qc.quantize(w, qtype)
    base = qc.dequantize(raw, qtype, w.shape).astype(np.float64)
    delta = _group_delta(rng, rows, n_in, 2e-3)
    out, data = fold(raw, qtype, w.shape, delta)
    assert out == FOLD_TYPE[qtype]
    if out == Q.F16:
        folded = np.asarray(data, np.float32).astype(np.float64)
    else:
        data = np.ascontiguousarray(data)
        folded = qc.dequantize(data.view(np.uint8) if out != Q.F32 else data, out, w.shape).astype(np.float64)
    err = np.abs(folded - (base + delta))
    bound = _bound(qtype, np.asarray(data), out, base + delta)
    assert (err <= bound).all(), (qtype.name, float((err - bound).max()))
    kept = 1 - np.sqrt(np.mean((folded - base - delta) ** 2)) / np.sqrt(np.mean(delta**2))
    print(f"{qtype.name} -> {out.name}: max err {err.max():.2e}, rms err / rms dW {1 - kept:.3f}")
    if qtype not in (Q.Q6_K, Q.Q8_0):  # offsets and floats: dW kept to f16 rounding of the offset (|m| ~ 8 d)
        assert kept > 0.97, kept
    else:  # re-encoded at 8 bits: dW of 4 % of the weights' rms kept to about a third of an 8-bit step
        assert kept > 0.7, kept
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K):  # the codes are the base's
        assert np.array_equal(_codes(out, np.asarray(data)), _codes_of(qtype, raw, w.shape))


def _codes(qtype: Q, data: np.ndarray) -> np.ndarray:
    """The integer codes of a _1 tensor: (decoded - m) / d, rounded."""
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape((-1, qc.type_size(qtype)))
    fake = blocks.copy()
    fake[:, :2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    fake[:, 2:4] = 0
    return qc.codec(qtype).dequantize_blocks(fake).astype(np.int64)


def _codes_of(qtype: Q, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The codes of the base tensor, per 32 elements, in the _1 type's sense (0 .. 2^bits - 1)."""
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape((-1, qc.type_size(qtype)))
    if qtype == Q.Q4_K:
        q = blocks[:, 16:].reshape((-1, 4, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
        return (q & np.uint8(0x0F)).reshape((-1, 32)).astype(np.int64)
    fake = blocks.copy()
    fake[:, :2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if qtype in (Q.Q4_1, Q.Q5_1):
        fake[:, 2:4] = 0
        return qc.codec(qtype).dequantize_blocks(fake).astype(np.int64)
    centre = 8 if qtype == Q.Q4_0 else 16
    return qc.codec(qtype).dequantize_blocks(fake).astype(np.int64) + centre


def test_requantizing_loses_what_the_fold_keeps() -> None:
    """The issue: W + dW re-encoded at Q4_0 keeps little of a small dW; the fold keeps it to f16 rounding."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (16, 576)).astype(np.float32)
    raw = qc.quantize(w, Q.Q4_0)
    base = qc.dequantize(raw, Q.Q4_0, w.shape).astype(np.float64)
    delta = _group_delta(rng, 16, 576, 2e-3)
    requant = qc.dequantize(qc.quantize((base + delta).astype(np.float32), Q.Q4_0), Q.Q4_0, w.shape) - base
    out, data = fold(raw, Q.Q4_0, w.shape, delta)
    folded = qc.dequantize(data, out, w.shape) - base
    kept_requant = float(np.sum(requant * delta) / np.sum(delta * delta))
    kept_fold = float(np.sum(folded * delta) / np.sum(delta * delta))
    assert kept_requant < 0.5 and abs(kept_fold - 1) < 1e-3, (kept_requant, kept_fold)


def test_fold_refuses_a_plain_update() -> None:
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (4, 64)).astype(np.float32)
    with pytest.raises(FoldError, match="not constant over groups of 32"):
        fold(qc.quantize(w, Q.Q4_0), Q.Q4_0, w.shape, rng.normal(0, 1e-3, w.shape))


def _student_types(name: str, w: np.ndarray) -> int:
    """Like the demo: Q4_K where rows are 256 long (ffn_down), Q4_0 elsewhere; q and k Q5_0, v Q8_0."""
    if name.endswith("ffn_down.weight"):
        return Q.Q4_K
    part = name.split(".")[-2]
    return {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "token_embd": Q.Q8_0}.get(part, Q.Q4_0)


def test_merged_gguf_is_the_adapter(tmp_path: Path) -> None:
    """A mergeable adapter on a quantized tiny llama: the merged GGUF's logits equal the base + adapter's to the
    fold's rounding (far below what one 4-bit quantization moves them), types per FOLD_TYPE, the rest copied."""
    base = tmp_path / "base.gguf"
    weights = write_tiny_gguf(base, CFG, seed=5, qtype=_student_types)
    adapter = R.init_lora(CFG, LORA_TARGETS, r=4, seed=6, group=qc.QK)
    rng = np.random.default_rng(7)
    for pair in adapter.values():
        pair.B[...] = rng.normal(0, 0.05, pair.B.shape)
    scale = 2.0
    report = merge_adapter(base, adapter, scale, tmp_path / "merged.gguf", fold=True)
    expect = _base_logits(weights, adapter, scale)
    moved = np.abs(expect - _base_logits(weights)).max()
    err = np.abs(R.forward(_merged_weights(tmp_path / "merged.gguf"), CFG, IDS) - expect).max()
    plain = merge_adapter(base, adapter, scale, tmp_path / "requant.gguf")  # the re-quantizing merge
    requant_err = np.abs(R.forward(_merged_weights(tmp_path / "requant.gguf"), CFG, IDS) - expect).max()
    # measured: moved 4.3, fold 0.09 (most of it attn_v's Q8_0 re-encoding), re-quantizing merge 1.35
    assert moved > 0.5 and err < 0.1 * requant_err and err < 0.03 * moved, (moved, err, requant_err)
    assert plain["error_rms"] > 10 * report["error_rms"]
    with GGUFFile(base) as f, GGUFFile(tmp_path / "merged.gguf") as g:
        for name, stats in report["tensors"].items():
            assert g.info(name).type_name == stats["type"] == FOLD_TYPE[Q(f.info(name).ggml_type)].name
    assert report["fold"] and report["file_bytes"] < 1.15 * report["base_file_bytes"]
    _assert_copied(base, tmp_path / "merged.gguf", set(report["tensors"]))


def test_merge_refuses_a_plain_adapter_for_folding(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    write_tiny_gguf(base, CFG, seed=8, qtype=_student_types)
    adapter = R.init_lora(CFG, ["q"], r=2, seed=9)
    with pytest.raises(ValueError, match="not constant over groups of 32"):
        merge_adapter(base, adapter, 1.0, tmp_path / "m.gguf", fold=True)
    assert not (tmp_path / "m.gguf").exists()


def test_gain_kept_and_its_warning() -> None:
    """The demo's measured plain merge (issue 23): KL 0.2211 -> 0.1326 with the adapter, 0.2147 merged: 7 %."""
    from stages.evaluate import gain_kept, gain_note

    kept = gain_kept(0.2211, 0.1326, 0.2147)
    assert kept == pytest.approx(0.0723, abs=1e-4)
    note = gain_note(kept, "plain")
    assert note is not None and note.startswith("The merged GGUF keeps 7% of") and "Warning" in note
    assert "lora.kind mergeable" in note
    fine = gain_note(gain_kept(0.2211, 0.1326, 0.1330), "mergeable")
    assert fine == "The merged GGUF keeps 100% of the adapter's held-out KL gain."
    assert gain_kept(0.2, 0.25, 0.2) is None and gain_note(None, "plain") is None


def test_report_prints_the_gain_a_merge_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import print_report

    def ev(kl: float, epoch: int | None = None) -> dict:
        return {"kl": kl, "top1": 0.7, "ce": 3.5, "ppl": 33.0, "epoch": epoch}

    summary = run_summary(
        baseline=ev(0.2211),
        evals=[ev(0.1326, 0)],
        best_epoch=0,
        best=ev(0.1326, 0),
        merged=ev(0.2147),
        lora_kind="plain",
    )
    print_report(summary, Path("/w"))
    out = " ".join(capsys.readouterr().out.split())
    assert "merged GGUF" in out and "keeps 7% of the adapter's held-out KL gain. Warning: less than 50%" in out
    print_report({**summary, "merged": ev(0.1330), "lora_kind": "mergeable"}, Path("/w"))
    out = " ".join(capsys.readouterr().out.split())
    assert "keeps 100% of the adapter's held-out KL gain." in out and "Warning" not in out


def test_report_md_has_the_merged_row_and_the_gain_kept(tmp_path: Path) -> None:
    from schemas.config import load_config
    from tasks.tracking import render_report

    cfg = load_config(
        None, ["model.student=s.gguf", "model.teacher=t.gguf", f"data.path={tmp_path}", "lora.kind=mergeable"]
    )

    def ev(kl: float, epoch: int | None = None) -> dict:
        return {"kl": kl, "top1": 0.7, "ce": 3.5, "ppl": 33.0, "epoch": epoch}

    merge = {"merged": 210.0, "error_rms": 1e-4, "error_max": 2e-3, "delta_rms": 1e-3, "fold": 1.0,
             "file_bytes": 98362432.0, "base_file_bytes": 91726912.0}  # fmt: skip
    summary = {
        "flow_run_name": "n",
        "baseline": ev(0.2211),
        "evals": [ev(0.1282, 0)],
        "best_epoch": 0,
        "best": ev(0.1282, 0),
        "merged": ev(0.1283),
        "merged_gain_kept": 0.9995,
        "stages": {"ran": [], "cached": []},
        "files": {"merged": "export/k/merged.gguf"},
        "export": {"merge_report": merge},
        "mlflow": {"run_id": "r", "tracking_uri": "sqlite:///x.db", "url": "u"},
        "flow_run_id": "abc",
    }
    text = render_report(cfg, summary)
    assert "| merged GGUF | 0.1283 |" in text
    assert "The merged GGUF keeps 100% of the adapter's held-out KL gain." in text and "Warning" not in text
    assert "(folded, merge error rms 0.0001, 1.072x the student's size)" in text
