"""One rank of a stage that `cortiq.pipeline.run` relaunched under torchrun.

`python -m cortiq.pipeline_worker JOB.json`, started N times by torchrun, is
not a command for users: the job file (written by `write_job`) names the stage
(its module and name), the root, and the parameters as plain JSON (paths as
strings, the settings dataclass as its dict, built again by `Stage.params`:
the same settings, so the same digest). Nothing is pickled either way.

Each rank joins the process group and calls `pipeline.run` with the job's
parameters. Beside the job file:
- `log.jsonl`: what rank 0's stage logged (`tracking.JsonlLogger`), played
  into the caller's logger once the ranks are done;
- `result.json`: rank 0's outcome (digest, reused), written last;
- `error-R.txt`: rank R's error in one line, when it failed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

from . import dist, pipeline, tracking
from .errors import CortiqError

JOB, LOG, RESULT = "job.json", "log.jsonl", "result.json"
VERSION = 1


def _plain(x, where: str):
    """`x` as JSON values: a dataclass as its dict, a path as its string; anything else is refused."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CortiqError(f"parameter {where}: a {type(x).__name__} cannot be handed to the ranks (paths, settings and "
                      f"plain values only)")


def _stage_ref(stage: pipeline.Stage) -> dict:
    """Where a rank finds `stage`: the module its `make` lives in, and its name there."""
    mod = stage.make.__module__
    if find_stage(mod, stage.name) is not stage:
        raise CortiqError(f"{stage.name}: not a module-level stage of {mod}; it cannot run under torchrun")
    return {"module": mod, "name": stage.name}


def find_stage(module: str, name: str) -> pipeline.Stage | None:
    """The stage called `name` among `module`'s globals (None when it has none)."""
    m = importlib.import_module(module)
    for v in vars(m).values():
        if isinstance(v, pipeline.Stage) and v.name == name:
            return v
    return None


def job_params(stage: pipeline.Stage, params: dict) -> dict:
    """The parameters as the job file holds them (what `Stage.params` builds the same settings from)."""
    return {k: _plain(v, f"{stage.name}.{k}") for k, v in params.items()}


def write_job(d: Path, stage: pipeline.Stage, root, progress: bool, params: dict) -> Path:
    """The job file of one relaunched stage run in the folder `d`."""
    job = {"version": VERSION, "stage": _stage_ref(stage), "root": os.fspath(Path(root).resolve()),
           "progress": bool(progress), "params": job_params(stage, params)}
    path = Path(d) / JOB
    path.write_text(json.dumps(job, indent=1, allow_nan=True))
    return path


def read_job(path: Path) -> tuple[pipeline.Stage, str, bool, dict]:
    """(stage, root, progress, params) of a job file."""
    try:
        job = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CortiqError(f"{path}: not a stage job ({e})") from None
    if not isinstance(job, dict) or job.get("version") != VERSION:
        raise CortiqError(f"{path}: not a stage job of version {VERSION}")
    ref = job["stage"]
    stage = find_stage(ref["module"], ref["name"])
    if stage is None:
        raise CortiqError(f"{path}: no stage {ref['name']!r} in {ref['module']}")
    return stage, job["root"], job["progress"], job["params"]


def rank_errors(d: Path) -> str:
    """The errors the ranks left in `d`, in rank order, the ranks that met the same
    one named together: 'ranks 0, 1: ERROR; rank 2: ...' ('' when none did)."""
    found = sorted(Path(d).glob("error-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    by: dict[str, list[str]] = {}
    for p in found:
        by.setdefault(p.read_text().strip(), []).append(p.stem.split("-")[1])
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {e}" for e, r in by.items())


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not dist.under_torchrun():
        print("cortiq.pipeline_worker: runs one rank of a stage under torchrun (started by cortiq.pipeline.run)",
              file=sys.stderr)
        return 2
    path = Path(argv[0])
    d = path.parent
    try:
        stage, root, progress, params = read_job(path)
        dist.init()
        logger = tracking.JsonlLogger(d / LOG) if dist.is_main() else tracking.NULL
        r = pipeline.run(stage, root, logger, progress, **params)
        if dist.is_main():
            _write(d / RESULT, json.dumps({"digest": r["digest"], "reused": r["reused"]}))
    except CortiqError as e:
        # one line, said once by the caller (every rank may meet the same bad input)
        _write(d / f"error-{dist.rank()}.txt", str(e))
        return 1
    except BaseException as e:
        # a bug, or a failure injected by a test: the traceback goes to stderr, its last line to the caller
        _write(d / f"error-{dist.rank()}.txt", f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    finally:
        dist.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
