"""The core library runs without the orchestrator: cortiq/ never imports prefect or mlflow."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_sources_import_neither_prefect_nor_mlflow():
    offenders = []
    for p in (ROOT / "cortiq").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
                  ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
                mods = [str(node.args[0].value)]  # importlib is an import too
            offenders += [f"{p.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] in ("prefect", "mlflow")]
    assert offenders == []


def test_cli_help_loads_no_heavy_modules():
    code = (
        "import sys; from cortiq.cli import build_parser; build_parser();"
        "print(','.join(m for m in ('torch','prefect','mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""
