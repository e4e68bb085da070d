"""teacher_topk: the teacher's top-k next-token distributions as Parquet shards, one Prefect task per shard.

teacher-plan (cached) checks the vocabularies and plans the shards over both token splits; teacher-shard-i
(cached per shard, and re-run when its file is gone or fails verification) writes shard i atomically and
records it in the top-k manifest. A crash loses at most the shard being written; a rerun skips every shard
that verifies (data.topk: plan_all -> open_manifest -> missing_shards -> compute_shard_rows ->
write_shard -> record_shard). The top-k directory is addressed by the plan's cache key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from prefect import get_run_logger, task

from data.tokens import read_token_split
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
from schemas.manifests import ShardRecord, TeacherManifest, TokenizeManifest
from tasks import faults
from tasks.caching import (
    StageCache,
    as_config,
    file_sha256,
    located,
    relative,
    stage_dir,
    stage_options,
    workdir,
)
from tasks.progress import bar

TeacherFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _shard_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    """None when the shard file exists, its manifest row is complete and it verifies; else what is wrong."""
    out = located(cfg, inputs["plan"]["dir"])
    planned = TeacherManifest.model_validate(inputs["plan"]["manifest"])
    shard = ShardRecord.model_validate(inputs["shard"])
    try:
        current = read_manifest(out)
        row = next((s for s in current.shards if s.shard == shard.shard), None) if current else None
        if row is None:
            return f"{out / MANIFEST_NAME}: no row for shard {shard.shard}"
        verify_shard(out / row.file, row, planned.vocab_size, planned.k)
    except (ShardError, ValueError) as exc:
        return str(exc)
    return None


PLAN = StageCache(
    stage="teacher-plan",
    version="1",
    config_fields=("teacher.top_k", "teacher.temperature", "teacher.shard_tokens"),
    files=("model.teacher",),
    inputs=("tokens",),
)
SHARD = StageCache(stage="teacher-shard", version="1", inputs=("plan", "shard"), outputs_problem=_shard_problem)


@task(**stage_options(PLAN, task_run_name="teacher-plan"))
def plan_teacher(cfg: RunConfig, tokens: dict[str, Any]) -> dict[str, Any]:
    """Refuse a vocabulary mismatch, plan the shards, open the top-k manifest.

    Returns {"dir": <top-k dir>, "manifest": the planned TeacherManifest (every shard pending)}.
    """
    cfg = as_config(cfg)
    with GGUFFile(cfg.model.teacher) as t, GGUFFile(cfg.model.student) as s:
        teacher_tokens = list(t.metadata.get("tokenizer.ggml.tokens") or [])
        check_vocab(teacher_tokens, list(s.metadata.get("tokenizer.ggml.tokens") or []), t.path, s.path)
    token_dir = located(cfg, tokens["dir"])
    tok = TokenizeManifest.model_validate(tokens["manifest"])
    root = workdir(cfg)
    train = read_token_split(token_dir, "train", tok, root)
    held_out = read_token_split(token_dir, "eval", tok, root)
    planned = TeacherManifest(
        teacher_sha256=file_sha256(cfg.model.teacher, root),
        k=cfg.teacher.top_k,
        temperature=cfg.teacher.temperature,
        vocab_size=len(teacher_tokens),
        token_shards_hash=tok.shards_hash(),
        shards=tuple(plan_all(train, held_out, cfg.teacher.shard_tokens)),
    )
    out = stage_dir(cfg, "teacher", PLAN.key(cfg, {"tokens": tokens}))
    open_manifest(out, planned)
    get_run_logger().info("teacher top-k: %d shards planned in %s", len(planned.shards), out)
    return {
        "dir": relative(cfg, out),
        "token_dir": tokens["dir"],
        "manifest": planned.model_dump(mode="json"),
    }


# One teacher per process, kept across the shard tasks of a run (loading it is the expensive part).
_TEACHER: dict[tuple, TeacherFn] = {}


def _teacher_fn(cfg: RunConfig) -> TeacherFn:
    from training.teacher import make_teacher_fn

    path = Path(cfg.model.teacher).resolve()
    st = path.stat()
    key = (
        str(path),
        st.st_size,
        st.st_mtime_ns,
        cfg.teacher.top_k,
        cfg.teacher.temperature,
        cfg.teacher.backend,
    )
    if key not in _TEACHER:
        _TEACHER.clear()
        _TEACHER[key] = make_teacher_fn(cfg, path)
    return _TEACHER[key]


def release_teacher() -> None:
    """Drop the process's teacher (its weights) once the shards are done."""
    _TEACHER.clear()


@task(**stage_options(SHARD, task_run_name="teacher-shard-{shard[shard]}", retries=0))
def teacher_shard(cfg: RunConfig, plan: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """Compute, write and record one shard; a shard already complete and verified on disk is kept as is."""
    cfg = as_config(cfg)
    log = get_run_logger()
    out = located(cfg, plan["dir"])
    planned = TeacherManifest.model_validate(plan["manifest"])
    rec = ShardRecord.model_validate(shard)
    current = open_manifest(out, planned)
    row = next(s for s in current.shards if s.shard == rec.shard)
    if row.complete:
        try:
            verify_shard(out / row.file, row, planned.vocab_size, planned.k)
            log.info("shard %d already complete and verified: kept", rec.shard)
            return row.model_dump(mode="json")
        except ShardError as exc:
            log.warning("%s: recomputing", exc)
    split = read_token_split(located(cfg, plan["token_dir"]), rec.split)
    n_seq = rec.seq_end - rec.seq_start
    teacher = _teacher_fn(cfg)
    with bar(f"teacher shard {rec.shard}", n_seq) as b:

        def counted(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            result = teacher(ids)
            b.advance(1)
            return result

        rows = compute_shard_rows(split, rec, counted)
    done = write_shard(out, rec, rows, planned.vocab_size, planned.k)
    record_shard(out, done)
    log.info("shard %d: %d positions, %d sequences -> %s", rec.shard, rec.n_positions, n_seq, out / rec.file)
    faults.check("teacher.shard", rec.shard)
    return done.model_dump(mode="json")


def teacher_topk(cfg: RunConfig, tokens: dict[str, Any]) -> dict[str, Any]:
    """Plan, then one task per shard, in order; returns {"dir", "manifest": TeacherManifest}."""
    plan = plan_teacher(cfg, tokens)
    try:
        records = [teacher_shard(cfg, plan, s) for s in plan["manifest"]["shards"]]
    finally:
        release_teacher()
    manifest = TeacherManifest.model_validate({**plan["manifest"], "shards": records})
    out = located(cfg, plan["dir"])
    per_position = bytes_per_position(manifest, out)
    get_run_logger().info(
        "teacher top-k complete: %d shards, %.1f bytes/position (k=%d) in %s",
        len(records),
        per_position,
        manifest.k,
        out / MANIFEST_NAME,
    )
    return {
        "dir": plan["dir"],
        "manifest": manifest.model_dump(mode="json"),
        "bytes_per_position": per_position,
    }
