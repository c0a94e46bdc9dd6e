#!/usr/bin/env bash
# `make serve`: a local Prefect server on 127.0.0.1, the `cortiq` process work pool, the deployments
# of deployments/prefect.yaml, and a worker that runs them. Ctrl-C stops the worker and the server.
# It makes what it needs on a fresh machine (the Prefect home under the cortiq home); each step's
# output goes to $PREFECT_HOME/serve.log, and a step that fails is named in one line (exit 1).
# CORTIQ_SERVE_NO_WORKER=1 stops after deploying (the server with it); --print-home prints the Prefect
# home it would use and stops.
set -uo pipefail
cd "$(dirname "$0")/.."
export CORTIQ_REPO="$PWD"
BIN="${BIN:-.venv/bin}"
PORT="${PREFECT_PORT:-4200}"
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true
# `~` is HOME, or where HOME is unset the user's home from the password database: the same
# fallback as the cortiq home's in Python (Path.home()), so the server and the flows agree
user_home=~
export PREFECT_HOME="${PREFECT_HOME:-${CORTIQ_HOME:-$user_home/.cortiq}/prefect}"
if [ "${1:-}" = "--print-home" ]; then  # where the server's database and log go, and nothing else
  echo "$PREFECT_HOME"
  exit 0
fi
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"

fail() {
  echo "make serve: $1 failed (see $LOG)" >&2
  exit 1
}

# Prefect creates its home without parents: the server's database could not open on a fresh machine
mkdir -p "$PREFECT_HOME" || { echo "make serve: making the Prefect home $PREFECT_HOME failed" >&2; exit 1; }
LOG="$PREFECT_HOME/serve.log"
: > "$LOG" || { echo "make serve: writing $LOG failed" >&2; exit 1; }

"$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >>"$LOG" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
up=""
for _ in $(seq 180); do
  kill -0 "$server" 2>/dev/null || break  # it exited (a port taken, a database that cannot open)
  if "$BIN/python" -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=1)" 2>/dev/null; then
    up=1
    break
  fi
  sleep 1
done
[ -n "$up" ] || fail "starting the Prefect server on 127.0.0.1:$PORT"
"$BIN/prefect" work-pool inspect cortiq >>"$LOG" 2>&1 \
  || "$BIN/prefect" work-pool create cortiq --type process >>"$LOG" 2>&1 \
  || fail "creating the work pool cortiq"
"$BIN/prefect" --no-prompt deploy --all --prefect-file deployments/prefect.yaml >>"$LOG" 2>&1 \
  || fail "deploying deployments/prefect.yaml"
echo "deployed; UI at http://127.0.0.1:$PORT (log: $LOG)"
[ -z "${CORTIQ_SERVE_NO_WORKER:-}" ] || exit 0
echo "starting a worker on pool cortiq"
"$BIN/prefect" worker start --pool cortiq 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || [ "$status" -eq 130 ] || fail "the worker on pool cortiq"
