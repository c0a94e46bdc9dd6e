"""Package exports that load their module on first use (so `--help` and the
settings dataclasses stay free of torch and Arrow)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def exports(package: str, names: dict[str, str]):
    """`(__getattr__, __dir__, __all__)` for `package` whose `names` map an
    exported name to the submodule defining it."""

    def __getattr__(name: str):
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        pkg = importlib.import_module(package)
        setattr(pkg, name, value)
        # importing a submodule (this one, or one it imports) binds its name on the
        # package: where an export has that name (`cortiq.data.windows` the function,
        # `cortiq.data.windows` the module), the export must win, or a later
        # `from package import windows` gets the module
        for n, m in names.items():
            if n != name and f"{package}.{n}" in sys.modules and isinstance(getattr(pkg, n, None), ModuleType):
                setattr(pkg, n, getattr(importlib.import_module(f"{package}.{m}"), n))
        return value

    all_ = sorted(names)
    return __getattr__, (lambda: all_), all_
