"""teacher: the teacher's top-k next-token distributions as Parquet shards, resumable shard by shard.

plan checks the vocabularies, plans the shards over both token splits and opens the top-k manifest; shard
computes, writes and records one shard atomically (a shard already complete and verified on disk is kept);
finish gathers the shard records. run = plan + every shard + finish, for callers without Prefect (tasks/
runs one cached task per shard). A crash loses at most the shard being written. The top-k folder is addressed
by the plan's key. Data layout: data.topk (plan_all -> open_manifest -> compute_shard_rows -> write_shard ->
record_shard).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from data.tokens import read_token_table
from data.topk import (
    MANIFEST_NAME,
    ShardError,
    bytes_per_position,
    check_vocab,
    compute_shard_rows,
    open_manifest,
    plan_all,
    read_manifest,
    record_shard,
    verify_shard,
    write_shard,
)
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.files import SHARD_SCHEMAS, TOPK_COMPACT_SHARD
from schemas.manifests import ShardRecord, TeacherManifest, TokenizeManifest
from stages.keys import StageKey, file_sha256
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar
from training.engines import teacher_width
from training.teacher import Teacher, release_teacher, teacher_engine, teacher_fn

log = logging.getLogger(__name__)

FOLDER = "teacher"
KEY = StageKey(
    stage="teacher-plan",
    version="2",  # 2: batched teacher (bytes within reference_topk_batch's stated tolerance of version 1's)
    config_fields=("teacher.top_k", "teacher.temperature", "teacher.shard_tokens"),
    # sampled: top_k folded in again (it already is above) so that sampled plans from before the eval split was
    # kept top-k get new keys; top-k keys are untouched
    # compact top-k shards (topk_shard/2) hold other bytes: the format is folded in only then (plain keys stay put)
    config_fields_when=(
        ("teacher.store", "sampled", ("teacher.samples", "teacher.seed", "teacher.top_k")),
        ("teacher.topk_format", "compact", ("teacher.topk_format",)),
    ),
    files=("model.teacher",),
    inputs=("tokens", "engine"),  # engine: training.teacher.teacher_engine, resolved on the planning machine
)
# A shard's key: the plan's content (teacher, k, temperature, token shards, every shard's range) and its own row.
SHARD_KEY = StageKey(stage="teacher-shard", version="1", inputs=("plan", "shard"))


def plan(cfg: RunConfig, tokens: TokenizeManifest) -> TeacherManifest:
    """Refuse a vocabulary mismatch, plan the shards, open the top-k manifest; every shard pending. The sampled
    store samples the train split only: the eval split stays top-k (eval_k = teacher.top_k, with tail), so held-out
    metrics are exact and the same for both stores."""
    with GGUFFile(cfg.model.teacher) as t, GGUFFile(cfg.model.student) as s:
        teacher_tokens = list(t.metadata.get("tokenizer.ggml.tokens") or [])
        check_vocab(teacher_tokens, list(s.metadata.get("tokenizer.ggml.tokens") or []), t.path, s.path)
    root = workdir(cfg)
    engine = teacher_engine(cfg)
    token_dir = tokens.path_in(root)
    train = read_token_table(token_dir, "train", tokens, root)
    held_out = read_token_table(token_dir, "eval", tokens, root)
    planned = TeacherManifest(
        teacher_sha256=file_sha256(cfg.model.teacher, root),
        store=cfg.teacher.store,
        shard_schema=TOPK_COMPACT_SHARD
        if cfg.teacher.store == "topk" and cfg.teacher.topk_format == "compact"
        else SHARD_SCHEMAS[cfg.teacher.store],
        topk_format=cfg.teacher.topk_format,
        seed=cfg.teacher.seed if cfg.teacher.store == "sampled" else 0,
        k=teacher_width(cfg),
        eval_k=cfg.teacher.top_k if cfg.teacher.store == "sampled" else 0,
        temperature=cfg.teacher.temperature,
        vocab_size=len(teacher_tokens),
        token_shards_hash=tokens.shards_hash(),
        engine=engine,
        shards=tuple(plan_all(train, held_out, cfg.teacher.shard_tokens)),
    )
    out = stage_dir(cfg, FOLDER, KEY.key(cfg, key_inputs(cfg, tokens, engine)))
    open_manifest(out, planned)
    log.info("teacher top-k: %d shards planned in %s", len(planned.shards), out)
    return planned.at(out, root)


def key_inputs(cfg: RunConfig, tokens: TokenizeManifest, engine: str | None = None) -> dict:
    """What the plan's key folds in besides the config: the token manifest and the teacher engine (resolved here
    when not given)."""
    return {"tokens": tokens, "engine": teacher_engine(cfg) if engine is None else engine}


def check_engine(planned: TeacherManifest, teacher: Teacher) -> None:
    """Refuse to add rows computed by another engine than the plan's (another machine's auto, a changed setting)."""
    if planned.engine and teacher.engine != planned.engine:
        raise ValueError(
            f"teacher.backend: this machine computes the teacher on {teacher.engine}, the plan's shards on "
            f"{planned.engine} (each writes its own bytes); run the shards where the plan was made, or set "
            "teacher.backend / train.precision so both resolve alike"
        )


def shard_problem(cfg: RunConfig, planned: TeacherManifest, record: ShardRecord) -> str | None:
    """None when shard `record` is on disk, complete in the top-k manifest and verifies; else what is wrong."""
    out = planned.path_in(workdir(cfg))
    try:
        current = read_manifest(out)
        row = next((s for s in current.shards if s.shard == record.shard), None) if current else None
        if row is None:
            return f"{out / MANIFEST_NAME}: no row for shard {record.shard}"
        fmt = planned.format_of(row.split)
        verify_shard(out / row.file, row, planned.vocab_size, planned.k_of(row.split), planned.store_of(row.split), fmt)
    except (ShardError, ValueError) as exc:
        return str(exc)
    return None


def shard(
    cfg: RunConfig, tokens: TokenizeManifest, planned: TeacherManifest, record: ShardRecord, bar: BarFactory = no_bar
) -> ShardRecord:
    """Compute, write and record one shard of the plan; a shard already complete and verified is kept as is."""
    root = workdir(cfg)
    out = planned.path_in(root)
    current = open_manifest(out, planned)
    row = next(s for s in current.shards if s.shard == record.shard)
    if row.complete:
        try:
            k, store, fmt = planned.k_of(row.split), planned.store_of(row.split), planned.format_of(row.split)
            verify_shard(out / row.file, row, planned.vocab_size, k, store, fmt)
            log.info("shard %d already complete and verified: kept", record.shard)
            return row
        except ShardError as exc:
            log.warning("%s: recomputing", exc)
    split = read_token_table(tokens.path_in(root), record.split)
    n_seq = record.seq_end - record.seq_start
    teacher = teacher_fn(cfg, planned.store_of(record.split))
    check_engine(planned, teacher)
    with bar(f"teacher shard {record.shard}", n_seq) as b:
        try:
            rows = compute_shard_rows(split, record, teacher, teacher.rows_per_call, lambda n: b.advance(n))
        except ValueError as exc:  # e.g. logits not finite: the teacher's weights are at fault, not the shard
            raise ValueError(f"model.teacher: {cfg.model.teacher}: shard {record.shard}: {exc}") from None
    done = write_shard(
        out, record, rows, planned.vocab_size, planned.k_of(record.split), planned.format_of(record.split)
    )
    record_shard(out, done)
    log.info("shard %d: %d positions, %d sequences -> %s", record.shard, record.n_positions, n_seq, out / record.file)
    return done


def finish(cfg: RunConfig, planned: TeacherManifest, records: Sequence[ShardRecord]) -> TeacherManifest:
    """The plan with its shards' records: the stage's result."""
    manifest = planned.model_copy(update={"shards": tuple(records)})
    out = manifest.path_in(workdir(cfg))
    for split in ("train", "eval"):
        log.info(
            "teacher %s split (%s, k=%d): %d shards, %.1f bytes/position in %s",
            split,
            manifest.store_of(split),
            manifest.k_of(split),
            sum(r.split == split for r in records),
            bytes_per_position(manifest, out, split),
            out / MANIFEST_NAME,
        )
    return manifest


def run(cfg: RunConfig, tokens: TokenizeManifest, bar: BarFactory = no_bar) -> TeacherManifest:
    """plan, then every shard in order (complete ones kept), then finish. teacher.runner=ray computes the
    missing shards on Ray first (stages/teacher_ray.py); the loop then finds them complete."""
    planned = plan(cfg, tokens)
    if cfg.teacher.runner == "ray":
        from stages.teacher_ray import run_missing

        run_missing(cfg, tokens, planned, bar)
    try:
        records = [shard(cfg, tokens, planned, record, bar) for record in planned.shards]
    finally:
        release_teacher()
    return finish(cfg, planned, records)
