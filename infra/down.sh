#!/usr/bin/env bash
# Stop what infra/up.sh started from DATA_DIR (default runs/servers): exactly the process groups in its pid files,
# TERM first, TERM again after 5 s, KILL after 20 s - team mode's workers (together), then the servers (together) -
# and last team mode's local PostgreSQL. Exits non-zero when something did not stop.
set -uo pipefail
cd "$(dirname "$0")/.."
data="$(realpath -m "${1:-runs/servers}")"

stop() {  # NAME: the process group in DATA_DIR/NAME.pid; returns 1 when it did not stop
  local name=$1 pidfile="$data/$1.pid" pid
  [ -f "$pidfile" ] || { echo "$name: no pid file in $data"; return 0; }
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$pid" 2>/dev/null; then  # a Prefect worker waits on the first TERM and ends on the second
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    if kill -0 "$pid" 2>/dev/null; then echo "$name (pid $pid) did not stop" >&2; return 1; fi
    echo "$name stopped (pid $pid)"
  else
    echo "$name: not running (stale pid $pid)"
  fi
  rm -f "$pidfile"
}

stop_all() {  # NAME...: in parallel; returns 1 when any did not stop
  local pids=() rc=0
  for name in "$@"; do stop "$name" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

status=0
workers=$(cd "$data" 2>/dev/null && ls worker-*.pid 2>/dev/null | sed 's/\.pid$//' | sort -V)
[ -z "$workers" ] || stop_all $workers || status=1
stop_all prefect mlflow || status=1
if [ -e "$data/postgres/pgdata/PG_VERSION" ]; then
  .venv/bin/python infra/postgres.py stop "$data/postgres" || status=1
fi
exit $status
