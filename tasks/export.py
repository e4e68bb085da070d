"""export task: stages.export (PEFT dir, GGUF LoRA, optional merged GGUF), rebuilt when its files are gone."""

from __future__ import annotations

from prefect import task

import stages.export
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, ExportManifest, StudentManifest
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs


@task(**stage_options(graph.EXPORT))
def export_adapter(cfg: RunConfig, student: StudentManifest, checkpoint: CheckpointManifest) -> ExportManifest:
    """The checkpoint's adapter as cfg.export asks: PEFT dir, GGUF LoRA, merged GGUF."""
    with prefect_logs():
        return stages.export.run(cfg, student, checkpoint)
