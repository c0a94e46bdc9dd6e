"""The whole compress-and-heal flow on a tiny model: every stage runs, a failure
in a middle stage (heal) resumes there, MLflow holds the run and its plots."""

from __future__ import annotations

import math

import pytest

from flows.compress_and_heal import compress_and_heal
from cortiq.runner import FAIL_ENV


def out_train_history(out):
    from cortiq import store

    return store.read_meta(out["outputs"]["train"])["report"]["history"]


STAGES = ["data", "masks", "fold", "targets", "train", "heal", "score.source", "score.pruned", "score.healed",
          "facts.source", "facts.pruned", "facts.healed", "mtp_init", "trunk", "mtp", "qgrams.q8", "reencode.q8", "score.reencode.q8"]


def test_whole_flow_then_failure_in_training_resumes_there(tiny, tiny_params, monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "train")
    with pytest.raises(Exception, match="failure injected"):
        compress_and_heal(tiny_params(tiny))
    monkeypatch.delenv(FAIL_ENV)
    out = compress_and_heal(tiny_params(tiny))
    assert list(out["states"]) == STAGES
    # data, the compress stages and the teacher targets finished in the failed run: taken from the
    # cache; training onward executed
    assert {out["states"][k] for k in STAGES[:4]} == {"Cached"}
    assert out["states"]["score.source"] == "Completed"  # scoring comes after heal in the flow
    assert {k: out["states"][k] for k in STAGES[4:]} == {k: "Completed" for k in STAGES[4:]}
    for k in ("source", "pruned", "healed"):
        assert math.isfinite(out["nll"][k])
    assert out["bytes"]["pruned"] < out["bytes"]["source"]  # the fold made the MLPs narrower
    # the draft trained: it keeps more drafts a round than the fresh one did
    assert out["drafts_per_round"]["after"] > out["drafts_per_round"]["before"] + 0.1
    assert out["codecs"]["q8"]["bytes"] < out["bytes"]["healed"]
    assert out["codecs"]["q8"]["method"] == "awq"  # the default method re-encodes the block codecs

    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=out["tracking_uri"])
    run = c.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["score.healed.nll"] == pytest.approx(out["nll"]["healed"])
    assert run.data.metrics["score.reencode.q8.nll"] == pytest.approx(out["codecs"]["q8"]["nll"])
    mv = c.get_model_version(run.data.tags["registry.model"], run.data.tags["registry.version"])
    assert float(mv.tags["codec.q8.nll"]) == pytest.approx(out["codecs"]["q8"]["nll"], rel=1e-5)
    n = out["nll"]
    assert run.data.metrics["heal.gap_recovered"] == pytest.approx((n["pruned"] - n["healed"]) / (n["pruned"] - n["source"]))
    assert run.data.tags["heal.gap_text"].startswith("test split")
    # facts kept, the third measure: in the summary, the run's metrics and the registered version's tags
    f = out["facts"]["healed"]
    assert f["part"] == "held" and 0 <= f["kept"] <= f["source_known"] <= f["facts"]
    assert run.data.metrics["heal.facts.healed.known"] == f["known"]
    assert mv.tags["facts_kept"] == f"{f['kept']}/{f['source_known']}"
    plots = {a.path for a in c.list_artifacts(out["mlflow_run_id"], "plots")}
    assert {"plots/nll_per_model.png", "plots/codecs.png", "plots/hold_rate.png", "plots/heldout_loss.png"} <= plots
    # per-step metrics, logged live as training ran: the loss every step, the held-out loss at every evaluation
    assert len(c.get_metric_history(out["mlflow_run_id"], "train.loss")) == len(out_train_history(out))
    assert len(c.get_metric_history(out["mlflow_run_id"], "train.heldout")) >= 2

    again = compress_and_heal(tiny_params(tiny))
    assert set(again["states"].values()) == {"Cached"}
    assert again["nll"] == out["nll"]
    # the registry: each finished run is a version of the parameter set's model; the second run's NLL
    # only equals the first's, so `champion` stays on the first
    first = c.get_model_version("tiny", c.get_run(out["mlflow_run_id"]).data.tags["registry.version"])
    second = c.get_model_version("tiny", c.get_run(again["mlflow_run_id"]).data.tags["registry.version"])
    assert (int(first.version), int(second.version)) == (1, 2)
    assert float(first.tags["test_nll"]) == pytest.approx(out["nll"]["healed"], rel=1e-5)
    assert first.tags["data_digest"] and first.tags["drafts_per_round"] and first.tags["gap_recovered"]
    assert first.aliases == ["champion"] and second.aliases == []
