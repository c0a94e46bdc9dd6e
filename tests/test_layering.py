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


def _imports(*roots: Path) -> dict[str, set[str]]:
    """module -> the modules of `roots` it imports (anywhere in it: a function-level import is an edge too)."""
    mods = {}
    for root in roots:
        for p in root.rglob("*.py"):
            name = ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = p
    graph = {m: set() for m in mods}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            # a module's own package is imported with it anyway: not an edge
            graph[name] |= {t for t in targets if t in mods and t != name and not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles_in_the_core_nor_the_orchestration():
    # the library, the flows and the tasks as one graph (a circle through flows and tasks counts too)
    assert _cycles(_imports(ROOT / "cortiq", ROOT / "flows", ROOT / "tasks")) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")  # function-level: still a circle
    assert _cycles(_imports(pkg)) == [["pkg.a", "pkg.b", "pkg.a"]]
