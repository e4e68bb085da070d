"""tokenize task: stages.tokenize, cached by the data's bytes and the fields it reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect import task

import stages.tokenize
from data.tokens import MANIFEST_NAME
from schemas.config import RunConfig
from schemas.manifests import TokenizeManifest
from stages.layout import stage_dir
from tasks.caching import StageCache, missing, stage_options
from tasks.logs import prefect_logs


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    return missing(stage_dir(cfg, stages.tokenize.FOLDER, key) / MANIFEST_NAME)


POLICY = StageCache(spec=stages.tokenize.KEY, outputs_problem=_outputs_problem)


@task(**stage_options(POLICY, task_run_name="tokenize"))
def tokenize(cfg: RunConfig) -> TokenizeManifest:
    """Tokenize cfg.data with the student's tokenizer into train/eval token shards."""
    with prefect_logs():
        return stages.tokenize.run(cfg)
