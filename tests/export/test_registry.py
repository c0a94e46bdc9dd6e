"""The MLflow Model Registry on a sqlite store, without running a flow: runs'
models registered as versions, `champion` only for a better test NLL on the
same data, references above the size limit, the flows' adapter, and
`cortiq compare` listing the versions."""

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_helpers import arch_of, write_random  # noqa: E402

pytest.importorskip("mlflow")

from cortiq.measure import Text  # noqa: E402
from flows.registry import CHAMPION, register, register_final  # noqa: E402
from flows.tracking import MlflowLogger, client_for, experiment_id, log_model_file  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    client = client_for(uri)
    exp = experiment_id(client, "cortiq", uri)
    models = [write_random(d / f"m{i}.cmf", arch_of("llama"), seed=i) for i in range(4)]
    return SimpleNamespace(uri=uri, client=client, exp=exp, models=models, dir=d)


def _run(store, model, nll, limit_mb=200.0):
    """A finished run that logged `model` as the flows do (artifact or reference) and its test NLL."""
    run = store.client.create_run(store.exp, run_name=f"run-{nll}")
    log = MlflowLogger(store.client, run.info.run_id)
    log.log_metrics({"score.healed.nll": nll})
    log_model_file(log, model, limit_mb)
    store.client.set_terminated(run.info.run_id, "FINISHED")
    return log


def _sha(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_a_worse_second_run_does_not_take_champion(store):
    c, m = store.client, store.models
    r1, r2, r3, r4 = (_run(store, m[i], nll).run_id for i, nll in enumerate((3.0, 3.2, 2.9, 2.95)))
    a = register(c, "tiny", r1, m[0], 200, 3.0, "digest-A", gap_recovered=0.5, drafts_per_round=0.25)
    assert (a["version"], a["champion"]) == (1, True)
    b = register(c, "tiny", r2, m[1], 200, 3.2, "digest-A", gap_recovered=0.4, drafts_per_round=0.3)
    assert (b["version"], b["champion"]) == (2, False)
    assert b["reason"] == "test NLL 3.2 >= champion v1's 3"
    assert str(c.get_model_version_by_alias("tiny", CHAMPION).version) == "1"
    # better, but on other data: not comparable, the champion stays
    d = register(c, "tiny", r3, m[2], 200, 2.9, "digest-B")
    assert not d["champion"] and "other data" in d["reason"]
    assert str(c.get_model_version_by_alias("tiny", CHAMPION).version) == "1"
    # better on the same data: it moves
    e = register(c, "tiny", r4, m[3], 200, 2.95, "digest-A")
    assert e["champion"] and str(c.get_model_version_by_alias("tiny", CHAMPION).version) == "4"

    v2 = c.get_model_version("tiny", "2")
    assert v2.run_id == r2 and v2.source.endswith("/models/m1.cmf")
    assert {k: v2.tags[k] for k in ("test_nll", "gap_recovered", "drafts_per_round", "data_digest", "storage")} == {
        "test_nll": "3.2", "gap_recovered": "0.4", "drafts_per_round": "0.3", "data_digest": "digest-A", "storage": "artifact"}
    assert v2.tags["sha256"] == _sha(m[1]) and v2.tags["champion_decision"] == b["reason"]
    assert c.get_run(r2).data.tags["registry.version"] == "2"
    # the source is the run's own artifact: downloading it gives the model back
    got = Path(c.download_artifacts(r2, "models/m1.cmf", str(store.dir / "dl")))
    assert _sha(got) == _sha(m[1])


def test_above_the_size_limit_the_version_points_at_the_reference(store):
    c = store.client
    rid = _run(store, store.models[0], 3.1, limit_mb=0.0).run_id
    v = register(c, "tiny-ref", rid, store.models[0], 0.0, 3.1, "digest-A")
    mv = c.get_model_version("tiny-ref", str(v["version"]))
    assert v["champion"] and mv.tags["storage"] == "reference" and mv.source.endswith("/models/m0.cmf.ref.json")
    ref = json.loads(Path(c.download_artifacts(rid, "models/m0.cmf.ref.json", str(store.dir / "dl-ref"))).read_text())
    assert ref["sha256"]["m0.cmf"] == mv.tags["sha256"] == _sha(store.models[0])


def test_no_test_nll_never_takes_champion(store):
    rid = _run(store, store.models[1], 1.0).run_id
    v = register(store.client, "tiny-nonll", rid, store.models[1], 200, None, "digest-A")
    assert (v["champion"], v["reason"]) == (False, "no test NLL")


def test_flow_adapter_reads_the_stage_results(store, capsys):
    def res(**metrics):
        return {"report": {"metrics": metrics}, "digest": "d", "path": "p"}

    log = _run(store, store.models[2], 2.5)
    st = SimpleNamespace(
        settings=SimpleNamespace(name="params-x", run=SimpleNamespace(artifact_limit_mb=200.0),
                                 extra=lambda group, key: []), log=log,
        results={"data": {"digest": "tdata-123", "path": "x"}, "score.source": res(nll=2.0), "score.pruned": res(nll=3.0),
                 "score.healed": res(nll=2.5), "mtp": res(drafts_per_round_after=0.75)},
        # the texts the chain scored (cortiq.chains sets them on the flow's state)
        texts=[Text("data", "x", None, "test split of the parameter set's data (in-domain)", kind="data")])
    out = register_final(st, store.models[2])
    assert out["name"] == "params-x" and out["champion"]
    assert "registered params-x v1 (champion)" in capsys.readouterr().out
    mv = store.client.get_model_version("params-x", "1")
    assert (mv.tags["test_nll"], mv.tags["gap_recovered"], mv.tags["drafts_per_round"], mv.tags["data_digest"]) == (
        "2.5", "0.5", "0.75", "tdata-123")


def test_compare_lists_the_registered_versions(store, tmp_path, capsys):
    from cortiq.cli import main

    c, m = store.client, store.models
    r1, r2 = _run(store, m[0], 3.0).run_id, _run(store, m[1], 3.3).run_id
    register(c, "cmp", r1, m[0], 200, 3.0, "digest-A")
    register(c, "cmp", r2, m[1], 200, 3.3, "digest-A")
    assert main(["compare", r1, r2, "--tracking-uri", store.uri, "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    lines = out.split("registered model versions:\n", 1)[1].splitlines()
    assert lines[0].split()[:4] == ["model", "version", "aliases", "test"]
    assert lines[1].split()[:4] == ["cmp", "v1", "champion", "3.0"]
    assert lines[2].split()[:4] == ["cmp", "v2", "-", "3.3"]


def test_an_equal_nll_does_not_take_champion(store):
    nll = 13.751904296875123  # the tag must hold every digit, or a rerun would "beat" its own rounding
    r1, r2 = _run(store, store.models[0], nll).run_id, _run(store, store.models[0], nll).run_id
    assert register(store.client, "tiny-eq", r1, store.models[0], 200, nll, "digest-A")["champion"]
    again = register(store.client, "tiny-eq", r2, store.models[0], 200, nll, "digest-A")
    assert not again["champion"] and again["reason"].startswith("test NLL 13.7519 >= champion v1's")
