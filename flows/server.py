"""The embedded Prefect server of a `cortiq run`, owned by the process that runs the flow.

Prefect starts a server of its own on the first flow call when no API is
configured, but that server outlives its parent: after a `kill -9` of the run
it is re-parented to init and keeps running. Here the same server (Prefect's
API app under uvicorn, UI off) is started by the run itself, in a child that
asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG, kept
across the exec), and stopped when the flow returns. It is started under the
lock of the Prefect home: two runs on one cortiq home share its database, and
a server migrates the database as it starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from cortiq import store
from cortiq.errors import CortiqError

#: runs in the child before the server: parent-death signal, then exec (the setting survives exec)
_GUARD = """
import ctypes, os, signal, sys
prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only; elsewhere no guard
if prctl is not None:
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the parent died before the guard took effect
    sys.exit(0)
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""

#: uvicorn exits with this when its port was taken between the probe and the bind
_PORT_TAKEN = 3


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(port: int) -> subprocess.Popen:
    import prefect
    from prefect.settings import get_current_settings

    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           # what Prefect's own embedded server sets: no UI, the ephemeral server's services
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    args = ["-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]
    # a session of its own: a Ctrl-C of the run reaches the run, which still reports its end to
    # the server before stopping it (a kill of the run reaches the server by the parent-death signal)
    return subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid()), *args], env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start(timeout: float) -> tuple[subprocess.Popen, str]:
    """A Prefect server on a free local port, healthy; (its process, its API URL)."""
    home = Path(os.environ.get("PREFECT_HOME") or store.home() / "prefect")
    with store.locked(home / "server"):
        for _ in range(5):
            port = _free_port()
            url = f"http://127.0.0.1:{port}/api"
            proc = _spawn(port)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                if _healthy(url):
                    return proc, url
                time.sleep(0.2)
            _stop(proc)
            if proc.returncode != _PORT_TAKEN:
                break
    raise CortiqError(f"{home}: the Prefect server did not start (exit {proc.returncode}); "
                      "run again, or set PREFECT_API_URL to a running server")


@contextlib.contextmanager
def embedded_server() -> Iterator[str | None]:
    """A Prefect API for the body: the configured one (PREFECT_API_URL: a server, or a test
    harness), else a server started here that dies with this process. Call it from the main
    thread: the parent-death signal follows the thread that started the child."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    if PREFECT_API_URL.value():
        yield None
        return
    proc, url = start(float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    old = os.environ.get("PREFECT_API_URL")
    # the environment too: Prefect's worker threads read settings outside this context
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                drain()
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        _stop(proc)


def drain(timeout: float = 60.0) -> None:
    """Send what Prefect's background workers still hold (the flow's last log lines, its
    events) and stop them, while the server is up. Left to the interpreter's exit, they
    would find the server gone and retry it for over a minute, then say they could not log."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout, at_exit=False)
