"""Lazy package exports survive their submodule's import."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_export_named_like_its_module_stays_the_export():
    # `Windows` loads cortiq.data.windows, which binds the module's name on the package;
    # `windows` (the function) and `build` must still be the functions afterwards
    code = ("from cortiq.data import Windows, BuildSettings; import cortiq.data as d; "
            "from cortiq.data import windows, build; "
            "print(callable(windows), windows.__module__, callable(build), build.__module__, d.windows is windows)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "cortiq.data.windows", "True", "cortiq.data.build", "True"]
