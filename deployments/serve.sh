#!/usr/bin/env bash
# `make serve`: a local Prefect server on 127.0.0.1, the `cortiq` process work pool, the deployments
# of deployments/prefect.yaml, and a worker that runs them. Ctrl-C stops the worker and the server.
set -euo pipefail
cd "$(dirname "$0")/.."
export CORTIQ_REPO="$PWD"
BIN="${BIN:-.venv/bin}"
PORT="${PREFECT_PORT:-4200}"
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_HOME="${PREFECT_HOME:-${CORTIQ_HOME:-$HOME/.cortiq}/prefect}"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"

"$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 60); do
  "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=1)" 2>/dev/null && break
  sleep 1
done
"$BIN/prefect" work-pool inspect cortiq >/dev/null 2>&1 || "$BIN/prefect" work-pool create cortiq --type process
"$BIN/prefect" --no-prompt deploy --all --prefect-file deployments/prefect.yaml
echo "deployed; UI at http://127.0.0.1:$PORT — starting a worker on pool cortiq"
"$BIN/prefect" worker start --pool cortiq
