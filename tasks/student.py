"""student task: stages.student (requantize when asked, then upload to the GPU), cached by the file's bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect import task

import stages.student
from schemas.config import RunConfig
from schemas.manifests import StudentManifest
from tasks.caching import StageCache, missing, stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    return missing(stages.student.student_file(cfg, key))


POLICY = StageCache(spec=stages.student.KEY, outputs_problem=_outputs_problem)


@task(**stage_options(POLICY, task_run_name="student"))
def student(cfg: RunConfig) -> StudentManifest:
    """The student GGUF (requantized to model.student_quant when set), uploaded into this process's GPU."""
    with prefect_logs():
        return stages.student.run(cfg, bar)
