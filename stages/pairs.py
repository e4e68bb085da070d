"""pairs: preference records (prompt, chosen, rejected) -> tokenized train/eval pairs as Parquet (run.task: dpo).

Prompts are rendered with the student GGUF's chat template; only response tokens are trained (data/preferences.py).
The held-out pairs are drawn per pair by the tokenize stage's hash (data.eval_fraction, seed SPLIT_SEED), or
every pair of data.eval_path is held out. `check_inputs` is the preflight of a preference run.
"""

from __future__ import annotations

import logging

import numpy as np

from data.preferences import Fields, load_pairs, tokenize_pairs, write_pair_rows
from data.records import DataError, dataset_fingerprint
from data.tokens import split_documents
from data.topk import check_vocab
from model.gguf import GGUFFile
from model.tokenizer import load_tokenizer
from schemas.config import RunConfig
from schemas.manifests import FileRef
from schemas.preferences import PairsManifest
from stages.inputs import InputError, _open
from stages.inputs import check_inputs as check_distill_inputs
from stages.keys import StageKey, file_sha256
from stages.layout import stage_dir, workdir
from stages.tokenize import SPLIT_SEED, read_data_field

log = logging.getLogger(__name__)

FOLDER = "pairs"
KEY = StageKey(
    stage="preference-pairs",
    version="1",
    config_fields=(
        "data.format",
        "data.seq_len",
        "data.eval_fraction",
        "data.max_documents",
        "preference.prompt_field",
        "preference.chosen_field",
        "preference.rejected_field",
    ),
    files=("model.student",),  # the tokenizer and chat template come from the student GGUF
    dataset=True,
)


def check_inputs(cfg: RunConfig) -> None:
    """The distillation preflight (the student, data paths, seq_len, lora.layers) plus what a preference run
    needs: a chat template in the student, a reference GGUF of the same vocabulary, tensorcore only on the GPU."""
    from training.preference import check_backend

    check_distill_inputs(cfg)
    with GGUFFile(cfg.model.student) as f:
        if not f.metadata.get("tokenizer.chat_template"):
            raise InputError(
                f"model.student: {cfg.model.student}: no tokenizer.chat_template (preference prompts are rendered "
                "with it)"
            )
        student_tokens = list(f.metadata.get("tokenizer.ggml.tokens") or [])
    ref = cfg.preference.reference
    if ref is not None:
        if cfg.preference.reference_free:
            raise InputError("preference.reference: set, but preference.reference_free is true (no reference used)")
        tokens, ref_cfg = _open(ref, "preference.reference")
        ctx = ref_cfg.context_length
        try:
            check_vocab(tokens, student_tokens, ref, cfg.model.student)
        except ValueError as exc:
            raise InputError(f"preference.reference: {exc}") from None
        if cfg.data.seq_len > ctx:
            raise InputError(f"data.seq_len: {cfg.data.seq_len} exceeds the context length {ctx} of {ref}")
    try:
        check_backend(cfg)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def fields(cfg: RunConfig) -> Fields:
    p = cfg.preference
    return Fields(p.prompt_field, p.chosen_field, p.rejected_field)


def _pairs(cfg: RunConfig, field: str) -> list:
    d = cfg.data
    return read_data_field(cfg, field, lambda path: load_pairs(path, d.format, fields(cfg), d.max_documents))


def run(cfg: RunConfig) -> PairsManifest:
    """Read cfg.data.path (and eval_path), tokenize every pair with the student's chat template, split, write."""
    root = workdir(cfg)
    out = stage_dir(cfg, FOLDER, KEY.key(cfg, {}))
    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.student)
    pairs = _pairs(cfg, "data.path")
    if d.eval_path is not None:
        held = _pairs(cfg, "data.eval_path")
        train = tokenize_pairs(pairs, range(len(pairs)), tokenizer, d.seq_len)
        held_out = tokenize_pairs(held, range(len(held)), tokenizer, d.seq_len)
    else:
        is_eval = split_documents([True] * len(pairs), d.eval_fraction, SPLIT_SEED)
        train = tokenize_pairs(pairs, np.flatnonzero(~is_eval).tolist(), tokenizer, d.seq_len)
        held_out = tokenize_pairs(pairs, np.flatnonzero(is_eval).tolist(), tokenizer, d.seq_len)
    for name, rows in (("train", train), ("eval", held_out)):
        if not len(rows):
            source = d.eval_path if name == "eval" and d.eval_path else d.path
            raise DataError(
                f"{source}: the {name} split has no usable pair ({len(pairs)} pairs, {rows.dropped} with no response "
                f"token within data.seq_len={d.seq_len}, data.eval_fraction={d.eval_fraction}); give more pairs"
            )
    files = {
        name: write_pair_rows(rows, out / f"{name}.parquet") for name, rows in (("train", train), ("eval", held_out))
    }
    longest = max(len(ids) for rows in (train, held_out) for ids in (*rows.chosen_ids, *rows.rejected_ids))
    manifest = PairsManifest(
        dataset_fingerprint=dataset_fingerprint(d.path, d.format, **vars(fields(cfg))),
        tokenizer_sha256=file_sha256(cfg.model.student, root),
        seq_len=max(2, longest),  # the engines' T: the longest row (<= data.seq_len), no all-padding columns
        train=FileRef.of(files["train"].resolve(), root),
        eval=FileRef.of(files["eval"].resolve(), root),
        n_train=len(train),
        n_eval=len(held_out),
        dropped=train.dropped + held_out.dropped,
    )
    log.info(
        "preference pairs: train %d, eval %d, dropped %d (no response token within seq_len %d) -> %s",
        len(train), len(held_out), manifest.dropped, d.seq_len, out,
    )  # fmt: skip
    return manifest.at(out, root)
