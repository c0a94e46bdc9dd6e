"""A flow whose stage settings say gpus: 2: its Prefect tasks run those stages
under torchrun (two gloo processes on the CPU), and the MLflow run gets the
training curve that rank 0 logged, as with one GPU."""

from __future__ import annotations

from pathlib import Path

from cortiq import store
from flows.mtp_heal import mtp_heal


def test_mtp_flow_with_gpus_2_runs_trunk_and_draft_on_two_ranks_and_logs_the_curve(tiny, tiny_params, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, whatever the machine has
    p = tiny_params(tiny)
    p["mtp"]["gpus"] = 2
    out = mtp_heal(p)
    assert list(out["states"]) == ["data", "mtp_init", "trunk", "mtp", "qgrams.q8", "reencode.q8", "score.reencode.q8"]
    assert set(out["states"].values()) == {"Completed"}
    # the trunk pass ran as two ranks: one shard each, read back as one set by the draft's ranks
    sets = [d for d in Path(out["outputs"]["trunk"]).iterdir() if d.name.endswith("-w32-k4")]  # window 32, top-4
    assert sets and all(store.read_meta(d)["files"] == ["trunk-000-of-002.arrow", "trunk-001-of-002.arrow"]
                        for d in sets)

    from mlflow.tracking import MlflowClient

    from cortiq.cmf import open_cmf

    prov = open_cmf(out["outputs"]["mtp"]).provenance["mtp_heal"]
    assert prov["steps"] > 0
    c = MlflowClient(tracking_uri=out["tracking_uri"])
    # logged by rank 0 as it trained, played into the flow's run: one point per step
    loss = c.get_metric_history(out["mlflow_run_id"], "mtp.loss")
    assert sorted(m.step for m in loss) == list(range(1, prov["steps"] + 1))
    assert c.get_run(out["mlflow_run_id"]).data.metrics["mtp.drafts_per_round_after"] == prov["drafts_per_round_after"]
