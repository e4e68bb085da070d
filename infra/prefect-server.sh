#!/usr/bin/env bash
# Start a local Prefect server (UI at http://127.0.0.1:4200) with its state under runs/.prefect.
# Then, in the shell that runs distillery: export PREFECT_API_URL=http://127.0.0.1:4200/api
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_HOME="${PREFECT_HOME:-$PWD/runs/.prefect}" PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/prefect server start --host 127.0.0.1 --port "${PREFECT_PORT:-4200}"
