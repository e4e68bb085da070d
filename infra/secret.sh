#!/usr/bin/env bash
# Generate the team set-up's secrets once into infra/.env (mode 600, git-ignored), which `docker compose -f
# infra/compose.yaml` reads: DISTILLERY_PREFECT_AUTH=distillery:<random>, which the Prefect server asks for
# (PREFECT_SERVER_API_AUTH_STRING) and the worker sends (PREFECT_API_AUTH_STRING); DISTILLERY_MLFLOW_PASSWORD=<random>,
# the password of MLflow's basic-auth admin `distillery` (set when its user store is created), which the worker sends
# (MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD). A variable already in infra/.env is kept.
# Clients on the host: export PREFECT_API_AUTH_STRING="$(sed -n 's/^DISTILLERY_PREFECT_AUTH=//p' infra/.env)"
#   MLFLOW_TRACKING_USERNAME=distillery MLFLOW_TRACKING_PASSWORD="$(sed -n 's/^DISTILLERY_MLFLOW_PASSWORD=//p' infra/.env)"
set -euo pipefail
env_file="$(dirname "$0")/.env"
random() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }
add() {  # NAME VALUE: appended unless NAME is there
  if grep -qs "^$1=" "$env_file"; then echo "$env_file: $1 already there"; return; fi
  (umask 077 && printf '%s=%s\n' "$1" "$2" >>"$env_file")
  echo "$env_file: $1 written (mode 600)"
}
add DISTILLERY_PREFECT_AUTH "distillery:$(random)"
add DISTILLERY_MLFLOW_PASSWORD "$(random)"
chmod 600 "$env_file"
