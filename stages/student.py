"""student: the student GGUF as given, or requantized to model.student_quant into the workdir; then loaded.

GPU memory does not outlive a process, so the stage's output is the file on disk. The stage also loads it once
where the engine reads it (training.engines' process-wide loaders, which train/evaluate then reuse in this
process: streamed into GPU memory, or dequantized to float32 for the numpy engine) so an unsupported tensor
type fails here, and logs the load: seconds, GiB/s, host peak RSS.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from model.convert import requantize_gguf
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import FileRef, StudentManifest, stored_path
from stages.keys import StageKey, file_sha256
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar

log = logging.getLogger(__name__)

FOLDER = "student"
STUDENT_FILE = "student.gguf"
KEY = StageKey(stage="student", version="1", config_fields=("model.student_quant",), files=("model.student",))


def student_file(cfg: RunConfig, key: str) -> Path:
    """Where the student GGUF of this config is: model.student as given, or its requantized copy."""
    if cfg.model.student_quant is None:
        return Path(cfg.model.student).expanduser().resolve()
    return stage_dir(cfg, FOLDER, key) / STUDENT_FILE


def prepare(cfg: RunConfig) -> StudentManifest:
    """Requantize model.student when model.student_quant asks; describe the GGUF the student loads from."""
    root = workdir(cfg)
    source = Path(cfg.model.student).expanduser().resolve()
    path = student_file(cfg, KEY.key(cfg, {}))
    quant = cfg.model.student_quant
    if quant is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        chosen = requantize_gguf(source, path, Q[quant[0]], Q[quant[-1]])
        log.info("requantized %s -> %s: %s", source.name, path, dict(Counter(chosen.values())))
    with GGUFFile(path) as f:
        tensor_types = dict(Counter(info.type_name for info in f.tensors.values()))
    return StudentManifest(
        source_sha256=file_sha256(source, root),
        file=FileRef(path=stored_path(path, root), sha256=file_sha256(path, root), bytes=path.stat().st_size),
        requantized=quant is not None,
        tensor_types=tensor_types,
    )


def upload(cfg: RunConfig, student: StudentManifest, bar: BarFactory = no_bar) -> dict[str, float]:
    """Load the student where the run's engine reads it, once per process: streamed into GPU memory, or
    dequantized to float32 in host memory for the numpy engine (train.backend); returns the load stats."""
    from training.engines import preload_student, upload_stats

    path = student.path_in(workdir(cfg))
    with GGUFFile(path) as f:
        n_tensors = len(f.tensors)
    with bar("upload student", n_tensors) as b:
        preload_student(cfg, path, progress=lambda info: b.advance(1, tensor=info.name))
    stats = upload_stats()
    log.info(
        "student loaded: %.2f GiB in %.2f s (%.2f GiB/s), host peak RSS %.0f MiB",
        stats.get("bytes", 0) / 2**30,
        stats.get("seconds", 0),
        stats.get("gib_per_s", 0),
        stats.get("host_peak_rss_mib", 0),
    )
    return stats


def run(cfg: RunConfig, bar: BarFactory = no_bar) -> StudentManifest:
    """prepare + upload: the student's GGUF on disk and in this process's GPU memory."""
    student = prepare(cfg)
    upload(cfg, student, bar)
    return student
