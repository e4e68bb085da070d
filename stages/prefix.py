"""prefix: the frozen-prefix activation cache, the residual stream entering the lowest adapted block.

When lora.layers leaves out the lowest blocks (train.prefix_cache auto), the input of block L = min(lora.layers)
is computed once per sequence of both token splits (training.prefix.prefix_fn, the run's engine backend) and
stored as float16 shards verified by sha256 (data/prefix.py), in <workdir>/prefix/<key>; train and evaluate
start their forward at block L from it. The folder is addressed by the content key (student, token shards, L,
backend, precision), so train and evaluate find it from their own inputs (`cache`); a rerun keeps every shard
that verifies and computes the rest. When the cache does not apply, run returns None.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from data.prefix import (
    MANIFEST_NAME,
    PrefixError,
    plan_shards,
    read_manifest,
    verify_shard,
    write_manifest,
    write_shard,
)
from data.tokens import read_token_table, token_rows
from schemas.config import RunConfig
from schemas.manifests import PrefixManifest, PrefixShard, StudentManifest, TokenizeManifest
from stages.keys import StageKey
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar

log = logging.getLogger(__name__)

FOLDER = "prefix"
KEY = StageKey(
    stage="prefix",
    version="1",
    config_fields=("train.backend", "train.precision", "train.batch_size", "run.gpu_backend"),
    inputs=("student", "tokens", "layer"),
)


def layer(cfg: RunConfig) -> int:
    """The block whose input is cached (0: the cache does not apply)."""
    from training.prefix import prefix_layer

    return prefix_layer(cfg)


def folder(cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest) -> Path:
    """<workdir>/prefix/<key>: where the cache of this student, these tokens and this block lives."""
    return stage_dir(cfg, FOLDER, KEY.key(cfg, {"student": student, "tokens": tokens, "layer": layer(cfg)}))


def _kept(out: Path, header: PrefixManifest, plans: list[tuple[str, int, int]]) -> dict[tuple, PrefixShard]:
    """The shards of a previous run of the same header and plan that still verify, by (split, start, end)."""
    old = read_manifest(out)
    if old is None or old.model_copy(update={"shards": ()}) != header:
        return {}
    kept = {}
    for s in old.shards:
        key = (s.split, s.seq_start, s.seq_end)
        if key not in plans:
            continue
        try:
            verify_shard(out, s)
            kept[key] = s
        except PrefixError as exc:
            log.warning("%s: recomputing", exc)
    return kept


def run(
    cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, bar: BarFactory = no_bar
) -> PrefixManifest | None:
    """The cache of both splits (None when train.prefix_cache is off or lora.layers includes block 0)."""
    start = layer(cfg)
    if start == 0:
        return None
    from training.prefix import prefix_fn

    root = workdir(cfg)
    out = folder(cfg, student, tokens)
    out.mkdir(parents=True, exist_ok=True)
    token_dir = tokens.path_in(root)
    splits = {name: read_token_table(token_dir, name, tokens, root) for name in ("train", "eval")}
    seq_ids = {name: table.column("seq_id").to_numpy().astype(np.int64) for name, table in splits.items()}
    fn = prefix_fn(cfg, student.path_in(root), start, tokens.seq_len)
    header = PrefixManifest(
        layer=start,
        hidden=fn.hidden,
        seq_len=tokens.seq_len,
        student_sha256=student.file.sha256,
        token_shards_hash=tokens.shards_hash(),
        shards=(),
    )
    plans = plan_shards(seq_ids, tokens.seq_len, fn.hidden)
    kept = _kept(out, header, plans)
    todo = sum(end - begin for split, begin, end in plans if (split, begin, end) not in kept)
    shards: list[PrefixShard] = []
    ids_of: dict[str, np.ndarray] = {}
    with bar(f"prefix cache (block {start} input)", todo) as b:
        for index, (split, begin, end) in enumerate(plans):
            if (split, begin, end) in kept:
                shards.append(kept[(split, begin, end)])
                continue
            if split not in ids_of:
                ids_of[split] = token_rows(splits[split], "input_ids", tokens.seq_len, np.int64)
            first = int(seq_ids[split][0])
            ids = ids_of[split][begin - first : end - first]
            per_call = max(1, fn.rows_per_call // tokens.seq_len)
            parts = []
            for s in range(0, len(ids), per_call):
                parts.append(fn(ids[s : s + per_call]))
                b.advance(len(parts[-1]))
            shards.append(write_shard(out, split, index, begin, np.concatenate(parts)))
            write_manifest(out, header.model_copy(update={"shards": tuple(shards)}))
    manifest = header.model_copy(update={"shards": tuple(shards)})
    write_manifest(out, manifest)
    log.log(
        logging.INFO if todo else logging.DEBUG,  # train and evaluate verify it again: quiet when nothing ran
        "prefix cache: input of block %d for %d sequences (%d of %d shards kept), %.1f MiB float16 in %s",
        start,
        sum(s.seq_end - s.seq_start for s in shards),
        len(kept),
        len(shards),
        sum(s.bytes for s in shards) / 2**20,
        out / MANIFEST_NAME,
    )
    return manifest.at(out, root)


def cache(cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest) -> PrefixManifest | None:
    """The cache train and evaluate start from: run() (shards already on disk and verified are kept, so after
    the prefix stage this only verifies them); None when it does not apply."""
    return run(cfg, student, tokens)
