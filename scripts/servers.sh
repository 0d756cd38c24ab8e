#!/usr/bin/env bash
# Start or stop a Prefect server and an MLflow server on 127.0.0.1 (`make servers`, `make servers-stop`).
#
#   scripts/servers.sh start   both servers in the background; pid files, logs and env.sh in
#                              $REPSIM_HOME/servers; returns once both answer their health checks
#   scripts/servers.sh stop    stops exactly the processes `start` wrote pid files for
#
# Stores: SQLite under $REPSIM_HOME/servers by default. With REPSIM_DB_URL set to a PostgreSQL
# server (postgresql://user:password@host:5432, no database name), Prefect uses its database
# `prefect` and MLflow its database `mlflow` there (create both first). MLflow's artifacts go to
# $REPSIM_HOME/servers/mlartifacts either way. Ports: PREFECT_PORT (4200), MLFLOW_PORT (5000).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
REPSIM_HOME=$(realpath -m "${REPSIM_HOME:-.repsim}")
DIR="$REPSIM_HOME/servers"
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
HOST=127.0.0.1

say() { printf 'servers: %s\n' "$*"; }

healthy() { "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null; }

running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

launch() {  # NAME HEALTH_URL COMMAND...: a new session (pid = process group), so stop ends all it spawned
  local name=$1 url=$2; shift 2
  if running "$name"; then say "$name is already running (pid $(cat "$DIR/$name.pid"))"; return; fi
  setsid "$@" >"$DIR/$name.log" 2>&1 < /dev/null &
  echo $! >"$DIR/$name.pid"
  for _ in $(seq 120); do
    healthy "$url" && return
    running "$name" || { say "$name failed to start; its log: $DIR/$name.log"; tail -n 20 "$DIR/$name.log"; exit 1; }
    sleep 1
  done
  say "$name did not answer $url within 120 s; its log: $DIR/$name.log"; exit 1
}

start() {
  mkdir -p "$DIR/prefect" "$DIR/mlartifacts"
  local prefect_db="sqlite+aiosqlite:///$DIR/prefect/prefect.db" mlflow_db="sqlite:///$DIR/mlflow.db"
  if [ -n "${REPSIM_DB_URL:-}" ]; then
    prefect_db="${REPSIM_DB_URL/postgresql:/postgresql+asyncpg:}/prefect"
    mlflow_db="$REPSIM_DB_URL/mlflow"
  fi
  PREFECT_HOME="$DIR/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT=false PREFECT_API_DATABASE_CONNECTION_URL="$prefect_db" \
    PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api" \
    launch prefect "http://$HOST:$PREFECT_PORT/api/health" \
    "$VENV/bin/prefect" server start --host "$HOST" --port "$PREFECT_PORT"
  launch mlflow "http://$HOST:$MLFLOW_PORT/health" \
    "$VENV/bin/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "$mlflow_db" --artifacts-destination "$DIR/mlartifacts" --serve-artifacts
  cat >"$DIR/env.sh" <<ENV
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
ENV
  say "Prefect UI http://$HOST:$PREFECT_PORT, MLflow UI http://$HOST:$MLFLOW_PORT (logs in $DIR)"
  say "point repsim at them:  source $DIR/env.sh"
  sed 's/^/    /' "$DIR/env.sh"
}

stop() {
  for name in mlflow prefect; do
    if running "$name"; then
      local pid; pid=$(cat "$DIR/$name.pid")
      kill -TERM -- "-$pid"
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid"
      say "stopped $name (pid $pid)"
    fi
    rm -f "$DIR/$name.pid"
  done
  rm -f "$DIR/env.sh"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
