"""Lazy package exports: an export stays the export whatever was imported first, and no
export may be named like a submodule of its package (that is what made them ambiguous)."""

import subprocess
import sys
import types
from pathlib import Path

import pytest

from cortiq._lazy import exports

ROOT = Path(__file__).resolve().parents[1]


def test_exports_stay_the_exports_after_their_modules_load():
    # `Windows` loads cortiq.data.windowing and `FOLD` cortiq.compress.stages (which loads
    # cortiq.compress.folding); `windows`, `build`, `fold` and `gptq` must still be the functions
    code = ("from cortiq.data import Windows, BuildSettings; import cortiq.data as d; "
            "from cortiq.compress import FOLD; import cortiq.compress.folding, cortiq.compress.gptq_solver; "
            "from cortiq.data import windows, build; from cortiq.compress import fold, gptq; "
            "print(windows.__module__, build.__module__, d.windows is windows, fold.__module__, gptq.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cortiq.data.windowing", "cortiq.data.builder", "True", "cortiq.compress.stages",
                                "cortiq.compress.stages"]


def test_an_export_named_like_a_submodule_is_refused(monkeypatch):
    pkg = types.ModuleType("cortiq_fake_pkg")
    pkg.__path__ = [str(ROOT / "cortiq" / "data")]  # its submodules: builder, windowing, ...
    monkeypatch.setitem(sys.modules, "cortiq_fake_pkg", pkg)
    with pytest.raises(ImportError, match="^cortiq_fake_pkg: exports named like its submodules: windowing$"):
        exports("cortiq_fake_pkg", {"windowing": "builder", "build": "builder"})
    assert exports("cortiq_fake_pkg", {"build": "builder"})[2] == ["build"]
