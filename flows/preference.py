"""The preference flow (run.task: dpo): pairs -> student -> reference log-probs -> DPO epochs -> evaluate ->
select -> export.

The same shape as flows/distill.py: the stages and their order are stages/graph.py's `preference`, each node run
as its cached task (TASKS), so a rerun resumes and an identical rerun does no work; MLflow records the run
(tasks/preference_tracking.py). `until` names a phase (stages.graph.PHASES): tokenize (pairs + student), teacher
(the reference log-probs), train, evaluate, export. No `from __future__ import annotations` here (a served
deployment resolves `cfg: RunConfig` at run time).
"""

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.attempts import check_attempt
from schemas.config import RunConfig
from stages import graph
from stages.graph import Phase
from stages.pairs import check_inputs
from tasks.caching import as_config, in_workdir, run_graph, strict_results
from tasks.export import export_adapter
from tasks.preference import dpo_epoch, evaluate, pairs, reference
from tasks.preference_tracking import preference_run
from tasks.student import student

# The task that runs each node of stages.graph.preference.
TASKS = {
    graph.PAIRS: pairs,
    graph.STUDENT: student,
    graph.REFERENCE: reference,
    graph.DPO_EPOCH: dpo_epoch,
    graph.PREFERENCE_EVALUATE: evaluate,
    graph.EXPORT: export_adapter,
}


@flow(
    name="preference", task_runner=ThreadPoolTaskRunner(max_workers=1), persist_result=False, result_serializer="json"
)
def preference(cfg: RunConfig, until: Phase = "export") -> dict[str, Any]:
    """Tune the student's LoRA adapter on preference pairs (DPO and variants), up to `until`."""
    cfg = as_config(cfg)
    strict_results()  # cached stage results: JSON manifests only, never deserialized otherwise
    check_attempt()  # a crashed run scheduled again resumes; a fourth attempt fails
    check_inputs(cfg)
    return run_graph(graph.preference, cfg, until, TASKS, preference_run(cfg))


def run_preference(cfg: RunConfig, until: Phase = "export") -> dict[str, Any]:
    """Run `preference` with Prefect results (the stage cache) stored under <workdir>/.prefect/results."""
    return in_workdir(preference, cfg, until)


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
