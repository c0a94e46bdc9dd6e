"""The logger interface stages report through.

cortiq never imports mlflow: a stage takes a `Logger` and calls it; the flows
pass one that writes to MLflow (through `MlflowClient` with a run id, see
flows/tracking.py), tests and plain scripts pass `NullLogger` (the default) or
`MemoryLogger`. Stages also return everything they measured in their report,
so a cached task's metrics can be logged from its result.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

from .errors import CortiqError


class Logger(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...


class NullLogger:
    """Drops everything."""

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step=None):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass

    def set_tags(self, tags):
        pass


class MemoryLogger:
    """Keeps everything in lists (tests, and a summary at the end of a run)."""

    def __init__(self):
        self.params: dict[str, Any] = {}
        self.metrics: list[tuple[str, float, int | None]] = []
        self.artifacts: list[tuple[str, str | None]] = []
        self.tags: dict[str, str] = {}

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.metrics += [(k, float(v), step) for k, v in metrics.items()]

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((str(path), artifact_path))

    def set_tags(self, tags):
        self.tags.update(tags)

    def series(self, key: str) -> list[tuple[int | None, float]]:
        return [(s, v) for k, v, s in self.metrics if k == key]


NULL = NullLogger()


class JsonlLogger:
    """Appends every call as one JSON line to a file: the logger of a process
    that cannot reach its caller's (rank 0 of a stage run under torchrun); the
    caller plays the file into its own logger with `replay`. A line is written
    and closed per call, so a killed process leaves every call but a torn last line."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def _put(self, call: str, **args) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"call": call, **args}, default=str) + "\n")

    def log_params(self, params):
        self._put("log_params", params=dict(params))

    def log_metrics(self, metrics, step=None):
        self._put("log_metrics", metrics={k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path, artifact_path=None):
        self._put("log_artifact", path=os.fspath(path), artifact_path=artifact_path)

    def set_tags(self, tags):
        self._put("set_tags", tags=dict(tags))


def replay(path: str | os.PathLike, logger: Logger) -> int:
    """Play the calls a `JsonlLogger` wrote to `path` into `logger`, in order
    (none when the file is absent; a torn last line is dropped). -> calls played."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return 0
    n = 0
    for line in lines[:-1]:  # the text after the last newline is empty, or torn
        rec = json.loads(line)
        call = rec.pop("call")
        if call not in ("log_params", "log_metrics", "log_artifact", "set_tags"):
            raise CortiqError(f"{path}: unknown logger call {call!r}")
        getattr(logger, call)(**rec)
        n += 1
    return n


class Scoped:
    """A logger whose metric names start with `prefix` (a stage's name and a dot)."""

    def __init__(self, inner: Logger, prefix: str):
        self.inner, self.prefix = inner, prefix

    def log_params(self, params):
        self.inner.log_params({self.prefix + k: v for k, v in params.items()})

    def log_metrics(self, metrics, step=None):
        self.inner.log_metrics({self.prefix + k: v for k, v in metrics.items()}, step=step)

    def log_artifact(self, path, artifact_path=None):
        self.inner.log_artifact(path, artifact_path)

    def set_tags(self, tags):
        self.inner.set_tags(tags)


def scoped(logger: Logger, prefix: str) -> Logger:
    """`logger` with `prefix` before every metric and param name (the null logger stays itself)."""
    if isinstance(logger, NullLogger):
        return logger
    child = getattr(logger, "child", None)
    return child(prefix) if child else Scoped(logger, prefix)


def flatten(d: dict, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested settings as flat `a.b.c` params (lists joined as strings)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key, sep))
        elif isinstance(v, (list, tuple)):
            out[key] = ",".join(str(x) for x in v)
        else:
            out[key] = v
    return out
