#!/usr/bin/env bash
# Start or stop a Prefect server and an MLflow server on 127.0.0.1 (`make servers`, `make servers-stop`),
# or serve both UIs over the embedded stores until interrupted (`make ui`).
#
#   scripts/servers.sh start   both servers in the background; pid files, logs and env.sh in
#                              $REPSIM_HOME/servers; returns once both answer their health checks
#   scripts/servers.sh stop    stops exactly the processes `start` wrote pid files for
#   scripts/servers.sh ui      both UIs over $REPSIM_HOME's embedded stores (logs in $REPSIM_HOME/ui),
#                              until Ctrl-C or until either stops, which stops the other
#
# Stores: SQLite under $REPSIM_HOME/servers by default. With REPSIM_DB_URL set to a PostgreSQL
# server (postgresql://user:password@host:5432, no database name), Prefect uses its database
# `prefect` and MLflow its database `mlflow` there (create both first). MLflow's artifacts go to
# $REPSIM_HOME/servers/mlartifacts either way. Ports: PREFECT_PORT (4200), MLFLOW_PORT (5000); a taken
# port stops `start` and `ui` before anything starts, in one line.
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

require_free_ports() {  # one line and exit 1 if a port either server needs is taken
  local name port variable
  for name in prefect mlflow; do
    running "$name" && continue
    variable=$(echo "${name}_PORT" | tr a-z A-Z); port=${!variable}
    if ! "$VENV/bin/python" -c "import socket, sys; socket.create_server((sys.argv[1], int(sys.argv[2]))).close()" \
        "$HOST" "$port" 2>/dev/null; then
      say "error: port $port for the $name UI is taken on $HOST; set $variable to a free port (e.g. $variable=$((port + 1)) make ${MODE:-ui})"
      exit 1
    fi
  done
}

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

runs_link() {  # TRACKING_URI UI_URL: the UI's page of repsim's runs, in its model-training view
  MLFLOW_TRACKING_URI="$1" "$VENV/bin/python" -c "import sys
from mlflow import MlflowClient
from repsim.tasks.tracking import EXPERIMENT, runs_page
found = MlflowClient().get_experiment_by_name(EXPERIMENT)
print(runs_page(sys.argv[1], found.experiment_id) if found else sys.argv[1])" "$2" 2>/dev/null || echo "$2"
}

start() {
  MODE=servers require_free_ports
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
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false launch mlflow "http://$HOST:$MLFLOW_PORT/health" \
    "$VENV/bin/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "$mlflow_db" --artifacts-destination "$DIR/mlartifacts" --serve-artifacts
  cat >"$DIR/env.sh" <<ENV
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
ENV
  say "Prefect UI http://$HOST:$PREFECT_PORT, MLflow UI $(runs_link "http://$HOST:$MLFLOW_PORT" "http://$HOST:$MLFLOW_PORT") (logs in $DIR)"
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

ui() {  # both UIs over the embedded stores, in this terminal; stopping either stops the other
  DIR="$REPSIM_HOME/ui"
  mkdir -p "$DIR"
  require_free_ports
  trap 'stop >/dev/null' EXIT
  trap 'exit 130' INT TERM
  PREFECT_HOME="$REPSIM_HOME/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT=false PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api" \
    launch prefect "http://$HOST:$PREFECT_PORT/api/health" \
    "$VENV/bin/prefect" server start --host "$HOST" --port "$PREFECT_PORT"
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false launch mlflow "http://$HOST:$MLFLOW_PORT/health" \
    "$VENV/bin/mlflow" ui --host "$HOST" --port "$MLFLOW_PORT" --workers 1 --backend-store-uri "sqlite:///$REPSIM_HOME/mlflow.db"
  say "MLflow UI $(runs_link "sqlite:///$REPSIM_HOME/mlflow.db" "http://$HOST:$MLFLOW_PORT") (experiment repsim), Prefect UI http://$HOST:$PREFECT_PORT, over $REPSIM_HOME; Ctrl-C stops both"
  while running prefect && running mlflow; do sleep 2; done
  for name in prefect mlflow; do
    running "$name" || say "error: the $name UI stopped (its log: $DIR/$name.log); stopping the other"
  done
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ui) ui ;;
  *) echo "usage: $0 start|stop|ui" >&2; exit 2 ;;
esac
