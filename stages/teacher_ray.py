"""teacher on Ray (teacher.runner: ray): the planned shards not yet complete run as Ray tasks; the driver records.

Each missing shard is one Ray task (one GPU where the cluster has GPUs and teacher.backend may use one, else one
CPU) that computes the shard's rows with the worker process's teacher (training.teacher.teacher_fn: loaded once per
worker process and kept across its shards) and writes the Parquet file through a pyarrow filesystem
(write_shard_uri: a plain path or file:// URL, or an object store URL resolved by pyarrow.fs.FileSystem.from_uri)
with the same writer options as the local runner, so the bytes are the same. Each split is written as the local
runner writes it (the manifest's store_of / k_of): with teacher.store sampled the train split's shards are the
sampled store's (the worker's teacher draws with model/sampled.py's counter-based generator, keyed by seed, sequence
and position, so which worker computes a shard, and in what order, does not change a draw; SAMPLED_OPTIONS) and
the eval split's are top-k (SHARD_OPTIONS), the same bytes and manifest as the local runner's. The task returns the
shard's record (sha256, complete); the driver re-verifies the file (against its split's schema) and records it in
the top-k manifest: the driver is the only manifest writer (no lock shared across machines) and the manifest stays
the single record of what is complete.
Shards already complete and verified are never resubmitted. A worker that dies (a killed process, a lost node) is
retried by Ray (MAX_RETRIES system-failure retries); an error raised by the computation itself (e.g. a teacher
with non-finite logits) is not retried and fails the stage after the shards already recorded.

Why Ray tasks inside one Prefect task rather than prefect-ray's RayTaskRunner: a task runner is a property of the
whole flow, so RayTaskRunner would ship tokenize, train, evaluate and export to Ray too (or need a subflow per
stage); a Prefect task run on a Ray worker reports its state to the Prefect API and reads the stage cache
(tasks/caching.py: result records under the workdir) from there, so every node would need the API and the result
storage; and Ray's own task retries are what reruns a killed worker's shard. Here only the shard computation
crosses to the cluster: the workers need the workdir's files and distillery, not Prefect. The per-shard Prefect
tasks still run afterwards on the driver (tasks/teacher.py) and find every shard complete, so the stage's cached
records, resume and the fully cached rerun are the same for both runners.

Fault point for tests: DISTILLERY_RAY_FAULT=shard=<i> makes the task of shard i end its worker process
(os._exit) on its first attempt, as a killed worker would; Ray's retry then computes it.

BLAS threads: the numpy teacher's float32 GEMMs round differently with another OpenBLAS thread count, and Ray starts
a worker of one CPU with OMP_NUM_THREADS=1; numpy teacher tasks therefore run with the driver's BLAS thread count
(blas_threads), which is what keeps their shards byte-identical to the local runner's (measured: with 1 thread
instead of 2, 14 of the tiny model's 16 shards differ in their float16 logprobs).
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from data.tokens import read_token_table
from data.topk import (
    SAMPLED_OPTIONS,
    SHARD_OPTIONS,
    ShardError,
    TopkRows,
    compute_shard_rows,
    missing_shards,
    open_manifest,
    read_manifest,
    record_shard,
    shard_table,
)
from schemas.config import RunConfig
from schemas.files import SchemaError, shard_schema, validate_table
from schemas.manifests import ShardRecord, TeacherManifest, TokenizeManifest
from stages.layout import workdir
from stages.progress import BarFactory, no_bar
from training.cluster import absolute_config, connect, resources

log = logging.getLogger(__name__)

MAX_RETRIES = 3  # system-failure retries of one shard task (its worker died); errors it raises are not retried
FAULT_ENV = "DISTILLERY_RAY_FAULT"


# ---------------------------------------------------------------------------------------------- writing


def _filesystem(out_uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(out_uri)
    except (pa.ArrowException, ValueError) as exc:
        raise ShardError(f"{out_uri}: not a filesystem path or URL pyarrow can open ({exc})") from None


def write_shard_uri(out_uri: str, plan: ShardRecord, rows: TopkRows, vocab_size: int, k: int) -> ShardRecord:
    """Write planned shard `plan` under `out_uri` (an absolute path, file://, s3://, ... URL) with the local
    writer's options (data.topk.write_shard's: SHARD_OPTIONS for top-k rows, SAMPLED_OPTIONS for sampled rows,
    whose counts are given, k = samples; the same rows give the same bytes); return its complete record.
    On a local filesystem through a temp name and a rename; on an object store in one PUT (atomic there)."""
    fs, base = _filesystem(out_uri)
    base = base.rstrip("/")
    path = f"{base}/{plan.file}"
    table = shard_table(plan, rows, vocab_size, k, f"{out_uri.rstrip('/')}/{plan.file}")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **(SHARD_OPTIONS if rows.counts is None else SAMPLED_OPTIONS))
    data = sink.getvalue()
    if fs.type_name == "local":
        fs.create_dir(base, recursive=True)
        for info in fs.get_file_info(pafs.FileSelector(base)):  # left by a killed attempt at this shard
            if info.base_name.startswith(f".{plan.file}.tmp-"):
                fs.delete_file(info.path)
        tmp = f"{base}/.{plan.file}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with fs.open_output_stream(tmp) as fh:
            fh.write(data)
        fs.move(tmp, path)
    else:
        with fs.open_output_stream(path) as fh:
            fh.write(data)
    return plan.model_copy(update={"sha256": hashlib.sha256(data).hexdigest(), "complete": True})


def verify_shard_uri(out_uri: str, record: ShardRecord, vocab_size: int, k: int, store: str = "topk") -> None:
    """Raise ShardError unless the file of `record` under `out_uri` has its sha256, schema (of teacher store
    `store`) and row count."""
    fs, base = _filesystem(out_uri)
    where = f"{out_uri.rstrip('/')}/{record.file}"
    try:
        with fs.open_input_file(f"{base.rstrip('/')}/{record.file}") as fh:
            data = fh.read()
    except (pa.ArrowException, OSError) as exc:
        raise ShardError(f"missing shard {where}: {exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise ShardError(f"corrupt shard {where}: sha256 {digest}, the worker reported {record.sha256}")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        validate_table(pf.schema_arrow, shard_schema(store, vocab_size, k), where)
    except (pa.ArrowException, OSError, SchemaError) as exc:
        raise ShardError(f"corrupt shard {where}: {exc}") from None
    if pf.metadata.num_rows != record.n_positions:
        raise ShardError(f"corrupt shard {where}: {pf.metadata.num_rows} rows, the plan counts {record.n_positions}")


# ---------------------------------------------------------------------------------------------- the Ray task


def _injected_fault(fault: str | None, shard: int, out_uri: str) -> None:
    """DISTILLERY_RAY_FAULT=shard=<i>: end this worker process on the first attempt at shard i (the marker file
    .ray-fault-shard-<i> in the top-k folder remembers the attempt: later attempts and runs pass)."""
    if fault != f"shard={shard}":
        return
    fs, base = _filesystem(out_uri)
    marker = f"{base.rstrip('/')}/.ray-fault-shard-{shard}"
    if fs.get_file_info(marker).type == pafs.FileType.NotFound:
        with fs.open_output_stream(marker) as fh:
            fh.write(b"first attempt killed\n")
        os._exit(1)


def compute_shard(
    cfg_json: str, tokens_json: str, plan_json: str, record_json: str, out_uri: str, fault: str | None
) -> str:
    """The body of one shard's Ray task: rows of shard `record` by the worker's teacher of its split's store
    (planned.store_of), written under out_uri. Arguments and result travel as JSON (the manifests' own format);
    returns the complete record as JSON."""
    from stages.teacher import check_engine
    from training.cluster import pin_assigned_gpu
    from training.teacher import teacher_fn

    pin_assigned_gpu()
    cfg = RunConfig.model_validate_json(cfg_json)
    tokens = TokenizeManifest.model_validate_json(tokens_json)
    planned = TeacherManifest.model_validate_json(plan_json)
    record = ShardRecord.model_validate_json(record_json)
    _injected_fault(fault, record.shard, out_uri)
    split = read_token_table(tokens.path_in(workdir(cfg)), record.split)
    teacher = teacher_fn(cfg, planned.store_of(record.split))
    check_engine(planned, teacher)  # a worker whose teacher resolves otherwise than the driver's plan
    try:
        rows = compute_shard_rows(split, record, teacher, teacher.rows_per_call)
    except ValueError as exc:  # e.g. logits not finite: the teacher's weights are at fault, not the shard
        raise ValueError(f"model.teacher: {cfg.model.teacher}: shard {record.shard}: {exc}") from None
    done = write_shard_uri(out_uri, record, rows, planned.vocab_size, planned.k_of(record.split))
    log.info(
        "shard %d: %d positions -> %s/%s (ray worker pid %d)",
        done.shard,
        done.n_positions,
        out_uri,
        done.file,
        os.getpid(),
    )
    return done.model_dump_json()


# ---------------------------------------------------------------------------------------------- the driver


@contextmanager
def _cancel_on_exit(ray: Any, refs: list[Any]) -> Iterator[None]:
    """Cancel the shard tasks still running when the driver stops early (an error, Ctrl-C)."""
    try:
        yield
    except BaseException:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise


def _unwrap(ray: Any, exc: Exception, record: ShardRecord) -> Exception:
    """The error a failed shard task raised, or a ShardError saying its worker died (or its node was lost) more
    often than Ray retries."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        return exc.cause if isinstance(exc.cause, Exception) else RuntimeError(str(exc))
    return ShardError(
        f"teacher shard {record.shard} ({record.file}): its Ray worker died {MAX_RETRIES + 1} times ({exc})"
    )


def run_missing(
    cfg: RunConfig, tokens: TokenizeManifest, planned: TeacherManifest, bar: BarFactory = no_bar
) -> list[ShardRecord]:
    """Compute every shard of `planned` that is not complete and verified as Ray tasks, recording each in the
    top-k manifest as it lands (in completion order); return the manifest's records in shard order. Connects to
    Ray only when a shard is missing."""
    out = planned.path_in(workdir(cfg))
    todo = missing_shards(open_manifest(out, planned), out)
    if todo:
        _run_on_ray(cfg, tokens, planned, todo, Path(out).resolve().as_uri(), bar)
    current = read_manifest(out)
    assert current is not None  # opened above
    return list(current.shards)


def blas_threads() -> int:
    """This process's BLAS thread count (threadpoolctl where installed, else OPENBLAS/OMP_NUM_THREADS, else the
    CPU count, OpenBLAS's default)."""
    try:
        from threadpoolctl import threadpool_info

        counts = [int(i["num_threads"]) for i in threadpool_info() if i.get("user_api") == "blas"]
        if counts:
            return counts[0]
    except ImportError:
        pass
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return os.cpu_count() or 1


def _run_on_ray(
    cfg: RunConfig,
    tokens: TokenizeManifest,
    planned: TeacherManifest,
    todo: list[ShardRecord],
    out_uri: str,
    bar: BarFactory,
) -> None:
    ray = connect(cfg)
    options: dict[str, Any] = resources(cfg.teacher.backend, "teacher.backend", cfg.scale.gpus_per_worker)
    if "num_gpus" not in options:  # the numpy teacher: the driver's BLAS threads give the local runner's bytes
        n = str(blas_threads())
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}}
    task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False, **options)(compute_shard)
    args = (absolute_config(cfg).model_dump_json(), tokens.model_dump_json(), planned.model_dump_json())
    fault = os.environ.get(FAULT_ENV)
    refs = {task.remote(*args, rec.model_dump_json(), out_uri, fault): rec for rec in todo}
    log.info("teacher top-k: %d of %d shards as Ray tasks (%s each)", len(todo), len(planned.shards), options)
    out = planned.path_in(workdir(cfg))
    pending = list(refs)
    with bar("teacher shards (ray)", len(todo)) as b, _cancel_on_exit(ray, pending):
        while pending:
            ready, pending[:] = ray.wait(pending, num_returns=1)
            for ref in ready:
                record = refs[ref]
                try:
                    done = ShardRecord.model_validate_json(ray.get(ref))
                except ray.exceptions.RayError as exc:
                    raise _unwrap(ray, exc, record) from None
                k, store = planned.k_of(done.split), planned.store_of(done.split)
                verify_shard_uri(out_uri, done, planned.vocab_size, k, store)
                record_shard(out, done)
                b.advance(1)
