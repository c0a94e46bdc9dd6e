"""The core library runs without the orchestrator: cortiq/ never imports prefect, mlflow or the
orchestration packages flows/ and tasks/ (their commands join the CLI through an entry point)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_sources_import_no_orchestration_package():
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
            banned = ("prefect", "mlflow", "flows", "tasks")
            offenders += [f"{p.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] in banned]
    assert offenders == []


def test_cli_help_loads_no_heavy_modules():
    code = (
        "import sys; from cortiq.cli import build_parser; build_parser();"
        "print(','.join(m for m in ('torch','prefect','mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def test_the_orchestrator_commands_come_from_the_entry_point_and_help_says_how_to_get_them(monkeypatch):
    from cortiq import cli

    names = {m.__name__ for m in cli._plugin_modules()}
    assert names == {"flows.commands.run", "flows.commands.demo", "flows.commands.compare"}
    assert cli.build_parser().epilog is None
    monkeypatch.setattr(cli, "_plugin_modules", lambda: [])  # cortiq installed without the flows extra
    p = cli.build_parser()
    assert p.epilog == cli.NO_PLUGINS and "pip install 'cortiq[flows]'" in p.format_help()
    assert "run" not in p._subparsers._group_actions[0].choices
