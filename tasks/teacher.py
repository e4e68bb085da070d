"""teacher: the teacher's top-k shards, one cached Prefect task per shard (stages.teacher does the work; the
order is stages.graph.teacher_topk's).

teacher-plan (cached) checks the vocabularies and plans the shards; teacher-shard-i (cached per shard, and
re-run when its file is gone or fails verification) writes shard i and records it. A crash loses at most the
shard being written; a rerun skips every shard that verifies.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

import stages.teacher
from schemas.config import RunConfig
from schemas.manifests import ShardRecord, TeacherManifest, TokenizeManifest
from stages import graph
from tasks import faults
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar


@task(**stage_options(graph.TEACHER_PLAN))
def plan_teacher(cfg: RunConfig, tokens: TokenizeManifest) -> TeacherManifest:
    """Refuse a vocabulary mismatch, plan the shards, open the top-k manifest (every shard pending)."""
    with prefect_logs():
        return stages.teacher.plan(cfg, tokens)


@task(**stage_options(graph.TEACHER_SHARD, retries=0))
def teacher_shard(cfg: RunConfig, tokens: TokenizeManifest, plan: TeacherManifest, shard: ShardRecord) -> ShardRecord:
    """Compute, write and record one shard (kept as is when already complete and verified)."""
    with prefect_logs():
        done = stages.teacher.shard(cfg, tokens, plan, shard, bar)
    faults.check("teacher.shard", shard.shard)
    return done


@task(
    name=graph.TEACHER_RAY.stage,
    task_run_name=graph.TEACHER_RAY.run_name,
    persist_result=False,
    cache_policy=NO_CACHE,
    retries=0,
)
def teacher_on_ray(cfg: RunConfig, tokens: TokenizeManifest, plan: TeacherManifest) -> None:
    """teacher.runner=ray: the shards not complete as Ray tasks (stages/teacher_ray.py; Ray retries a killed
    worker's shard), recorded in the top-k manifest by this process."""
    from stages.teacher_ray import run_missing

    with prefect_logs():
        run_missing(cfg, tokens, plan, bar)
