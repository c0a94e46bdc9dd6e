"""The flow machinery on real stages that exist without training: data, re-encode, score.

A flow of the same shape as compress_and_heal (flows.common.Stages, the same
tasks): caching on content digests, a deleted output recomputed, a failure
injected into a middle stage then a re-run that executes only that stage
onward, MLflow runs with params, metrics and plots.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
from prefect import flow

from cortiq.data.stages import DATA
from cortiq.measure import REENCODE
from cortiq.runner import FAIL_ENV, InjectedFailure
from cortiq.settings import load_settings
from cortiq.chains import data_text
from cortiq.measure import score_chain
from flows.flow_run import run_tracked
from flows.summary import summary


@flow(name="machinery")
def machinery(params: dict) -> dict:
    s = load_settings(params)
    with run_tracked(s, "machinery") as st:
        tdata = st.run(DATA, sources=s.data.sources, model=s.source, settings=s.data.build_settings())["path"]
        score_chain(st, {"source": s.source}, [data_text(s, tdata)])
        for codec in s.codecs:
            enc = st.run(REENCODE, f"reencode.{codec}", model=s.source, codec=codec)["path"]
            score_chain(st, {f"reencode.{codec}": enc}, [data_text(s, tdata)])
        st.artifacts({"source": s.source})
        return summary(st)


def _params(tiny, **kw):
    return {"name": "tiny", "source": tiny["model"],
            "data": {"sources": [tiny["corpus"]], "record_tokens": 64, "fractions": [0.6, 0.2, 0.2]},
            "codecs": ["q8"], "score_window": 32, **kw}


def _direct_nll(model_path, tdata, window: int) -> float:
    """The test split's NLL per scored token, computed here without cortiq's scorer:
    each record cut into windows of `window` tokens, one full forward each."""
    import torch
    import torch.nn.functional as F

    from cortiq.data import Tdata
    from cortiq.model import load_model

    model = load_model(model_path, dtype=torch.float32, device="cpu")
    total, count = 0.0, 0
    for r in Tdata.open(tdata).records("test"):
        ids = torch.as_tensor(r.ids.astype("int64"))
        first = max(int(r.first), 1)
        for a in range(0, len(ids), window):
            w = ids[a : a + window]
            lo = max(first - a, 1)  # the first token of w that is scored
            if lo >= len(w):
                continue
            with torch.no_grad():
                logits = model(w[None])[0].float()  # [T, V]
            total += float(F.cross_entropy(logits[lo - 1 : len(w) - 1], w[lo:], reduction="sum"))
            count += len(w) - lo
    return total / count


def _runs(uri):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=uri)
    exp = c.get_experiment_by_name("cortiq")
    return c, c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_runs_then_reuses_every_stage_from_cache(tiny):
    first = machinery(_params(tiny))
    assert set(first["states"].values()) == {"Completed"}
    # the score is the model's test NLL, as computed directly
    assert first["nll"]["source"] == pytest.approx(_direct_nll(tiny["model"], first["outputs"]["data"], 32), rel=1e-5)
    assert math.isfinite(first["codecs"]["q8"]["nll"])
    assert first["codecs"]["q8"]["bytes"] < first["bytes"]["source"]

    second = machinery(_params(tiny))
    assert set(second["states"].values()) == {"Cached"}
    assert second["outputs"] == first["outputs"]
    assert second["nll"] == first["nll"]

    client, runs = _runs(first["tracking_uri"])
    assert [r.info.run_id for r in runs] == [first["mlflow_run_id"], second["mlflow_run_id"]]
    for r in runs:
        assert r.info.status == "FINISHED"
        assert r.data.tags["cortiq.params"] == "tiny"
        assert r.data.tags["prefect.flow_run_id"]
        assert r.data.params["source"] == tiny["model"]
        assert r.data.params["data.record_tokens"] == "64"
        # a cached stage's metrics are logged from its result
        assert r.data.metrics["score.source.nll"] == pytest.approx(first["nll"]["source"])
    assert runs[0].data.tags["prefect.flow_run_id"] != runs[1].data.tags["prefect.flow_run_id"]
    arts = {a.path for a in client.list_artifacts(first["mlflow_run_id"], "plots")}
    assert arts == {"plots/nll_per_model.png", "plots/codecs.png"}
    assert {a.path for a in client.list_artifacts(first["mlflow_run_id"], "models")} == {"models/tiny.cmf"}


def test_deleted_output_is_recomputed_not_a_dead_path(tiny):
    first = machinery(_params(tiny))
    enc = Path(first["outputs"]["reencode.q8"])
    enc.unlink()
    again = machinery(_params(tiny))
    assert again["states"]["reencode.q8"] == "Completed"
    assert again["states"]["data"] == "Cached"
    assert again["states"]["score.reencode.q8"] == "Cached"  # same content, same digest
    assert enc.is_file() and again["outputs"]["reencode.q8"] == str(enc)
    shutil.rmtree(first["outputs"]["data"])
    third = machinery(_params(tiny))
    assert third["states"]["data"] == "Completed"
    assert Path(third["outputs"]["data"], "meta.json").is_file()


def test_failure_in_a_middle_stage_then_rerun_resumes_there(tiny, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "reencode")
    with pytest.raises(InjectedFailure):
        machinery(_params(tiny))
    client, runs = _runs(load_settings(_params(tiny)).run.tracking())
    assert [r.info.status for r in runs] == ["FAILED"]
    monkeypatch.delenv(FAIL_ENV)
    again = machinery(_params(tiny))
    assert again["states"] == {"data": "Cached", "score.source": "Cached", "reencode.q8": "Completed",
                               "score.reencode.q8": "Completed"}


def test_retries_rerun_a_failing_stage(tiny, monkeypatch):
    # a stage that keeps failing is tried 1 + retries times, then the flow fails
    calls = []
    import cortiq.runner as m

    real = m.run

    def counting(stage, root, *a, **k):
        if stage.name == "reencode":
            calls.append(stage.name)
            raise RuntimeError("flaky")
        return real(stage, root, *a, **k)

    monkeypatch.setattr(m, "run", counting)
    with pytest.raises(RuntimeError, match="flaky"):
        machinery(_params(tiny, run={"retries": 2, "retry_delay_s": 0}))
    assert len(calls) == 3


class _Plant:
    """Unpickling this creates `marker`: proof that a pickle under the cortiq home was loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_planted_under_the_cortiq_home_is_never_loaded(tiny):
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    from cortiq import store

    first = machinery(_params(tiny))
    marker = tiny["dir"] / "unpickled"
    # where a task's result record would be read from: a file per stage digest under the
    # Prefect home, in the default local storage, and any record already there
    digests = [Path(p).name.split("-", 1)[1].removesuffix(".cmf") for p in first["outputs"].values()]
    roots = [store.home() / "prefect" / "results", Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])]
    targets = {r / d for r in roots for d in digests}
    targets |= {p for p in store.home().rglob("*") if p.is_file() and "results" in p.parts}
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        rec = ResultRecord(metadata=ResultRecordMetadata(storage_key=str(t), serializer=PickleSerializer()),
                           result=_Plant(str(marker)))
        t.write_bytes(rec.serialize())
    again = machinery(_params(tiny))
    assert not marker.exists()
    # every stage still comes from its finished output (meta.json and the JSON report beside it)
    assert set(again["states"].values()) == {"Cached"}
    assert again["nll"] == first["nll"]
