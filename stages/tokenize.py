"""tokenize: the data files -> train/eval token shards (Arrow through datasets), keyed by the data's bytes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from data.records import DataError, dataset_fingerprint, load_records
from data.tokens import tokenize_dataset, write_token_shards
from model.tokenizer import load_tokenizer
from schemas.config import RunConfig
from schemas.manifests import TokenizeManifest
from stages.keys import StageKey, file_sha256
from stages.layout import stage_dir, workdir

log = logging.getLogger(__name__)

FOLDER = "tokens"
# The held-out split is drawn with a fixed seed, not train.seed: changing the training seed must not
# re-tokenize the data and recompute the teacher.
SPLIT_SEED = 0

KEY = StageKey(
    stage="tokenize",
    version="1",
    config_fields=(
        "data.format",
        "data.text_field",
        "data.messages_field",
        "data.assistant_only",
        "data.seq_len",
        "data.eval_fraction",
        "data.max_documents",
        "data.pack",
    ),
    files=("model.student",),  # the tokenizer comes from the student GGUF
    dataset=True,
)


def read_data_field(cfg: RunConfig, field: str, load: Callable[[Path], list]) -> list:
    """load(the file a data field names, e.g. "data.eval_path"); a DataError it raises names the field."""
    try:
        return load(getattr(cfg.data, field.split(".")[1]))
    except DataError as exc:
        raise DataError(f"{field}: {exc}") from None


def _records(cfg: RunConfig, field: str) -> list:
    """load_records of the file a data field names; its errors name the field."""
    d = cfg.data
    return read_data_field(
        cfg, field, lambda path: load_records(path, d.format, d.text_field, d.messages_field, d.max_documents)
    )


def run(cfg: RunConfig) -> TokenizeManifest:
    """Read cfg.data, tokenize with the student's tokenizer, pack into seq_len rows, split, write shards."""
    root = workdir(cfg)
    out = stage_dir(cfg, FOLDER, KEY.key(cfg, {}))
    d = cfg.data
    fingerprint = dataset_fingerprint(d.path, d.format, d.text_field, d.messages_field, d.max_documents)
    tokenizer = load_tokenizer(cfg.model.student)
    docs = _records(cfg, "data.path")
    eval_docs = None
    if d.eval_path is not None:  # a split by source: every document of eval_path is held out
        eval_docs = _records(cfg, "data.eval_path")
    try:
        train, held_out = tokenize_dataset(
            docs, tokenizer, d.seq_len, d.eval_fraction, SPLIT_SEED, d.pack, d.assistant_only, eval_docs
        )
    except DataError as exc:  # name the field whose file it is
        field = "data.eval_path" if d.eval_path is not None and str(d.eval_path) in str(exc) else "data.path"
        raise DataError(f"{field}: {exc}") from None
    for name, split in (("train", train), ("eval", held_out)):
        if len(split) == 0:
            from_eval_file = name == "eval" and d.eval_path is not None
            field, path = ("data.eval_path", d.eval_path) if from_eval_file else ("data.path", d.path)
            raise DataError(
                f"{field} ({path}): the {name} split is empty ({len(docs)} documents, "
                f"data.eval_fraction={d.eval_fraction}); give more documents"
            )
    manifest = write_token_shards(
        train,
        held_out,
        out,
        dataset_fingerprint=fingerprint,
        tokenizer_sha256=file_sha256(cfg.model.student, root),
        vocab_size=tokenizer.vocab_size,
        seq_len=d.seq_len,
        root=root,
    )
    log.info(
        "tokenized %d documents: train %d sequences (%d trained positions), eval %d sequences (%d) -> %s",
        len(docs),
        manifest.train.n_sequences,
        manifest.train.n_positions,
        manifest.eval.n_sequences,
        manifest.eval.n_positions,
        out,
    )
    return manifest.at(out, root)
