"""tokenize task: stages.tokenize, cached by the data's bytes and the fields it reads."""

from __future__ import annotations

from prefect import task

import stages.tokenize
from schemas.config import RunConfig
from schemas.manifests import TokenizeManifest
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs


@task(**stage_options(graph.TOKENIZE))
def tokenize(cfg: RunConfig) -> TokenizeManifest:
    """Tokenize cfg.data with the student's tokenizer into train/eval token shards."""
    with prefect_logs():
        return stages.tokenize.run(cfg)
