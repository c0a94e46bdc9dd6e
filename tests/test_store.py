"""Stage outputs: digests, directories finished by meta.json, Arrow files; locks for two writers."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from cortiq import store
from cortiq.errors import CortiqError

ROOT = Path(__file__).resolve().parents[1]


def test_digest_depends_on_what_not_how_it_is_written():
    a = store.digest("heal", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"])
    assert a == store.digest("heal", "1", {"ce": float("inf"), "k": (1, 2), "lr": 1e-4}, ["x", "y"])
    assert len(a) == 32
    others = {store.digest("heal", 2, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"]),
              store.digest("heal", 1, {"lr": 2e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"]),
              store.digest("heal", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["y", "x"]),
              store.digest("masks", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"])}
    assert a not in others and len(others) == 4


def test_stage_dir_writes_meta_last_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "s-1"
    with store.stage_dir(out, {"digest": "d1"}) as part:
        assert part.name == "s-1.partial" and not store.is_complete(part)
        store.write_arrow(part / "t.arrow", pa.table({"a": [1, 2, 3]}))
    assert store.is_complete(out) and store.read_meta(out)["digest"] == "d1"
    assert store.read_arrow(out / "t.arrow").column("a").to_pylist() == [1, 2, 3]
    assert store.file_digest(out) == "d1"
    with pytest.raises(RuntimeError):
        with store.stage_dir(tmp_path / "s-2", {"digest": "d2"}):
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-1"]


def test_an_unfinished_directory_is_named_as_such(tmp_path):
    (tmp_path / "half").mkdir()
    assert not store.is_complete(tmp_path / "half")
    with pytest.raises(CortiqError, match="half: not a finished stage output"):
        store.read_meta(tmp_path / "half")
    store.finish_dir(tmp_path / "half", {"digest": "d3"})
    assert json.loads((tmp_path / "half" / "meta.json").read_text())["digest"] == "d3"
    with pytest.raises(CortiqError, match="not an Arrow file"):
        (tmp_path / "x.arrow").write_bytes(b"nope")
        store.read_arrow(tmp_path / "x.arrow")


# ── two writers ──────────────────────────────────────────────────────────

def _py(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_a_lock_excludes_another_process_and_dies_with_its_holder(tmp_path):
    target = tmp_path / "out"
    holder = _py("import sys; from cortiq import store\n"
                 "with store.locked(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()",
                 str(target), stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CortiqError, match="another cortiq process is writing it"):
            with store.locked(target, wait=False):
                pass
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
    with store.locked(target, wait=False):
        pass


def test_two_recodes_to_one_output_take_turns(tmp_path):
    from tiny import llama_arch, write_random

    from cortiq.cmf import open_cmf

    src = write_random(tmp_path / "src.cmf", llama_arch(64, 128, 2), 0)
    out = tmp_path / "out.cmf"
    code = "import sys; from cortiq.cli import main; sys.exit(main(sys.argv[1:]))"
    # both start while a third writer holds OUT: each must wait for it, and then for the other
    with store.locked(out):
        procs = [_py(code, "recode", str(src), str(out), "--codec", c) for c in ("q8", "f16")]
        for p in procs:
            said = next((line for line in p.stderr if "another process is writing it; waiting" in line), None)
            assert said == f"cortiq: {out}: another process is writing it; waiting\n"
        assert [p.poll() for p in procs] == [None, None]
        assert not out.exists()
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert [r[2] for r in results] == [0, 0], results
    f = open_cmf(out)
    assert f.verify() == []  # every tensor matches its sha256: one writer's file, whole
    assert {i.codec for i in f.infos.values() if len(i.shape) == 2} in ({"q8"}, {"f16"})
    # no lock file left (the cortiq home the tests put in tmp_path holds what loading the CLI's plugins made)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cortiq-home") == ["out.cmf", "src.cmf"]
