"""The distillation flow: tokenize -> student -> teacher top-k -> (prefix cache) -> train -> evaluate -> select ->
export.

The stages and their order are stages/graph.py's `distill`; here each node runs as its cached task (TASKS: one
task over each library stage, keyed by content, tasks/caching.py), so a rerun resumes where the last one stopped
and an identical rerun does no work. `run_pipeline` runs it with results stored under the workdir. No
`from __future__ import annotations` here: a served deployment resolves the `cfg: RunConfig` annotation at run
time to build its parameter schema.
"""

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.attempts import check_attempt
from schemas.config import RunConfig
from stages import graph
from stages.graph import Phase
from stages.inputs import check_inputs
from tasks.caching import as_config, in_workdir, run_graph, strict_results
from tasks.evaluate import evaluate_baseline, evaluate_checkpoint, evaluate_merged
from tasks.export import export_adapter
from tasks.prefix import prefix_cache
from tasks.student import student
from tasks.teacher import plan_teacher, teacher_on_ray, teacher_shard
from tasks.tokenize import tokenize
from tasks.tracking import mlflow_run
from tasks.train import train_epoch

# The task that runs each node of stages.graph.distill.
TASKS = {
    graph.TOKENIZE: tokenize,
    graph.STUDENT: student,
    graph.TEACHER_PLAN: plan_teacher,
    graph.TEACHER_RAY: teacher_on_ray,
    graph.TEACHER_SHARD: teacher_shard,
    graph.PREFIX: prefix_cache,
    graph.TRAIN: train_epoch,
    graph.BASELINE: evaluate_baseline,
    graph.EVALUATE: evaluate_checkpoint,
    graph.EXPORT: export_adapter,
    graph.MERGED: evaluate_merged,
}


# One worker: GPU work is one process, one device (tasks are called in order anyway).
@flow(
    name="distill",
    task_runner=ThreadPoolTaskRunner(max_workers=1),
    persist_result=False,
    result_serializer="json",
)
def distill(cfg: RunConfig, until: Phase = "export") -> dict[str, Any]:
    """Distil cfg.model.teacher into a LoRA adapter on the quantized cfg.model.student, up to `until`."""
    cfg = as_config(cfg)
    strict_results()  # cached stage results: JSON manifests only, never deserialized otherwise
    check_attempt()  # a crashed run scheduled again resumes; a fourth attempt fails
    if cfg.run.task == "dpo":  # a preference config (e.g. from a served deployment's form): its own flow
        from flows.preference import preference

        return preference(cfg, until)
    check_inputs(cfg)
    return run_graph(graph.distill, cfg, until, TASKS, mlflow_run(cfg, until))


def run_pipeline(cfg: RunConfig, until: Phase = "export") -> dict[str, Any]:
    """Run `distill` with Prefect results (the stage cache) stored under <workdir>/.prefect/results."""
    return in_workdir(distill, cfg, until)
