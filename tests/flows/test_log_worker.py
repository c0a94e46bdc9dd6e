"""The embedded Prefect server outlives the flow's log lines: they are all delivered before it
stops, and no log or event worker is left to retry a stopped server (the command exits as soon
as its work is done, and says nothing about failing to log)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, threading
import tasks  # the offline environment, as `cortiq run` sets it
from prefect import flow, get_run_logger
from flows.common import quiet_prefect
from flows.server import embedded_server

@flow
def chatty():
    for i in range(200):
        get_run_logger().info("line %d", i)
    return 1

with embedded_server(), quiet_prefect():
    chatty()

from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
print(json.dumps({"workers": len(APILogWorker._instances) + len(EventsWorker._instances),
                  "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())}))
"""


def test_no_log_worker_outlives_the_flow(tmp_path):
    env = {**os.environ, "CORTIQ_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_LOCAL_STORAGE_PATH"):
        env.pop(k, None)  # its own Prefect home and server, as a user's run has (not the test harness's)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Error logging to API" not in r.stderr and "connection attempts failed" not in r.stderr, r.stderr
    after = json.loads(r.stdout.strip().splitlines()[-1])
    assert after["workers"] == 0, after
    assert not [t for t in after["threads"] if "APILogWorker" in t or "EventsWorker" in t], after
    db = next((tmp_path / "home" / "prefect").glob("*.db"))
    with sqlite3.connect(db) as c:
        lines = {m for (m,) in c.execute("select message from log")}
    assert {f"line {i}" for i in range(200)} <= lines  # the last one too, before the server stopped
