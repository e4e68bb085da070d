#!/usr/bin/env bash
# Stop what infra/up.sh started from DATA_DIR (default runs/servers): exactly the process groups in its pid files
# (team mode's workers first, then the servers), TERM first, KILL after 20 s; then team mode's local PostgreSQL.
set -uo pipefail
cd "$(dirname "$0")/.."
data="$(realpath -m "${1:-runs/servers}")"
status=0
workers=$(cd "$data" 2>/dev/null && ls worker-*.pid 2>/dev/null | sed 's/\.pid$//' | sort -V)
for name in $workers prefect mlflow; do
  pidfile="$data/$name.pid"
  [ -f "$pidfile" ] || { echo "$name: no pid file in $data"; continue; }
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    if kill -0 "$pid" 2>/dev/null; then echo "$name (pid $pid) did not stop" >&2; status=1; continue; fi
    echo "$name stopped (pid $pid)"
  else
    echo "$name: not running (stale pid $pid)"
  fi
  rm -f "$pidfile"
done
if [ -e "$data/postgres/pgdata/PG_VERSION" ]; then
  .venv/bin/python infra/postgres.py stop "$data/postgres" || status=1
fi
exit $status
