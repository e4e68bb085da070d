"""prefix task: the frozen-prefix activation cache (stages.prefix), cached by its content key.

Run before training when lora.layers leaves out block 0 (train.prefix_cache auto); train and evaluate then find
the cache by the same key and start their forward at the lowest adapted block.
"""

from __future__ import annotations

from prefect import task

import stages.prefix
from schemas.config import RunConfig
from schemas.manifests import PrefixManifest, StudentManifest, TokenizeManifest
from stages import graph
from tasks.caching import stage_options
from tasks.logs import prefect_logs
from tasks.progress import bar


@task(**stage_options(graph.PREFIX))
def prefix_cache(cfg: RunConfig, student: StudentManifest, tokens: TokenizeManifest, layer: int) -> PrefixManifest:
    """The input of block `layer` (stages.prefix.layer(cfg)) for every sequence of both splits, float16."""
    with prefect_logs():
        manifest = stages.prefix.run(cfg, student, tokens, bar)
    if manifest is None or manifest.layer != layer:
        raise ValueError(f"prefix cache: block {layer} asked, the config gives {stages.prefix.layer(cfg)}")
    return manifest
