"""Package exports that load their module on first use (so `--help` and the
settings dataclasses stay free of torch and Arrow)."""

from __future__ import annotations

import importlib


def exports(package: str, names: dict[str, str]):
    """`(__getattr__, __dir__, __all__)` for `package` whose `names` map an
    exported name to the submodule defining it. An export named like its own
    submodule (`cortiq.data.build`, the function in `cortiq.data.build`, the
    module) stays the export whatever was imported first (see `shadow`)."""

    def __getattr__(name: str):
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    clashes = {n: m for n, m in names.items() if n == m}
    if clashes:
        shadow(package, clashes)
    all_ = sorted(names)
    return __getattr__, (lambda: all_), all_


def shadow(package: str, names: dict[str, str]) -> None:
    """Let `package`'s exported `names` (name -> the submodule defining it) win over its submodules
    of the same names (cortiq.compress.fold the module, cortiq.compress.fold the stage function):
    importing a submodule binds the package's attribute to the module, which these properties
    ignore, or `from package import fold` would hand out a module or a function depending on what
    some other code imported first; the modules stay importable through sys.modules."""
    import sys
    import types

    def prop(name: str, mod: str) -> property:
        return property(lambda _pkg: getattr(importlib.import_module(f"{package}.{mod}"), name),
                        lambda _pkg, _module: None)

    cls = type("Package", (types.ModuleType,), {n: prop(n, m) for n, m in names.items()})
    sys.modules[package].__class__ = cls
