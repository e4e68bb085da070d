"""export task: stages.export (PEFT dir, GGUF LoRA, optional merged GGUF), rebuilt when its files are gone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect import task

import stages.export
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, ExportManifest, StudentManifest
from tasks.caching import StageCache, missing, stage_options
from tasks.logs import prefect_logs


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    return missing(*stages.export.wanted(cfg, stages.export.output_dir(cfg, key)))


POLICY = StageCache(spec=stages.export.KEY, outputs_problem=_outputs_problem)


@task(**stage_options(POLICY, task_run_name="export"))
def export_adapter(cfg: RunConfig, student: StudentManifest, checkpoint: CheckpointManifest) -> ExportManifest:
    """The checkpoint's adapter as cfg.export asks: PEFT dir, GGUF LoRA, merged GGUF."""
    with prefect_logs():
        return stages.export.run(cfg, student, checkpoint)
