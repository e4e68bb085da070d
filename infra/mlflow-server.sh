#!/usr/bin/env bash
# Start the MLflow UI over the default tracking store of a run's workdir (sqlite + local artifacts).
# Usage: infra/mlflow-server.sh [WORKDIR]   (default runs/default) -> http://127.0.0.1:5000
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="$(realpath "${1:-runs/default}")"
exec .venv/bin/mlflow server --host 127.0.0.1 --port "${MLFLOW_PORT:-5000}" \
  --backend-store-uri "sqlite:///$workdir/mlflow.db" --default-artifact-root "$workdir/mlartifacts"
