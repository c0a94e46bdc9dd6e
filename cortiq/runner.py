"""A pipeline stage, declared once, and the one runner every caller goes through.

Each stage is declared in its package's stages.py (cortiq/<package>/stages.py;
the score and re-encode stages in cortiq/measure.py). A `Stage` names what it makes (`name`, also the folder prefix of its outputs,
the Prefect task's name and the prefix of its metrics), its `version`, its
settings dataclass, which parameters are inputs (paths digested by content),
which other parameters its output depends on (`extra`), and the function that
makes it. `run` is the cache: the output's digest is a hash of (name, version,
key, the inputs' digests), the key being the settings fields that feed the
stage (one rule, `key_of`: each field's declaration says whether it is a *how*
field, which enters no digest, and which stages it feeds) beside the `extra`
parameters; a complete output with that digest is reused, else the
stage runs into a fresh output (a directory finished by `meta.json` last, or a
CMF written to `.partial` and renamed), and its report (JSON) is written last,
under the root's reports/. The command line (`cortiq compress`, `cortiq heal`)
and the Prefect tasks call the same `run` with the same stages, so they share
one cache: a `cortiq compress` followed by `cortiq run compress` on the same
source, data and settings reuses the masks, Grams and student.

Settings that say *how* (device, compute dtype, GPUs, memory plans, output
paths) reach the stage in its settings but enter no digest: the same output on
any device.

More than one GPU: a stage whose settings say `gpus: N > 1` (its `gpus` hook),
run from a plain process, runs as N processes under torchrun, each rank
calling `run` itself (cortiq.runner_worker); the caller gets back what an
in-process run returns, and the metrics rank 0 logged are played into the
caller's logger. The digest does not depend on N.

The cache is the outputs themselves, never a pickled result: nothing under the
cortiq home is unpickled. A deleted output is simply not complete any more,
so it is recomputed, never a dead path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import store, tracking
from .errors import CortiqError

#: a stage name here makes that stage raise before it runs: how tests inject a failure
#: ("NAME@R": only rank R of a stage run under torchrun raises)
FAIL_ENV = "CORTIQ_FAIL_STAGE"


class InjectedFailure(RuntimeError):
    """Raised by a stage named in $CORTIQ_FAIL_STAGE (tests of retry-from-cache)."""


@dataclass(frozen=True)
class Context:
    """What a running stage gets besides its parameters."""

    #: the output's digest (a stage that records it in its meta.json reads it here, never from a folder name)
    digest: str
    logger: tracking.Logger = tracking.NULL
    progress: bool = True


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline."""

    #: the stage's one name: output folder prefix, task name, flow key and metric prefix
    name: str
    #: bumped when what the stage computes changes (old outputs are then not reused); the digest
    #: hashes it as text, as it did when versions were written as strings
    version: int
    #: make(out, ctx, **params) -> the stage's report ({"metrics": {...}, ...}); writes `out`
    make: Callable[..., dict]
    #: the settings dataclass the stage takes (`params` builds it from the dict that arrives at an
    #: edge: a Prefect task's parameters, a torchrun job)
    settings: type | None = None
    #: parameters that are input paths, digested by content (None: absent, digested as "-")
    inputs: tuple[str, ...] = ()
    #: params -> the parameters beside the settings and the inputs that the output depends on
    #: (a codec, the names of the sources), as a dict that joins the settings' part of the key;
    #: never the settings: which of their fields enter the digest their declarations say (`key_of`)
    extra: Callable[[dict], dict] | None = None
    #: how the settings' part of the key is laid out for hashing, so that the outputs made
    #: before a stage had its fields declared keep their digests: (name, (field, ...)) puts
    #: those fields' values as a list under `name`, (name, None) the whole part under `name`
    #: (pairs, not a dict: a stage is hashable, the flows' task is cached per stage)
    layout: tuple = ()
    #: "dir" (a directory finished by meta.json) or "cmf" (one model file)
    output: str = "dir"
    #: params -> params, before anything else (e.g. an input the settings make irrelevant set to None)
    normalize: Callable[[dict], dict] | None = None
    #: what the stage makes, for the task's description
    doc: str = ""
    #: params -> how many processes (one per GPU) the stage runs as; more than one
    #: from a process not under torchrun already relaunches it under torchrun
    #: (None: a stage that runs in one process only)
    gpus: Callable[[dict], int] | None = None

    def __post_init__(self):
        if type(self.version) is not int:  # one way to write it: 1, bumped to 2, ...
            raise TypeError(f"stage {self.name}: version {self.version!r} is not a whole number")

    def params(self, params: dict) -> dict:
        """The parameters with `settings` built into its dataclass (where it came as a dict) and
        `normalize` applied."""
        p = dict(params)
        if self.settings is not None and isinstance(p.get("settings"), dict):
            p["settings"] = _build(self.settings, p["settings"], self.name)
        return self.normalize(p) if self.normalize else p


def key_of(stage: Stage, settings) -> Any:
    """The settings' part of `stage`'s key: the fields of `settings` that feed the stage
    (`settings_meta.what`: no how field, no field that feeds only other stages), laid out
    as the stage's `layout` says. None where the stage has no settings."""
    from .settings_meta import what

    if settings is None:
        return None
    part = what(settings, stage.name)
    for name, fields in stage.layout:
        if fields is None:
            part = {name: part}
        else:
            part = {**{k: v for k, v in part.items() if k not in fields}, name: [part[f] for f in fields]}
    return part


def _key(stage: Stage, p: dict) -> Any:
    """The whole key of a stage run: the settings' part (`key_of`) and the `extra` parameters."""
    part = key_of(stage, p.get("settings"))
    if stage.extra is None:
        return part
    return {**(part or {}), **stage.extra(p)}


def settings_gpus(params: dict) -> int:
    """The `gpus` of a stage's settings (the `gpus` hook of the stages that can run on several ranks)."""
    return int(params["settings"].gpus)


def _build(cls, values: dict, stage: str):
    try:
        return cls(**values)
    except TypeError as e:
        raise CortiqError(f"{stage}: bad settings ({e})") from None


@dataclass(frozen=True)
class CacheEntry:
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
            from .cmf import CmfError, open_cmf

            try:
                open_cmf(self.out)
            except CmfError:
                return False
            return True
        return store.is_complete(self.out)


def input_digest(value) -> str:
    """An input's digest: "-" for an absent one, {"digest": d} as given, a path by its content;
    a data spec that names no path (`PATH[@TOKENS],...`, the MTP stages' data) by each path's
    content and token count (a spec of one path and no count is that path's digest)."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return str(value["digest"])
    if isinstance(value, str) and not os.path.lexists(value) and ("," in value or "@" in value):
        sets = store.parse_data_spec(value)
        if len(sets) > 1 or sets[0][1] is not None:
            return ",".join(f"{store.file_digest(p)}@{n if n is not None else ''}" for p, n in sets)
        value = sets[0][0]
    return store.file_digest(value)


def cache_entry(stage: Stage, root: str | os.PathLike, **params) -> CacheEntry:
    """Where a stage run's output goes: its digest over (name, version, key, named input digests) and its paths."""
    p = stage.params(params)
    missing = [n for n in stage.inputs if n not in p]
    if missing:
        raise CortiqError(f"{stage.name}: missing inputs {missing}")
    key = _key(stage, p)
    named = [f"{n}={input_digest(p[n])}" for n in sorted(stage.inputs)]
    d = store.digest(stage.name, stage.version, key, named)
    root = Path(root)
    out = root / (f"{stage.name}-{d}.cmf" if stage.output == "cmf" else f"{stage.name}-{d}")
    # reports live apart, so the outputs are all a folder holds under their names
    return CacheEntry(stage.name, d, out, root / "reports" / f"{stage.name}-{d}.json")


def digest_of(stage: Stage, **params) -> str:
    """The digest `run` names the output by (a stage records it in its meta.json)."""
    return cache_entry(stage, ".", **params).digest


def run(stage: Stage, root: str | os.PathLike, logger: tracking.Logger = tracking.NULL, progress: bool = True,
        **params) -> dict:
    """Run `stage` once per digest under `root`: reuse a complete output, else
    make it, then write its report beside it. Returns {stage, digest, path,
    report, reused}.

    The output is locked while it is checked and made: a second process on the
    same root waits for the first to finish it, then reuses it.

    A stage whose `gpus` hook says N > 1, called from a process that torchrun
    did not start, runs as N processes under torchrun (`_relaunch`)."""
    from . import dist

    entry = cache_entry(stage, root, **params)
    p = stage.params(params)
    n = stage.gpus(p) if stage.gpus is not None else 1
    if n > 1 and not dist.under_torchrun():
        return _relaunch(stage, entry, root, logger, progress, n, params)
    entry.out.parent.mkdir(parents=True, exist_ok=True)
    # under torchrun every rank runs a stage that splits (each its share of the windows) and
    # rank 0 decides, locks and reports for all: a lock per rank would deadlock the stage's
    # collectives. A stage that runs in one process only (no `gpus` hook) runs in the calling
    # process alone, without a collective: rank 0 exports and scores while the others are done
    alone = stage.gpus is None
    main = dist.is_main() or alone
    with store.locked(entry.out) if main else contextlib.nullcontext():
        if (entry.ready() if alone else dist.agree(entry.ready())):
            return _result(entry, reused=True)
        if _injected(stage.name, dist.rank()):
            raise InjectedFailure(f"{stage.name}: failure injected by ${FAIL_ENV}")
        report = stage.make(entry.out, Context(entry.digest, logger, progress), **p)
        if not alone:
            dist.barrier()
        if main:
            _finish(stage, entry, report)
        if not alone:
            dist.barrier()
        return _result(entry, reused=False)


def _injected(name: str, rank: int) -> bool:
    """$CORTIQ_FAIL_STAGE names this stage (and this rank, when it names one)."""
    want, at, r = os.environ.get(FAIL_ENV, "").partition("@")
    return want == name and (not at or r == str(rank))


def _relaunch(stage: Stage, entry: CacheEntry, root, logger: tracking.Logger, progress: bool, n: int,
              params: dict) -> dict:
    """`run` as n processes under torchrun on this machine: the stage, root and
    parameters go to the ranks as a JSON job (settings as plain dicts, built
    again by each rank: the same digest), each rank calls `run`, rank 0 writes
    the outcome and logs its metrics to a JSONL file that is played into
    `logger` here. A complete output is reused without starting any rank.

    A failed rank fails the run (torchrun stops the others): CortiqError naming
    the stage, the exit status and the rank's error. The output is then not
    complete: a directory gets `meta.json` and the report is written only once
    every rank has finished, a model is renamed from `.partial` only when written."""
    import shutil
    import tempfile

    from . import dist

    if entry.ready():
        return _result(entry, reused=True)
    job = Path(tempfile.mkdtemp(prefix=f"cortiq-{stage.name}-{entry.digest[:12]}-"))
    try:
        spec = write_job(job, stage, root, progress, params)
        rc = dist.launch([str(spec)], n, module="cortiq.runner_worker")
        tracking.replay(job / LOG, logger)
        if rc != 0:
            why = rank_errors(job)
            raise CortiqError(f"{stage.name}: {n} processes under torchrun exited with status {rc}"
                              + (f" ({why})" if why else "") + f"; {entry.out} was not completed")
        done = json.loads((job / RESULT).read_text())
    finally:
        shutil.rmtree(job, ignore_errors=True)
    if done["digest"] != entry.digest:
        raise CortiqError(f"{stage.name}: the ranks ran digest {done['digest']}, this process expected {entry.digest}")
    if not entry.ready():
        raise CortiqError(f"{entry.out}: the {stage.name} stage's ranks exited without completing it")
    return _result(entry, reused=bool(done["reused"]))


# ── a stage relaunched under torchrun: the job the ranks get, what they hand back ──

#: the files of a relaunched run, in a folder of its own: the job (written by the
#: caller), rank 0's logger calls (JSONL) and outcome, and a line per failed rank
JOB, LOG, RESULT = "job.json", "log.jsonl", "result.json"
JOB_VERSION = 1


def _json_value(x, where: str):
    """`x` as JSON values: a dataclass as its dict, a path as its string; anything else is refused.
    The one flattening of settings: `Stage.params` builds the same dataclass back, so the digest
    a stage gets its parameters from either side of an edge is the same."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, dict):
        return {str(k): _json_value(v, f"{where}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CortiqError(f"parameter {where}: a {type(x).__name__} cannot leave the process (paths, settings and "
                      f"plain values only)")


def _stage_ref(stage: Stage) -> dict:
    """Where a rank finds `stage`: the module its `make` lives in, and its name there."""
    mod = stage.make.__module__
    if find_stage(mod, stage.name) is not stage:
        raise CortiqError(f"{stage.name}: not a module-level stage of {mod}; it cannot run under torchrun")
    return {"module": mod, "name": stage.name}


def find_stage(module: str, name: str) -> Stage | None:
    """The stage called `name` among `module`'s globals (None when it has none)."""
    m = importlib.import_module(module)
    for v in vars(m).values():
        if isinstance(v, Stage) and v.name == name:
            return v
    return None


def json_params(stage: Stage, params: dict) -> dict:
    """The parameters as they leave the process, as JSON values: a Prefect task's parameters, a
    torchrun job (what `Stage.params` builds the same settings from on the other side)."""
    return {k: _json_value(v, f"{stage.name}.{k}") for k, v in params.items()}


def write_job(d: Path, stage: Stage, root, progress: bool, params: dict) -> Path:
    """The job file of one relaunched stage run in the folder `d`."""
    job = {"version": JOB_VERSION, "stage": _stage_ref(stage), "root": os.fspath(Path(root).resolve()),
           "progress": bool(progress), "params": json_params(stage, params)}
    path = Path(d) / JOB
    path.write_text(json.dumps(job, indent=1, allow_nan=True))
    return path


def read_job(path: Path) -> tuple[Stage, str, bool, dict]:
    """(stage, root, progress, params) of a job file."""
    try:
        job = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CortiqError(f"{path}: not a stage job ({e})") from None
    if not isinstance(job, dict) or job.get("version") != JOB_VERSION:
        raise CortiqError(f"{path}: not a stage job of version {JOB_VERSION}")
    ref = job["stage"]
    stage = find_stage(ref["module"], ref["name"])
    if stage is None:
        raise CortiqError(f"{path}: no stage {ref['name']!r} in {ref['module']}")
    return stage, job["root"], job["progress"], job["params"]


def error_file(d: Path, rank: int) -> Path:
    """Where rank `rank` of a relaunched run leaves its error (one line)."""
    return Path(d) / f"error-{rank}.txt"


def rank_errors(d: Path) -> str:
    """The errors the ranks left in `d`, the first written first (the cause: a rank whose
    peer failed meets a closed connection after it), the ranks that met the same one named
    together: 'ranks 0, 1: ERROR; rank 2: ...' ('' when none did)."""
    found = sorted(Path(d).glob("error-*.txt"), key=lambda p: (p.stat().st_mtime_ns, int(p.stem.split("-")[1])))
    by: dict[str, list[str]] = {}
    for p in found:
        by.setdefault(p.read_text().strip(), []).append(p.stem.split("-")[1])
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(sorted(r, key=int))}: {e}" for e, r in by.items())


def _finish(stage: Stage, entry: CacheEntry, report) -> None:
    """Check the stage left a complete output, then write its report (last)."""
    if report is None:
        report = {}
    if not isinstance(report, dict):
        raise CortiqError(f"{stage.name}: the stage returned {type(report).__name__}, not a report dict")
    if stage.output == "cmf" and not entry.out.is_file():
        raise CortiqError(f"{entry.out}: the {stage.name} stage returned without writing its model")
    if stage.output != "cmf" and not store.is_complete(entry.out):
        raise CortiqError(f"{entry.out}: the {stage.name} stage returned without finishing its output (no meta.json)")
    entry.report.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(entry.report, json.dumps(report, indent=1, sort_keys=True, default=_jsonable))


def _result(entry: CacheEntry, reused: bool) -> dict:
    return {"stage": entry.stage, "digest": entry.digest, "path": str(entry.out),
            "report": json.loads(entry.report.read_text()), "reused": reused}


class LocalRunner:
    """The command line's runner of a chain (cortiq.chains): each stage through `run` under
    `root`, in this process. A flow's runner (flows.common.Stages) has the same two members, with
    each stage run as a Prefect task: `run(stage, key=None, **params)` (`key`, default the stage's
    name, names the run among the chain's: `score.healed`, its metrics logged under it) and
    `results` (key -> the runner's result, in the order run)."""

    def __init__(self, root, logger: tracking.Logger = tracking.NULL, progress: bool = True, say=None):
        self.root, self.logger, self.progress = Path(root), logger, progress
        self.say = say or (lambda m: None)
        self.results: dict[str, dict] = {}

    def run(self, stage: Stage, key: str | None = None, **params) -> dict:
        key = key or stage.name
        r = run(stage, self.root, tracking.scoped(self.logger, f"{key}."), self.progress, **params)
        if r["reused"]:
            self.say(f"{key}: reusing {r['path']}")
        self.results[key] = r
        return r


def deliver(result: dict, out: str | os.PathLike) -> Path:
    """Put a stage's CMF output at the user's path `out` (a hard link where the
    file system allows, else a copy; written to `.partial`, then renamed)."""
    import shutil

    src, out = Path(result["path"]), Path(out)
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    # a re-run finds `out` already linked to the cache entry; renaming a second link of the
    # same file over it does nothing, which would leave the `.partial` link behind
    if out.exists() and os.path.samefile(out, src):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    from .errors import writing

    try:
        os.link(src, tmp)
    except OSError:
        # another file system: a copy, whose full disk names the user's file (not the cache entry
        # the copy reads, which is what the OSError names) and leaves nothing half-written there
        try:
            with writing(out):
                shutil.copyfile(src, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, out)
    return out


def _jsonable(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)
