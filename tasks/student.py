"""student task: stages.student (requantize when asked, then upload to the GPU), cached by the file's bytes."""

from __future__ import annotations

from prefect import task

import stages.student
from schemas.config import RunConfig
from schemas.manifests import StudentManifest
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar


@task(**stage_options(graph.STUDENT))
def student(cfg: RunConfig) -> StudentManifest:
    """The student GGUF (requantized to model.student_quant when set), uploaded into this process's GPU."""
    with prefect_logs():
        return stages.student.run(cfg, bar)
