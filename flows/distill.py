"""The distillation flow: tokenize -> student -> teacher top-k -> (prefix cache) -> train -> evaluate -> select ->
export.

Every stage is a cached task over a library stage (stages/: plain functions returning typed manifests;
tasks/caching.py: content-hash keys), so a rerun resumes where the last one stopped and an identical rerun does
no work. `run_pipeline` runs it with results stored under the workdir. No `from __future__ import annotations`
here: a served deployment resolves the `cfg: RunConfig` annotation at run time to build its parameter schema.
"""

from typing import Any, Literal

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

import stages.prefix
from flows.attempts import check_attempt
from schemas.config import RunConfig
from stages.evaluate import select_best
from stages.inputs import check_inputs
from stages.layout import workdir
from tasks.caching import as_config, strict_results
from tasks.evaluate import evaluate_baseline, evaluate_checkpoint, evaluate_merged
from tasks.export import export_adapter
from tasks.prefix import prefix_cache
from tasks.student import student
from tasks.teacher import teacher
from tasks.tokenize import tokenize
from tasks.tracking import mlflow_run
from tasks.train import train_epoch

STAGES = ("tokenize", "teacher", "train", "evaluate", "export")
Stage = Literal["tokenize", "teacher", "train", "evaluate", "export"]


# One worker: GPU work is one process, one device (tasks are called in order anyway).
@flow(
    name="distill",
    task_runner=ThreadPoolTaskRunner(max_workers=1),
    persist_result=False,
    result_serializer="json",
)
def distill(cfg: RunConfig, until: Stage = "export") -> dict[str, Any]:
    """Distil cfg.model.teacher into a LoRA adapter on the quantized cfg.model.student, up to `until`."""
    cfg = as_config(cfg)
    strict_results()  # cached stage results: JSON manifests only, never deserialized otherwise
    check_attempt()  # a crashed run scheduled again resumes; a fourth attempt fails
    if cfg.run.task == "dpo":  # a preference config (e.g. from a served deployment's form): its own flow
        from flows.preference import preference

        return preference(cfg, until)
    check_inputs(cfg)

    def reaches(stage: Stage) -> bool:
        return STAGES.index(stage) <= STAGES.index(until)

    with mlflow_run(cfg, until) as r:
        r.tokens, r.student = tokenize(cfg), student(cfg)
        if reaches("teacher"):
            r.teacher = teacher(cfg, r.tokens)
        if reaches("train") and stages.prefix.layer(cfg):
            prefix_cache(cfg, r.student, r.tokens, stages.prefix.layer(cfg))  # train/evaluate find it by its key
        if reaches("train"):
            r.checkpoints = [
                train_epoch(cfg, r.student, r.tokens, r.teacher, epoch, r.id) for epoch in range(cfg.train.epochs)
            ]
        if reaches("evaluate"):
            r.baseline = evaluate_baseline(cfg, r.student, r.tokens, r.teacher)
            r.evals = [evaluate_checkpoint(cfg, r.student, r.tokens, r.teacher, c) for c in r.checkpoints]
            r.best = select_best(cfg, r.evals)
        if reaches("export"):
            r.exported = export_adapter(cfg, r.student, r.checkpoints[r.best])
            if r.exported.merged is not None:
                r.merged = evaluate_merged(cfg, r.exported.merged, r.tokens, r.teacher)
        return r.finish()


def run_pipeline(cfg: RunConfig, until: Stage = "export") -> dict[str, Any]:
    """Run `distill` with Prefect results (the stage cache) stored under <workdir>/.prefect/results."""
    storage = workdir(cfg) / ".prefect" / "results"
    storage.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"result_storage": storage}
    if cfg.run.run_name:
        options["flow_run_name"] = cfg.run.run_name
    return distill.with_options(**options)(cfg, until)
