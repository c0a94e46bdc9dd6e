"""`cortiq run` as a user runs it, in separate processes on one cortiq home: killed with
SIGKILL mid-run (its Prefect server dies with it; the next run marks the run crashed), and two
runs at once (both finish, each stage made once and reused by the other). One test: each
`cortiq run` process costs a Prefect server start."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _env(home: Path) -> dict:
    env = {**os.environ, "CORTIQ_HOME": str(home), "PYTHONPATH": str(ROOT)}
    # the process makes its own Prefect home and server, as a user's run does (not the test harness's)
    for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_LOCAL_STORAGE_PATH"):
        env.pop(k, None)
    return env


def _params(tiny, tiny_params) -> Path:
    p = tiny["dir"] / "tiny.yaml"
    p.write_text(yaml.safe_dump(tiny_params(tiny)))
    return p


def _cortiq_run(params: Path, home: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cortiq", "run", "compress", "--params", str(params)],
                            env=_env(home), cwd=params.parent, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait(cond, what: str, limit: float = 400.0, proc: subprocess.Popen | None = None):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"no {what} after {limit} s")


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _cached(log: str) -> tuple[int, int]:
    """(stages, stages from cache) from the summary `cortiq run` prints."""
    line = next(x for x in log.splitlines() if x.startswith("stages: "))
    n, rest = line.removeprefix("stages: ").split(" (", 1)
    return int(n), int(rest.split()[0])


def test_kill_9_then_two_runs_at_once_on_one_home(tiny, tiny_params):
    from mlflow.tracking import MlflowClient

    home = tiny["dir"] / "home"
    params = _params(tiny, tiny_params)
    # a run killed with SIGKILL once it is under way: its Prefect server dies with it
    a = _cortiq_run(params, home, tiny["dir"] / "a.log")
    try:
        record = _wait(lambda: next(iter((home / "runs").glob("*.json")), None), "live run record", proc=a)
        servers = [c for c in _children(a.pid) if "uvicorn" in _cmdline(c)]
        assert len(servers) == 1
        a.send_signal(signal.SIGKILL)
        a.wait()
    finally:
        if a.poll() is None:
            a.kill()
    _wait(lambda: not _alive(servers[0]), "exit of the killed run's Prefect server", limit=60)
    rec = json.loads(record.read_text())

    # two runs at once on the same home: both finish, and no stage is made twice
    logs = [tiny["dir"] / "b.log", tiny["dir"] / "c.log"]
    procs = [_cortiq_run(params, home, log) for log in logs]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    (nb, cb), (nc, cc) = _cached(texts[0]), _cached(texts[1])
    # each of the five stages was made by one run (or the killed one) and taken from its output by the other
    assert nb == nc == 5 and cb + cc >= 5

    # the killed run is marked crashed in Prefect and failed in MLflow by the runs that came next
    assert not record.exists()
    db = sqlite3.connect(home / "prefect" / "prefect.db")
    states = dict(db.execute("select id, state_type from flow_run").fetchall())
    db.close()
    assert states.pop(rec["flow_run_id"]) == "CRASHED"
    assert sorted(states.values()) == ["COMPLETED", "COMPLETED"]
    c = MlflowClient(tracking_uri=rec["tracking_uri"])
    run = c.get_run(rec["mlflow_run_id"])
    assert run.info.status == "FAILED"
    assert "died without ending it" in run.data.tags["cortiq.crashed"]
    runs = c.search_runs([c.get_experiment_by_name("cortiq").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED", "FINISHED"]
