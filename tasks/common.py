"""What every stage task shares: the plan (digest and output path) and running
a stage at most once per digest.

The cache is the stage outputs themselves, not Prefect's result store: a task
reuses an output whose `meta.json` and JSON report are complete and reports
itself Cached, else runs the stage. Prefect's persisted results are records
whose own header names their serializer, pickle included, so a file replaced
under the cortiq home would run code when read back: no task persists a
result, and nothing under the cortiq home is unpickled. A deleted output is
simply not complete any more, so it is recomputed, never a dead path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cortiq import store
from cortiq.errors import CortiqError

#: a stage name here makes that stage's task raise before it runs: how tests inject a failure
FAIL_ENV = "CORTIQ_FAIL_STAGE"


class InjectedFailure(RuntimeError):
    """Raised by a stage named in $CORTIQ_FAIL_STAGE (tests of retry-from-cache)."""


@dataclass(frozen=True)
class Plan:
    """Where a stage's output goes, named by its digest."""

    stage: str
    digest: str
    #: the output: a stage directory, or a .cmf file
    out: Path
    #: the stage's report (JSON), written beside the output once the output is complete
    report: Path

    def ready(self) -> bool:
        """True when the output and its report are complete (a cache hit may hand them out)."""
        if not self.report.is_file():
            return False
        if self.out.suffix == ".cmf":
            from cortiq.cmf import CmfError, open_cmf

            try:
                open_cmf(self.out)
            except CmfError:
                return False
            return True
        return store.is_complete(self.out)


def input_digest(path: str | os.PathLike | None) -> str | None:
    return None if path is None else store.file_digest(path)


def plan(stage: str, version: Any, settings: Any, inputs: dict[str, Any], out_root: str | os.PathLike,
         kind: str = "dir") -> Plan:
    """The plan of a stage run: digest over (stage, version, settings, named input digests).

    `inputs` maps names to paths (digested by content: a CMF's tensor hashes, a
    stage directory's digest) or to already-known digests given as {"digest": d}."""
    named = []
    for k in sorted(inputs):
        v = inputs[k]
        d = v["digest"] if isinstance(v, dict) else input_digest(v)
        named.append(f"{k}={d}")
    d = store.digest(stage, version, settings, named)
    root = Path(out_root)
    out = root / (f"{stage}-{d}.cmf" if kind == "cmf" else f"{stage}-{d}")
    return Plan(stage, d, out, root / f"{stage}-{d}.report.json")


def stage_task(name: str):
    """A Prefect task around a stage function that returns `execute`'s dict: no
    result persisted, no Prefect cache (the stage output is the cache); a reused
    output puts the task run in the Cached state."""
    import functools

    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.states import Completed

    def wrap(fn):
        @functools.wraps(fn)
        def body(*args, **kwargs):
            r = fn(*args, **kwargs)
            return Completed(name="Cached", data=r) if isinstance(r, dict) and r.get("reused") else r

        return task(name=name, persist_result=False, cache_policy=NO_CACHE)(body)

    return wrap


def execute(p: Plan, call: Callable[[Path], dict]) -> dict:
    """Run a stage once per digest: reuse a complete output, else `call(out)`
    (which writes the output atomically and returns the stage's report), then
    write the report beside it. Returns {stage, digest, path, report, reused}.

    The output is locked while it is checked and made: a second run on the
    same cortiq home waits for the first to finish it, then reuses it."""
    p.out.parent.mkdir(parents=True, exist_ok=True)
    with store.locked(p.out):
        if p.ready():
            report = json.loads(p.report.read_text())
            return {"stage": p.stage, "digest": p.digest, "path": str(p.out), "report": report, "reused": True}
        if os.environ.get(FAIL_ENV) == p.stage:
            raise InjectedFailure(f"{p.stage}: failure injected by ${FAIL_ENV}")
        report = call(p.out)
        if report is None:
            report = {}
        if not isinstance(report, dict):
            raise CortiqError(f"{p.stage}: the stage returned {type(report).__name__}, not a report dict")
        if p.out.suffix != ".cmf" and not store.is_complete(p.out):
            raise CortiqError(f"{p.out}: the {p.stage} stage returned without finishing its output (no meta.json)")
        if p.out.suffix == ".cmf" and not p.out.is_file():
            raise CortiqError(f"{p.out}: the {p.stage} stage returned without writing its model")
        tmp = p.report.with_name(p.report.name + ".partial")
        tmp.write_text(json.dumps(report, indent=1, sort_keys=True, default=_jsonable))
        os.replace(tmp, p.report)
        return {"stage": p.stage, "digest": p.digest, "path": str(p.out), "report": json.loads(p.report.read_text()),
                "reused": False}


def _jsonable(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, Path):
        return str(x)
    return str(x)
