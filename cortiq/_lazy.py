"""Package exports that load their module on first use (so `--help` and the
settings dataclasses stay free of torch and Arrow)."""

from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
    """`(__getattr__, __dir__, __all__)` for `package` whose `names` map an
    exported name to the submodule defining it. No export may be named like a
    submodule of the package: importing a submodule binds its name on the
    package, so `from package import name` would hand out the module or the
    export depending on what some other code imported first (the check raises
    at the package's import, so a clash cannot ship)."""
    import pkgutil
    import sys

    subs = {m.name for m in pkgutil.iter_modules(sys.modules[package].__path__)}
    clashes = sorted(set(names) & subs)
    if clashes:
        raise ImportError(f"{package}: exports named like its submodules: {', '.join(clashes)}")

    def __getattr__(name: str):
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    all_ = sorted(names)
    return __getattr__, (lambda: all_), all_
