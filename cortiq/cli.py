"""`cortiq`: the command line.

Each command lives in its own module under `cortiq/commands/` with
`HELP` (one line), `add_arguments(parser)` and `run(args) -> int`. Modules
import heavy libraries (torch, prefect, mlflow) inside `run`, so `--help`
and start-up stay fast. A `CortiqError` becomes one line on stderr and
exit status 1; no traceback. So does an `OSError` (a full disk, a denied
permission: the machine's state, not cortiq's) and running out of memory.
Anything else is a bug in cortiq: its traceback is printed with one line
asking for it to be filed, and the exit status is 70 (EX_SOFTWARE).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands as _commands
from .errors import CortiqError
from .settings_meta import HelpFormatter


#: commands another installed package adds (the orchestrator's `run`, `demo`, `compare`):
#: entry points of this group naming a module with HELP, add_arguments and run
PLUGIN_GROUP = "cortiq.commands"

#: what `--help` says when no package adds the orchestrator's commands
NO_PLUGINS = ("run, demo and compare (the pipeline as Prefect flows tracked in MLflow) come with the "
              "orchestrator: pip install 'cortiq[flows]'")


def _plugin_modules() -> list:
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group=PLUGIN_GROUP)]


def _command_modules():
    mods = []
    for m in pkgutil.iter_modules(_commands.__path__):
        if m.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"{_commands.__name__}.{m.name}"))
    return sorted(mods + _plugin_modules(), key=lambda m: getattr(m, "ORDER", 50))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cortiq",
        description="Make language models smaller and heal them back: learn which MLP neurons matter, "
        "fold the model down to them, heal it by distillation, retrain its MTP draft head.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    mods = _command_modules()
    if not any(getattr(m, "NAME", m.__name__.rsplit(".", 1)[1]) == "run" for m in mods):
        p.epilog = NO_PLUGINS
    for mod in mods:
        name = getattr(mod, "NAME", mod.__name__.rsplit(".", 1)[1].replace("_", "-"))
        sp = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                            formatter_class=HelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # a command may re-run itself (under torchrun)
    try:
        rc = args._run(args)
    except CortiqError as e:
        print("cortiq: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cortiq: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"cortiq: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except MemoryError:
        print("cortiq: out of memory", file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001 (the last resort: a bug, reported as one)
        import traceback

        traceback.print_exc()
        print(f"cortiq: this is a bug in cortiq, not a problem with your input: please file it with the command "
              f"line ({' '.join(sys.argv[1:] if argv is None else argv)[:200]}) and the traceback above",
              file=sys.stderr)
        return 70
    return int(rc or 0)


def entry() -> None:
    """The `cortiq` console script: `main` on the process's own command line, then `exit.finish`."""
    from .exit import finish

    finish(main())


if __name__ == "__main__":
    entry()
