"""The Prefect home under the cortiq home: made as prefect is first imported, not before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_flows_writes_nothing_and_importing_prefect_makes_its_home(tmp_path):
    home = tmp_path / "fresh" / "home"  # no parent exists: prefect alone would fail to make it
    code = ("import os, sys; import flows, flows.commands.run;"
            "assert not os.path.exists(sys.argv[1]), 'written on import';"
            "import prefect; assert os.path.isdir(os.path.join(sys.argv[1], 'prefect'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(CORTIQ_HOME=str(home), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code, str(home)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Failed to create the Prefect home" not in r.stderr
