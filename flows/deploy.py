"""Serve the distill flow as a Prefect deployment on a cron schedule (and on demand).

    infra/prefect-server.sh &                                   # a Prefect server, UI at :4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    .venv/bin/python -m flows.deploy configs/example.yaml --cron "0 3 * * *" --name nightly

The process stays up: it runs the flow at each cron tick with the config as its parameters, and whenever a run
is started by hand (`prefect deployment run distill/nightly`, or the UI's run form, whose parameter schema is
RunConfig with every field's description). Stop it with Ctrl-C. Runs cache their stages like the CLI does,
under the served config's workdir (<workdir>/.prefect/results): an unchanged config reruns nothing, a config
whose data or models changed recomputes what depends on them. For a work pool instead of a serving process
see infra/prefect.yaml.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.distill import STAGES, distill
from schemas.config import load_config


def serve(
    config: Annotated[Path, typer.Argument(help="Run config (YAML/JSON) the scheduled runs use.")],
    cron: Annotated[str, typer.Option(help="Cron schedule, e.g. '0 3 * * *' (03:00 daily).")] = "0 3 * * *",
    name: Annotated[str, typer.Option(help="Deployment name (runs show as distill/<name>).")] = "scheduled",
    until: Annotated[str, typer.Option(help=f"Last stage to run: {', '.join(STAGES)}.")] = "export",
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Config override key=value.")] = None,
) -> None:
    """Serve `distill` with CONFIG on a cron schedule until interrupted."""
    if until not in STAGES:
        raise typer.BadParameter(f"--until must be one of {', '.join(STAGES)}")
    cfg = load_config(config, list(set_ or []))
    results = Path(cfg.run.workdir).resolve() / ".prefect" / "results"
    results.mkdir(parents=True, exist_ok=True)
    # Flow runs execute in subprocesses that load `distill` from its module: results reach the workdir
    # through the environment they inherit.
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(results)
    distill.serve(
        name=name,
        cron=cron,
        parameters={"cfg": cfg.model_dump(mode="json"), "until": until},
        description=f"distillery: {config} (workdir {cfg.run.workdir})",
        tags=["distillery"],
    )


if __name__ == "__main__":
    typer.run(serve)
