"""Serve the distill flow as a Prefect deployment: runs on a cron schedule and whenever someone starts one.

    infra/up.sh                                                  # Prefect UI :4200, MLflow UI :5000
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    distillery serve configs/example.yaml --cron "0 3 * * *" --name nightly

The process stays up until Ctrl-C (or SIGTERM). Each run, whether from the schedule, from
`prefect deployment run distill/nightly` or from the UI's run form (whose parameter schema is RunConfig, every
field with its description), executes in a subprocess that imports `flows.distill` and validates the
parameters against RunConfig. Runs cache their stages like the CLI does, under the served config's workdir
(<workdir>/.prefect/results), so an unchanged config reruns nothing; a run whose form changed a field
recomputes only the stages that read it. One run at a time (one GPU). For a work pool and a worker instead of
a serving process see infra/prefect.yaml.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class ServeError(ValueError):
    """`distillery serve` cannot start (no Prefect server, a bad schedule or stage); one line for the user."""


def deployment_parameters(cfg: Any, until: str) -> dict[str, Any]:
    """The deployment's default parameters: the whole config as JSON (the UI form is prefilled with it)."""
    return {"cfg": cfg.model_dump(mode="json"), "until": until}


def check_server(api_url: str | None) -> str:
    """PREFECT_API_URL, or a ServeError: a served deployment lives on a server that outlives this process."""
    if not api_url:
        raise ServeError(
            "distillery serve needs a Prefect server: start one with infra/up.sh, then "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    return api_url


def _prepared(config: Path | None, overrides: Sequence[str], cron: str | None, until: str) -> tuple[Any, Path, list]:
    """(config, its workdir's stage cache folder, the schedules) of a deployment, checked before any server call."""
    from schemas.config import load_config
    from stages.graph import PHASES
    from stages.inputs import check_inputs

    if until not in PHASES:
        raise ServeError(f"--until {until!r}: must be one of {', '.join(PHASES)}")
    cfg = load_config(config, list(overrides))
    check_inputs(cfg)
    results = Path(cfg.run.workdir).resolve() / ".prefect" / "results"
    results.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    import prefect.settings as ps
    from prefect.schedules import Cron

    check_server(ps.PREFECT_API_URL.value())
    if cron is None:
        return cfg, results, []
    try:
        return cfg, results, [Cron(cron)]
    except ValueError as exc:
        raise ServeError(f"--cron {cron!r}: not a cron expression ({exc})") from None


def deploy(
    config: Path | None,
    overrides: Sequence[str] = (),
    *,
    pool: str,
    name: str,
    cron: str | None = None,
    until: str = "export",
) -> str:
    """Register `distill` with CONFIG (+ overrides) as deployment distill/<name> on the process work pool `pool`,
    whose workers (infra/up.sh team mode, infra/worker.sh) run it from this checkout: every worker must see the
    checkout and the config's workdir at the same paths. Runs cache their stages under the workdir, like the CLI.
    Returns the deployment's id."""
    cfg, results, schedules = _prepared(config, overrides, cron, until)
    from flows.distill import distill

    root = Path(__file__).resolve().parents[1]
    source = "defaults" if config is None else str(config)
    remote = distill.from_source(source=str(root), entrypoint="flows/distill.py:distill")
    deployment_id = remote.deploy(
        name=name,
        work_pool_name=pool,
        parameters=deployment_parameters(cfg, until),
        schedules=schedules,
        description=f"distillery: {source} (workdir {cfg.run.workdir})",
        tags=["distillery"],
        job_variables={"env": {"PREFECT_LOCAL_STORAGE_PATH": str(results)}},
        build=False,
        push=False,
        print_next_steps=False,
        ignore_warnings=True,
    )
    return str(deployment_id)


def serve(
    config: Path | None,
    overrides: Sequence[str] = (),
    *,
    cron: str | None = None,
    name: str = "scheduled",
    until: str = "export",
) -> None:
    """Serve `distill` with CONFIG (+ overrides) as deployment distill/<name> until interrupted."""
    cfg, results, schedules = _prepared(config, overrides, cron, until)
    # Flow runs execute in subprocesses that import `distill` from flows/distill.py; the stage cache reaches
    # the workdir through the environment and settings they inherit (the runner exports the current settings).
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(results)
    import prefect.settings as ps

    from flows.distill import distill

    source = "defaults" if config is None else str(config)
    with ps.temporary_settings(updates={ps.PREFECT_LOCAL_STORAGE_PATH: results}):
        distill.serve(
            name=name,
            schedules=schedules,
            parameters=deployment_parameters(cfg, until),
            description=f"distillery: {source} (workdir {cfg.run.workdir})",
            tags=["distillery"],
            limit=1,  # one GPU: a second run waits for the first
        )
