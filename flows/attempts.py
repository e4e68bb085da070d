"""How many times a flow run may start: a deployment's run that crashed (its worker died) is scheduled again by
the team set-up's automation (infra/automations.py) and resumes from the stage cache; a run that crashes on every
attempt must end instead of looping."""

from __future__ import annotations

MAX_ATTEMPTS = 3


class TooManyAttempts(RuntimeError):
    """The flow run has started more than MAX_ATTEMPTS times."""


def check_attempt() -> None:
    """Raise TooManyAttempts (one line) when the current flow run starts for the (MAX_ATTEMPTS + 1)-th time."""
    from prefect.runtime import flow_run

    n = int(flow_run.run_count or 1)
    if n > MAX_ATTEMPTS:
        raise TooManyAttempts(
            f"flow run {flow_run.name}: attempt {n}, more than {MAX_ATTEMPTS}: the earlier ones crashed (their "
            "workers stopped); see their logs"
        )
