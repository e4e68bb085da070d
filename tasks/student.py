"""load_student: the student GGUF as given, or requantized to model.student_quant into the workdir.

GPU memory does not outlive a process, so the cached output is the file on disk. The task also streams it
into GPU memory once (training.engines' process-wide loader, which train/evaluate then reuse in this process) so an
unsupported tensor type fails here, and logs the upload: seconds, GiB/s, host peak RSS.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as Q
from prefect import get_run_logger, task

from model.convert import requantize_gguf
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import FileRef, StudentManifest
from tasks.caching import (
    StageCache,
    as_config,
    file_sha256,
    located,
    missing,
    relative,
    stage_dir,
    stage_options,
    workdir,
)
from tasks.progress import bar


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    if cfg.model.student_quant is None:
        return missing(Path(cfg.model.student))
    return missing(stage_dir(cfg, "student", key) / STUDENT_FILE)


STUDENT_FILE = "student.gguf"
POLICY = StageCache(
    stage="student",
    version="1",
    config_fields=("model.student_quant",),
    files=("model.student",),
    outputs_problem=_outputs_problem,
)


def _tensor_types(path: Path) -> dict[str, int]:
    with GGUFFile(path) as f:
        return dict(Counter(info.type_name for info in f.tensors.values()))


def upload(cfg: RunConfig, path: Path) -> dict[str, float]:
    """Stream the GGUF into GPU memory (once per process) with a progress bar; returns the upload stats."""
    from training.engines import load_student, upload_stats

    with GGUFFile(path) as f:
        n_tensors = len(f.tensors)
    with bar("upload student", n_tensors) as b:
        load_student(path, cfg.run.gpu_backend, progress=lambda info: b.advance(1, tensor=info.name))
    return upload_stats()


@task(**stage_options(POLICY, task_run_name="student"))
def load_student(cfg: RunConfig) -> dict[str, Any]:
    """Returns {"path": <student GGUF>, "manifest": StudentManifest as JSON, "upload": stats}."""
    cfg = as_config(cfg)
    log = get_run_logger()
    root = workdir(cfg)
    source = Path(cfg.model.student).expanduser().resolve()
    quant = cfg.model.student_quant
    if quant is None:
        path = source
    else:
        path = stage_dir(cfg, "student", POLICY.key(cfg, {})) / STUDENT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        preferred, fallback = Q[quant[0]], Q[quant[-1]]
        chosen = requantize_gguf(source, path, preferred, fallback)
        log.info("requantized %s -> %s: %s", source.name, path, dict(Counter(chosen.values())))
    ref = FileRef(path=str(path), sha256=file_sha256(path, root), bytes=path.stat().st_size)
    manifest = StudentManifest(
        source_sha256=file_sha256(source, root),
        file=ref,
        requantized=quant is not None,
        tensor_types=_tensor_types(path),
    )
    stats = upload(cfg, path)
    log.info(
        "student uploaded: %.2f GiB in %.2f s (%.2f GiB/s), host peak RSS %.0f MiB",
        stats.get("bytes", 0) / 2**30,
        stats.get("seconds", 0),
        stats.get("gib_per_s", 0),
        stats.get("host_peak_rss_mib", 0),
    )
    return {"path": relative(cfg, path), "manifest": manifest.model_dump(mode="json"), "upload": stats}


def student_path(cfg: RunConfig, student: dict[str, Any]) -> Path:
    """The student GGUF a load_student result names."""
    return located(cfg, student["path"])
