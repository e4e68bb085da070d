#!/usr/bin/env bash
# One Prefect process worker of the team set-up: takes flow runs from work pool POOL, one at a time, and runs them
# from this checkout. infra/up.sh in team mode starts DISTILLERY_WORKERS of them. On another machine: the same
# checkout and workdirs at the same paths (a shared filesystem: docs/team.md), then
#   export PREFECT_API_URL=http://SERVER:4200/api MLFLOW_TRACKING_URI=http://SERVER:5000   (+ the auth exports)
#   infra/worker.sh distillery "$(hostname)"
# Flow runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY (30) s: when they stop, the server's automation
# marks the run Crashed and schedules it again (infra/automations.py).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: infra/worker.sh POOL NAME" >&2; exit 2; }
cd "$(dirname "$0")/.."
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY="${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}"
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-5}" PREFECT_SERVER_ANALYTICS_ENABLED=false
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code
exec .venv/bin/prefect --no-prompt worker start --pool "$1" --name "$2" --limit 1
