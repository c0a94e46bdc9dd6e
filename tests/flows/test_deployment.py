"""A local Prefect server + process worker on 127.0.0.1 runs a deployment from
deployments/prefect.yaml to Completed, and its cron schedule is active."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

INSPECT = """
import asyncio, json, sys
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as c:
        run = await c.read_flow_run(sys.argv[1])
        dep = await c.read_deployment_by_name("compress-and-heal/demo")
        print(json.dumps({"state": run.state.type.value, "schedules": [s.active for s in dep.schedules],
                          "crons": [getattr(s.schedule, "cron", None) for s in dep.schedules]}))
asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_deployment_runs_on_a_process_worker(tiny, tiny_params, tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
               PREFECT_WORKER_QUERY_SECONDS="1", CORTIQ_REPO=str(ROOT), CORTIQ_HOME=str(tmp_path / "home"),
               PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "storage"), DO_NOT_TRACK="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true")
    params = tmp_path / "tiny.yaml"
    params.write_text(yaml.safe_dump({**tiny_params(tiny), "mtp_enabled": False}))

    def prefect(*args, timeout=180):
        r = subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
        assert r.returncode == 0, r.stdout
        return r.stdout

    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the Prefect server did not come up")
        prefect("work-pool", "create", "cortiq", "--type", "process")
        prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        out = prefect("deployment", "run", "compress-and-heal/demo", "--param", f"params={params}")
        run_id = next(w for line in out.splitlines() if "UUID" in line for w in line.split() if w.count("-") == 4)
        worker = prefect("worker", "start", "--pool", "cortiq", "--run-once", timeout=400)
        r = subprocess.run([sys.executable, "-c", INSPECT, run_id], env=env, capture_output=True, text=True, check=True)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["state"] == "COMPLETED", worker[-3000:]
        assert got["schedules"] == [True] and got["crons"] == ["0 3 * * *"]
        # the flow ran in the worker's subprocess and tracked its run in the home's MLflow store
        assert (tmp_path / "home" / "mlflow.db").is_file()
    finally:
        server.terminate()
        server.wait(timeout=30)
