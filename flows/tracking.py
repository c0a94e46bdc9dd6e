"""MLflow tracking for the flows: one MLflow run per flow run.

Everything goes through `MlflowClient` with an explicit run id, never the
fluent active-run API: the active run is per thread, and a Prefect task in
another thread would silently open a stray run (STACK.md). mlflow is imported
lazily (it takes ~1.5 s).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from cortiq import store
from cortiq.tracking import flatten

#: MLflow rejects param values longer than this
_PARAM_MAX = 6000


class MlflowLogger:
    """cortiq.tracking.Logger onto one MLflow run (`prefix` is put before metric names)."""

    def __init__(self, client, run_id: str, prefix: str = ""):
        self.client = client
        self.run_id = run_id
        self.prefix = prefix

    def child(self, prefix: str) -> "MlflowLogger":
        return MlflowLogger(self.client, self.run_id, self.prefix + prefix)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(self.prefix + k, str(v)[:_PARAM_MAX]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(self.prefix + k, float(v), ts, int(step or 0)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))


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


@contextlib.contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> Iterator[MlflowLogger]:
    """An MLflow run for the body: FINISHED when it returns, FAILED when it raises."""
    client = client_for(uri)
    exp = experiment_id(client, experiment, uri)
    run = client.create_run(exp, run_name=run_name, tags=tags)
    log = MlflowLogger(client, run.info.run_id)
    try:
        yield log
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_terminated(run.info.run_id, "FINISHED")


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


def default_uri() -> str:
    return f"sqlite:///{(store.home() / 'mlflow.db').resolve()}"
