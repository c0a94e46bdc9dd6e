"""The core library runs without the orchestrator: cortiq/ never imports prefect, mlflow or the
orchestration packages flows/ and tasks/ (their commands join the CLI through an entry point).
Its modules form no import circle, and each imports only from its own layer and those below
(`LAYERS`: base < model < data < stages < pipeline < outputs < commands)."""

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


#: cortiq's layers, lowest first, by a module's first name under cortiq ("" is the package itself): a
#: module imports from its own layer and the ones below it, never from one above
LAYERS = (
    # formats, the stage runner and what every stage shares
    ("base", {"errors", "exit", "_lazy", "arch", "codecs", "cmf", "store", "tokenizer", "chat", "settings_meta",
              "tracking", "dist", "devices", "train_loop", "runner", "runner_worker"}),
    # the decoders, and the fact probe that reads what they know
    ("model", {"model", "facts"}),
    # what the stages read: tdata, and models converted to CMF
    ("data", {"data", "convert"}),
    ("stages", {"compress", "heal", "mtp", "quant", "measure"}),
    # a parameter set and its chains
    ("pipeline", {"settings", "settings_doc", "chains"}),
    ("outputs", {"export", "serve"}),
    ("commands", {"commands", "cli", "__main__", ""}),
)


def _layer(module: str) -> int:
    first = module.split(".")[1] if "." in module else ""
    return next(i for i, (_, names) in enumerate(LAYERS) if first in names)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[_layer(m)][0]}) imports {n} ({LAYERS[_layer(n)][0]})"
                  for m, targets in graph.items() for n in targets if _layer(n) > _layer(m))


def test_every_core_module_has_a_layer_and_no_import_runs_up_the_layers():
    graph = _imports(ROOT / "cortiq")
    unplaced = []
    for m in graph:
        try:
            _layer(m)
        except StopIteration:
            unplaced.append(m)
    assert unplaced == [], "a module outside every layer: give its package a place in LAYERS"
    assert _cycles(graph) == []
    assert _upward(graph) == []


def test_the_layer_check_finds_an_import_that_runs_up():
    graph = {"cortiq.runner": {"cortiq.data.windowing"}, "cortiq.data.windowing": {"cortiq.store"},
             "cortiq.store": set()}
    assert _upward(graph) == ["cortiq.runner (base) imports cortiq.data.windowing (data)"]
