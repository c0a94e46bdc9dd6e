"""Package exports that load their module on first use (so `--help` and the
settings dataclasses stay free of torch and Arrow)."""

from __future__ import annotations

import importlib
import sys
import types


def exports(package: str, names: dict[str, str]):
    """`(__getattr__, __dir__, __all__)` for `package` whose `names` map an
    exported name to the submodule defining it.

    An export named like its own submodule (`cortiq.data.build`, the function
    in `cortiq.data.build`, the module) stays the function: importing the
    submodule would otherwise rebind the package's name to the module, and
    `from cortiq.data import build` would hand out a module or a function
    depending on what some other code imported first."""
    clashes = {n for n, m in names.items() if n == m}
    if clashes:
        class _Package(types.ModuleType):
            def __setattr__(self, key, value):
                if key in clashes and isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{key}":
                    return  # the import system binding the submodule: the name stays the export
                super().__setattr__(key, value)

        sys.modules[package].__class__ = _Package

    def __getattr__(name: str):
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    all_ = sorted(names)
    return __getattr__, (lambda: all_), all_
