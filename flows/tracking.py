"""MLflow tracking for the flows: one MLflow run per flow run.

Everything goes through `MlflowClient` with an explicit run id, never the
fluent active-run API: the active run is per thread, and a Prefect task in
another thread would silently open a stray run (measured with MLflow 3). mlflow is imported
lazily (it takes ~1.5 s).

Metrics are sent in batches: on a SQLite store each `log_batch` is a few commits,
so one call per training step or per history row cost a tiny run more than its
training did. A run's loggers share one queue that
is sent when a second has passed since the last send (training curves stay live
to the second), at every stage's end and when the run ends.

A flow run keeps a record under the cortiq home (`runs/<flow run id>.json`)
locked for as long as its process lives: a record whose lock can be taken
belongs to a process that died without ending its runs (kill -9, power), and
the next flow run to start marks those runs crashed in Prefect and failed in
MLflow instead of leaving them RUNNING forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from cortiq import store
from cortiq.tracking import flatten

#: MLflow rejects param values longer than this
_PARAM_MAX = 6000


#: MLflow's limit of metrics in one log_batch
_METRICS_MAX = 1000


class _Pending:
    """The metrics of one run not yet sent: sent when `every` seconds have passed since the
    last send, when the batch limit is reached, or on `flush`."""

    def __init__(self, client, run_id: str, every: float = 1.0):
        self.client, self.run_id, self.every = client, run_id, every
        self.items: list = []
        self.sent = time.monotonic()
        self.lock = threading.Lock()

    def add(self, items: list) -> None:
        with self.lock:
            self.items += items
            due = len(self.items) >= _METRICS_MAX or time.monotonic() - self.sent >= self.every
        if due:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            items, self.items = self.items, []
            self.sent = time.monotonic()
            for i in range(0, len(items), _METRICS_MAX):
                self.client.log_batch(self.run_id, metrics=items[i:i + _METRICS_MAX])


class MlflowLogger:
    """cortiq.tracking.Logger onto one MLflow run (`prefix` is put before metric names).
    A logger and its children share the run's queue of metrics (`flush` sends it)."""

    def __init__(self, client, run_id: str, prefix: str = "", pending: _Pending | None = None):
        self.client = client
        self.run_id = run_id
        self.prefix = prefix
        self.pending = pending if pending is not None else _Pending(client, run_id)

    def child(self, prefix: str) -> "MlflowLogger":
        return MlflowLogger(self.client, self.run_id, self.prefix + prefix, self.pending)

    def flush(self) -> None:
        """Send the metrics logged so far."""
        self.pending.flush()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(self.prefix + k, str(v)[:_PARAM_MAX]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.log_rows([(step, metrics)])

    def log_rows(self, rows: list[tuple[int | None, dict[str, float]]]) -> None:
        """Metrics of several steps at once ([(step, {name: value})]: a stage's history)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(self.prefix + k, float(v), ts, int(step or 0)) for step, metrics in rows
                 for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if items:
            self.pending.add(items)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit for tags
            self.client.log_batch(self.run_id, tags=items[i:i + 100])


def client_for(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith("sqlite:"):
        # beside the database, not ./mlruns under whatever directory the run started in
        db = Path(uri.split("sqlite:///", 1)[-1])
        location = (db.parent / "mlartifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


def _db_lock(uri: str):
    """The lock of a SQLite tracking store (two runs creating its tables or the same
    experiment at once fail); other stores need none."""
    if uri.startswith("sqlite:///"):
        return store.locked(Path(uri[len("sqlite:///"):]))
    return contextlib.nullcontext()


@contextlib.contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> Iterator[MlflowLogger]:
    """An MLflow run for the body: FINISHED when it returns, FAILED when it raises. Runs
    that a killed process left RUNNING are ended first (`recover_crashed`)."""
    recover_crashed()
    with _db_lock(uri):
        client = client_for(uri)
        exp = experiment_id(client, experiment, uri)
        run = client.create_run(exp, run_name=run_name, tags=tags)
    log = MlflowLogger(client, run.info.run_id)
    with run_record(tags.get("prefect.flow_run_id", ""), run.info.run_id, uri):
        try:
            yield log
        except BaseException:
            with contextlib.suppress(Exception):  # what the failed stage logged; its error is the one raised
                log.flush()
            client.set_terminated(run.info.run_id, "FAILED")
            raise
        log.flush()
        client.set_terminated(run.info.run_id, "FINISHED")


def runs_dir() -> Path:
    return store.home() / "runs"


@contextlib.contextmanager
def run_record(flow_run_id: str, mlflow_run_id: str, uri: str) -> Iterator[Path]:
    """The record of a live flow run, locked by this process until the body ends (the
    kernel drops the lock when the process dies, however it dies)."""
    d = runs_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{flow_run_id or mlflow_run_id}.json"
    tmp = d / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # locked before it is visible under its name: a scan never takes a live run's record
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"flow_run_id": flow_run_id, "mlflow_run_id": mlflow_run_id, "tracking_uri": uri,
                                 "pid": os.getpid(), "started": time.time()}).encode())
        os.replace(tmp, path)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
        os.close(fd)


def recover_crashed() -> list[dict]:
    """Mark the runs of dead processes (records under runs_dir() whose lock is free) Crashed
    in Prefect and FAILED in MLflow, then drop their records. Returns the records handled."""
    d = runs_dir()
    done = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # another process handled it
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            if not path.exists():  # handled and removed while this one waited
                continue
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                rec = {}
            why = f"cortiq: the process running it (pid {rec.get('pid', '?')}) died without ending it"
            try:
                if rec.get("flow_run_id"):
                    _crash_flow_run(rec["flow_run_id"], why)
                if rec.get("mlflow_run_id") and rec.get("tracking_uri"):
                    _fail_mlflow_run(rec["tracking_uri"], rec["mlflow_run_id"], why)
            except Exception as e:  # a store that is gone must not stop the new run
                print(f"cortiq: {path}: could not end the crashed run ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            path.unlink(missing_ok=True)
            done.append(rec)
        finally:
            os.close(fd)
    return done


def _crash_flow_run(flow_run_id: str, why: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        try:
            fr = client.read_flow_run(flow_run_id)
        except ObjectNotFound:  # a run of another Prefect server's database
            return
        if fr.state is None or not fr.state.is_final():
            client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)


def _fail_mlflow_run(uri: str, run_id: str, why: str) -> None:
    from mlflow.exceptions import MlflowException

    client = client_for(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return
    if run.info.status == "RUNNING":
        client.set_tag(run_id, "cortiq.crashed", why)
        client.set_terminated(run_id, "FAILED")


def log_model_file(log: MlflowLogger, path: str | Path, limit_mb: float, artifact_path: str = "models") -> None:
    """A CMF file as an artifact, or, above `limit_mb`, a JSON reference (path, bytes, sha256)."""
    import hashlib

    from cortiq.cmf import open_cmf

    path = Path(path)
    files = open_cmf(path).paths
    size = sum(p.stat().st_size for p in files)
    if size <= limit_mb * 1e6:
        for p in files:
            log.log_artifact(str(p), artifact_path)
        return
    ref = {"path": str(path.resolve()), "bytes": size, "sha256": {}}
    for p in files:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        ref["sha256"][p.name] = h.hexdigest()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / f"{path.name}.ref.json"
        out.write_text(json.dumps(ref, indent=1))
        log.log_artifact(str(out), artifact_path)


def log_json(log: MlflowLogger, name: str, obj: Any, artifact_path: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        p.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
        log.log_artifact(str(p), artifact_path)
