"""The team set-up's automations on the Prefect server (PREFECT_API_URL), created or updated by name; infra/up.sh
in team mode runs this once the server answers.

- "distillery: crash unresponsive runs": a flow run of a deployment whose heartbeat (one every
  PREFECT_FLOWS_HEARTBEAT_FREQUENCY = 30 s, infra/worker.sh) has not come for DISTILLERY_HEARTBEAT_GRACE_S (90 s),
  and which has not finished, is marked Crashed: its worker or machine died (Prefect's documented zombie-run
  detection; a run that finished is left alone: a terminal state is not changed).
- "distillery: retry crashed runs": a Crashed flow run of a deployment is set back to Scheduled, so any worker of
  the pool takes it up again; the flow resumes from the stage cache (cached stages are skipped, training continues
  from its last checkpoint) and keeps its MLflow run. The distill flow refuses to start a fourth attempt
  (flows/attempts.py), so a run that crashes every time ends Failed instead of looping.
"""

from __future__ import annotations

import os
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

FLOW_RUNS = ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"})
OF_A_DEPLOYMENT = ResourceSpecification({"prefect.resource.role": "deployment"})
FINISHED = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}


def heartbeat_grace() -> timedelta:
    """How long after a heartbeat the next one must have come: DISTILLERY_HEARTBEAT_GRACE_S, default 3 heartbeat
    periods (a busy machine can delay one; a run declared dead too early would run twice)."""
    period = int(os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30"))
    return timedelta(seconds=float(os.environ.get("DISTILLERY_HEARTBEAT_GRACE_S", 3 * period)))


def automations() -> list[Automation]:
    crash = Automation(
        name="distillery: crash unresponsive runs",
        description="A deployment's flow run whose heartbeats stopped (its worker died) is marked Crashed.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINISHED},
            match=FLOW_RUNS,
            match_related=OF_A_DEPLOYMENT,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=heartbeat_grace(),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message="No heartbeat: its worker stopped answering")],
    )
    retry = Automation(
        name="distillery: retry crashed runs",
        description="A deployment's Crashed flow run is scheduled again for any worker (it resumes from the cache).",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=FLOW_RUNS,
            match_related=OF_A_DEPLOYMENT,
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED, name="AwaitingRetry", message="Crashed: scheduled again", force=True
            )
        ],
    )
    return [crash, retry]


def ensure(automation: Automation) -> str:
    """Create `automation`, or update the one of the same name to it; returns what was done."""
    try:
        existing = Automation.read(name=automation.name)
    except ValueError:
        automation.create()
        return "created"
    automation.id = existing.id
    automation.update()
    return "updated"


def main() -> None:
    for a in automations():
        print(f"automation {a.name!r}: {ensure(a)}")


if __name__ == "__main__":
    main()
