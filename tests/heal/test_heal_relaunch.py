"""A stage with gpus: 2 run by `runner.run` from a plain process (as the
Prefect task runs it) relaunches itself under torchrun (two gloo processes on
the CPU): the same digest, output and report as one process, rank 0's metrics
played into the caller's logger; a failed rank is one error naming the stage
and the exit status, and leaves no complete output."""

import re

import pytest
import torch
from safetensors.torch import load_file

from cortiq import runner, store
from cortiq.errors import CortiqError
from cortiq.heal.settings import HealSettings
from cortiq.heal.stages import TRAIN, TRAINED
from cortiq.heal.stages import TARGETS
from cortiq.tracking import MemoryLogger

from heal_models import healing_pair

SETTINGS = dict(window=32, batch=4, topk=8, lr=3e-3, epochs=1.0, eval_every=4, checkpoint_every=4, train_from=1,
                device="cpu", compile=False)


@pytest.fixture(autouse=True)
def _cpu_ranks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, whatever the machine has


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The student and the teacher's targets, made once: every test only reads them."""
    tmp = tmp_path_factory.mktemp("inputs")
    teacher, student, td = healing_pair(tmp)
    h = HealSettings(**SETTINGS)
    # conftest's temp home is a test's, set after a module's fixtures: this one gets its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORTIQ_HOME", str(tmp / "cortiq-home"))
        targets = runner.run(TARGETS, tmp / "shared", progress=False, teacher=teacher, tdata=td, settings=h)
    return {"student": student, "targets": targets["path"], "prefix": None, "tdata": td}


def _train(root, inputs, gpus):
    log = MemoryLogger()
    r = runner.run(TRAIN, root, log, progress=False, settings=HealSettings(**SETTINGS, gpus=gpus),
                     **inputs)
    return r, log


def test_a_failed_rank_is_one_error_and_the_next_run_equals_one_process(tmp_path, inputs, monkeypatch):
    # each run under torchrun costs a launcher and two ranks that import torch: the run after the
    # failed one is both the failure's recovery and the run compared with one process
    one, log1 = _train(tmp_path / "one", inputs, 1)
    monkeypatch.setenv(runner.FAIL_ENV, "train@1")  # rank 1 fails; rank 0 has started the stage
    with pytest.raises(CortiqError) as e:
        _train(tmp_path / "two", inputs, 2)
    msg = str(e.value)
    # the failed rank's error first (rank 0 may meet the closed connection after it, and says so second)
    assert msg.startswith("train: 2 processes under torchrun exited with status 1 (rank 1: InjectedFailure: train: "
                          "failure injected by $CORTIQ_FAIL_STAGE") and "\n" not in msg
    pl = runner.cache_entry(TRAIN, tmp_path / "two", settings=HealSettings(**SETTINGS, gpus=2), **inputs)
    assert not pl.ready() and not pl.report.exists() and not (pl.out / store.META).exists()
    monkeypatch.delenv(runner.FAIL_ENV)
    # the next run makes it: what an in-process run returns, under the same digest
    two, log2 = _train(tmp_path / "two", inputs, 2)
    assert pl.ready() and two["digest"] == pl.digest
    assert two.keys() == one.keys() and two["digest"] == one["digest"] and two["stage"] == "train"
    assert two["reused"] is False and two["path"] == str(tmp_path / "two" / f"train-{one['digest']}")
    assert two["report"]["ranks"] == 2 and one["report"]["ranks"] == 1
    steps = [h["step"] for h in one["report"]["history"]]
    assert len(steps) > 4 and [h["step"] for h in two["report"]["history"]] == steps
    torch.testing.assert_close(torch.tensor([e["heldout"] for e in two["report"]["evals"]]),
                               torch.tensor([e["heldout"] for e in one["report"]["evals"]]), rtol=1e-5, atol=1e-6)
    w1 = load_file(str(tmp_path / "one" / f"train-{one['digest']}" / TRAINED))
    w2 = load_file(str(tmp_path / "two" / f"train-{two['digest']}" / TRAINED))
    assert w1.keys() == w2.keys()
    for n in w1:
        torch.testing.assert_close(w2[n], w1[n], rtol=1e-4, atol=1e-5, msg=n)
    # rank 0's metrics, played into this process's logger: the same curve, step by step
    assert [(k, s) for k, _, s in log2.metrics] == [(k, s) for k, _, s in log1.metrics]
    torch.testing.assert_close(torch.tensor([v for _, v in log2.series("loss")]),
                               torch.tensor([v for _, v in log1.series("loss")]), rtol=1e-5, atol=1e-6)
    assert log2.params.keys() == log1.params.keys() and log2.params["heal.gpus"] == 2
    assert not list((tmp_path / "two").glob("*.partial"))
    # a complete output is reused without starting any rank
    again, log3 = _train(tmp_path / "two", inputs, 2)
    assert again["reused"] is True and again["digest"] == two["digest"] and again["report"] == two["report"]
    assert log3.metrics == []


def test_a_bad_input_the_ranks_meet_is_its_one_line_said_once(tmp_path, inputs):
    # targets of another window
    s = HealSettings(**{**SETTINGS, "window": 16}, gpus=2)
    bad = runner.cache_entry(TRAIN, tmp_path / "bad", settings=s, **inputs)
    with pytest.raises(CortiqError) as e:
        runner.run(TRAIN, tmp_path / "bad", progress=False, settings=s, **inputs)
    # the rank that fails second may be stopped before it says so
    assert re.fullmatch(rf"train: 2 processes under torchrun exited with status 1 \((rank 0|rank 1|ranks 0, 1): "
                        rf"{re.escape(inputs['targets'])}: targets of windows of 32 tokens, the settings say 16\); "
                        rf"{re.escape(str(bad.out))} was not completed", str(e.value)), str(e.value)
    assert not bad.ready()
