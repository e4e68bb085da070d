#!/usr/bin/env bash
# Generate the team set-up's Prefect API secret once: infra/.env (mode 600, git-ignored) holds
# DISTILLERY_PREFECT_AUTH=distillery:<random>, which `docker compose -f infra/compose.yaml` reads: the Prefect
# server asks for it (PREFECT_SERVER_API_AUTH_STRING) and the worker sends it (PREFECT_API_AUTH_STRING).
# Clients on the host: export PREFECT_API_AUTH_STRING="$(sed -n 's/^DISTILLERY_PREFECT_AUTH=//p' infra/.env)"
set -euo pipefail
env_file="$(dirname "$0")/.env"
if grep -qs '^DISTILLERY_PREFECT_AUTH=' "$env_file"; then echo "$env_file: secret already there"; exit 0; fi
(umask 077 && printf 'DISTILLERY_PREFECT_AUTH=distillery:%s\n' "$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')" >>"$env_file")
echo "$env_file: secret written (mode 600)"
