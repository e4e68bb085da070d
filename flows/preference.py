"""The preference flow (run.task: dpo): pairs -> student -> reference log-probs -> DPO epochs -> evaluate ->
select -> export.

The same shape as flows/distill.py: every stage a cached task over a library stage, so a rerun resumes and an
identical rerun does no work; MLflow records the run (tasks/preference_tracking.py). `until` maps the CLI's
stage names: tokenize (pairs + student), teacher (the reference log-probs), train, evaluate, export. No
`from __future__ import annotations` here (a served deployment resolves `cfg: RunConfig` at run time).
"""

from typing import Any, Literal

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.attempts import check_attempt
from schemas.config import RunConfig
from stages.layout import workdir
from stages.pairs import check_inputs
from stages.preference_evaluate import select_best
from tasks.caching import as_config, strict_results
from tasks.export import export_adapter
from tasks.preference import dpo_epoch, evaluate, pairs, reference
from tasks.preference_tracking import preference_run
from tasks.student import student

STAGES = ("tokenize", "teacher", "train", "evaluate", "export")
Stage = Literal["tokenize", "teacher", "train", "evaluate", "export"]


@flow(
    name="preference", task_runner=ThreadPoolTaskRunner(max_workers=1), persist_result=False, result_serializer="json"
)
def preference(cfg: RunConfig, until: Stage = "export") -> dict[str, Any]:
    """Tune the student's LoRA adapter on preference pairs (DPO and variants), up to `until`."""
    cfg = as_config(cfg)
    strict_results()  # cached stage results: JSON manifests only, never deserialized otherwise
    check_attempt()  # a crashed run scheduled again resumes; a fourth attempt fails
    check_inputs(cfg)

    def reaches(stage: Stage) -> bool:
        return STAGES.index(stage) <= STAGES.index(until)

    with preference_run(cfg) as r:
        r.pairs, r.student = pairs(cfg), student(cfg)
        if reaches("teacher") and not cfg.preference.reference_free:
            r.reference = reference(cfg, r.student, r.pairs)
        if reaches("train"):
            r.checkpoints = [
                dpo_epoch(cfg, r.student, r.pairs, r.reference, epoch, r.id) for epoch in range(cfg.train.epochs)
            ]
        if reaches("evaluate"):
            r.baseline = evaluate(cfg, r.student, r.pairs, r.reference, None, "baseline")
            r.evals = [evaluate(cfg, r.student, r.pairs, r.reference, c, f"epoch-{c.epoch}") for c in r.checkpoints]
            r.best = select_best(r.evals)
        if reaches("export"):
            r.exported = export_adapter(cfg, r.student, r.checkpoints[r.best])
        return r.finish()


def run_preference(cfg: RunConfig, until: Stage = "export") -> dict[str, Any]:
    """Run `preference` with Prefect results (the stage cache) stored under <workdir>/.prefect/results."""
    storage = workdir(cfg) / ".prefect" / "results"
    storage.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"result_storage": storage}
    if cfg.run.run_name:
        options["flow_run_name"] = cfg.run.run_name
    return preference.with_options(**options)(cfg, until)


def print_table(summary: dict[str, Any], console: Any) -> None:
    """The held-out table of a preference run on the CLI's console."""
    from rich.table import Table

    from tasks.preference_tracking import table_rows

    rows = [(label, ev) for label, ev in table_rows(summary) if ev is not None]
    if not rows:  # a run stopped before evaluation
        return
    table = Table(title="held-out preference pairs")
    for col in ("student", "loss", "reward accuracy", "margin", "KL(π‖π_ref)"):
        table.add_column(col, justify="left" if col == "student" else "right")
    for label, ev in rows:
        if ev is not None:
            table.add_row(
                label, f"{ev['loss']:.4f}", f"{100 * ev['reward_accuracy']:.1f}%", f"{ev['margin']:.4f}",
                f"{ev['kl_reference']:.5f}",
            )  # fmt: skip
    console.print(table)
