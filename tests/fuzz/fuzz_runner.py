"""Runs `cortiq` command lines in capped, timed processes and checks how they fail.

Every failure on bad input must be: a non-zero exit, exactly one line on stderr
starting `cortiq: `, no traceback, no "bug" report, not out of memory, within the
timeout, and nothing written (no output file, no `.partial` left)."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: address space a case may add to the server's (the cap is set in the child)
CASE_MEM = 1 << 30
#: the whole server process, torch included
SERVER_MEM = 6 << 30
CASE_TIMEOUT = 30.0


def _cap(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return set_limit


@dataclass
class Result:
    argv: list
    rc: int
    stdout: str
    stderr: str
    secs: float
    timed_out: bool
    grew: int  # bytes of resident memory the case added to the server's

    def __str__(self):
        return f"cortiq {' '.join(map(str, self.argv))}: rc {self.rc}, {self.secs:.2f}s, +{self.grew >> 20} MB\n{self.stderr[-3000:]}"


class Cortiq:
    """A fork server (tests/fuzz/fuzz_server.py) started once: `run(argv)` forks a case."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuzz_server.py"))], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_cap(SERVER_MEM))
        hello = json.loads(self.p.stdout.readline())
        self.base_rss = hello["rss"]

    def run(self, argv, cwd, timeout: float = CASE_TIMEOUT, mem: int = CASE_MEM) -> Result:
        argv = [str(a) for a in argv]
        self.p.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "timeout": timeout, "mem": mem}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the fuzz server died")
        r = json.loads(line)
        return Result(argv, r["rc"], r["stdout"], r["stderr"], r["secs"], r["timed_out"], max(0, r["maxrss"] - self.base_rss))

    def close(self):
        self.p.stdin.close()  # the server's loop ends; a slow exit on a busy machine is not a failure
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def leftovers(d: Path) -> list[str]:
    """`.partial` files or folders under `d` (a failed write must leave none)."""
    return sorted(str(p) for p in Path(d).rglob("*.partial"))


def assert_clean_failure(r: Result, match: str | None = None, out: Path | None = None):
    """`r` failed as bad input must: one line, non-zero exit, no traceback, bounded, nothing written."""
    assert not r.timed_out, f"timed out: {r}"
    assert r.rc not in (0, 70, 99), f"expected a clean failure: {r}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cortiq: "), f"not one line: {r}"
    assert "Traceback" not in r.stderr and "bug in cortiq" not in r.stderr, str(r)
    assert "out of memory" not in r.stderr, f"ran out of memory instead of refusing: {r}"
    assert r.grew < CASE_MEM, str(r)
    if match:
        assert re.search(match, lines[0]), f"{match!r} not in: {r}"
    if out is not None:
        assert not out.exists(), f"{out} was written: {r}"
        assert not leftovers(out.parent), leftovers(out.parent)


def assert_ok_or_clean(r: Result, out: Path | None = None):
    """Any outcome but a crash: success, or a clean failure."""
    if r.rc == 0:
        assert not r.timed_out and "Traceback" not in r.stderr, str(r)
    else:
        assert_clean_failure(r, out=out)
