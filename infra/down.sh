#!/usr/bin/env bash
# Stop the servers infra/up.sh started from DATA_DIR (default runs/servers): exactly the process groups in its pid
# files, TERM first, KILL after 20 s.
set -uo pipefail
cd "$(dirname "$0")/.."
data="$(realpath -m "${1:-runs/servers}")"
status=0
for name in prefect mlflow; do
  pidfile="$data/$name.pid"
  [ -f "$pidfile" ] || { echo "$name: no pid file in $data"; continue; }
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"; fi
    if kill -0 "$pid" 2>/dev/null; then echo "$name (pid $pid) did not stop" >&2; status=1; continue; fi
    echo "$name stopped (pid $pid)"
  else
    echo "$name: not running (stale pid $pid)"
  fi
  rm -f "$pidfile"
done
exit $status
