"""`make serve`'s steps (deployments/serve.sh) on an empty HOME, before any other cortiq command:
it makes the Prefect home under the cortiq home, starts the server, creates the pool and deploys
both schedules (stopping there, CORTIQ_SERVE_NO_WORKER=1); a step that fails is one line."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(home: Path, port: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k not in ("CORTIQ_HOME",)}
    env.update(HOME=str(home), BIN=str(Path(sys.executable).parent), PREFECT_PORT=str(port),
               CORTIQ_SERVE_NO_WORKER="1", PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(ROOT / "deployments" / "serve.sh")], env=env, capture_output=True, text=True,
                          timeout=600)


def test_make_serve_deploys_on_an_empty_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = _serve(home, _free_port())
    assert r.returncode == 0, r.stdout + r.stderr + (home / ".cortiq/prefect/serve.log").read_text()
    assert "deployed; UI at" in r.stdout
    with sqlite3.connect(home / ".cortiq" / "prefect" / "prefect.db") as c:
        names = sorted(n for (n,) in c.execute("select name from deployment"))
        pools = [n for (n,) in c.execute("select name from work_pool")]
    assert names == ["demo", "nightly"] and "cortiq" in pools


def test_a_failed_step_is_one_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with socket.socket() as taken:  # the server's port is someone else's
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = _serve(home, taken.getsockname()[1])
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make serve: starting the Prefect server on 127.0.0.1:"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_an_unset_home_falls_back_as_cortiq_does(tmp_path):
    # with HOME unset, `make serve` took the Prefect home from the user's home, as Python's
    # Path.home() does, rather than stopping on bash's "HOME: unbound variable"
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "CORTIQ_HOME") and not k.startswith("PREFECT_")}
    r = subprocess.run(["bash", str(ROOT / "deployments" / "serve.sh"), "--print-home"], env=env, capture_output=True,
                       text=True, timeout=60)
    home = subprocess.run([sys.executable, "-c", "from pathlib import Path; print(Path.home())"], env=env,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    assert (r.returncode, r.stderr, r.stdout) == (0, "", f"{home}/.cortiq/prefect\n")
    env["CORTIQ_HOME"] = str(tmp_path / "c")
    r = subprocess.run(["bash", str(ROOT / "deployments" / "serve.sh"), "--print-home"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"{tmp_path / 'c'}/prefect\n")
