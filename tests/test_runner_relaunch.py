"""What a stage relaunched under torchrun is handed and hands back, without
starting any rank: every stage's settings survive the JSON job exactly (the
same settings, the same digest), what cannot travel as JSON is refused in one
line, rank 0's logger calls replay into the caller's logger as they were made,
and the ranks' errors read as one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from cortiq import runner, runner_worker, tracking
from cortiq.errors import CortiqError

from test_settings_meta import _variants

#: the modules that declare the pipeline's stages
MODULES = ["cortiq.compress.stages", "cortiq.convert.stages", "cortiq.data.stages", "cortiq.heal.stages",
           "cortiq.measure", "cortiq.mtp.stages", "cortiq.quant.stages"]


def _stages() -> list[runner.Stage]:
    import importlib

    out = []
    for m in MODULES:
        out += [v for v in vars(importlib.import_module(m)).values() if isinstance(v, runner.Stage)]
    return out


def test_the_stages_that_run_on_several_ranks_say_so():
    many = {s.name for s in _stages() if s.gpus is not None}
    assert many == {"targets", "prefix", "train", "trunk", "mtp"}
    for s in _stages():  # and every stage is found again by the name and module its job gives
        assert runner.find_stage(**runner._stage_ref(s)) is s


@pytest.mark.parametrize("stage", [s for s in _stages() if s.settings is not None], ids=lambda s: s.name)
def test_every_stages_settings_survive_the_job_file_exactly(stage, tmp_path):
    inputs = {n: {"digest": f"d-{n}"} for n in stage.inputs}
    seen = 0
    for name, obj in [("defaults", stage.settings())] + list(_variants(stage.settings)):
        params = {**inputs, "settings": obj, "where": tmp_path / "x"}
        job = runner.write_job(tmp_path, stage, tmp_path, False, params)
        got, root, progress, back = runner.read_job(job)
        assert got is stage and root == str(tmp_path.resolve()) and progress is False
        assert back["where"] == str(tmp_path / "x")
        built, want = stage.params(back)["settings"], stage.params(params)["settings"]  # normalized alike
        assert type(built) is stage.settings and built == want, name
        assert dataclasses.asdict(built) == dataclasses.asdict(want), name
        if stage.gpus is not None:  # the stages that relaunch: the ranks run the digest this process planned
            assert runner.digest_of(stage, **back) == runner.digest_of(stage, **params), name
        seen += 1
    assert seen > len(dataclasses.fields(stage.settings)) // 2


def test_a_parameter_that_is_not_json_is_refused_in_one_line():
    from cortiq.heal.settings import HealSettings
    from cortiq.heal.stages import TRAIN

    with pytest.raises(CortiqError) as e:
        runner.json_params(TRAIN, {"settings": HealSettings(), "student": {"x": [1, object()]}})
    assert str(e.value) == ("parameter train.student.x[1]: a object cannot leave the process (paths, settings and "
                            "plain values only)")


def test_a_stage_not_declared_in_a_module_cannot_be_relaunched():
    from cortiq.heal.stages import TRAIN

    copy = dataclasses.replace(TRAIN, name="train-copy")
    with pytest.raises(CortiqError, match=r"^train-copy: not a module-level stage of cortiq.heal.stages; "):
        runner._stage_ref(copy)


def test_a_job_file_of_another_kind_is_one_line(tmp_path):
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(CortiqError, match=rf"^{bad}: not a stage job of version 1$"):
        runner.read_job(bad)
    bad.write_text("{")
    with pytest.raises(CortiqError, match=rf"^{bad}: not a stage job \("):
        runner.read_job(bad)
    bad.write_text(json.dumps({"version": 1, "stage": {"module": "cortiq.heal.stages", "name": "nope"}}))
    with pytest.raises(CortiqError, match=rf"^{bad}: no stage 'nope' in cortiq.heal.stages$"):
        runner.read_job(bad)


def _calls(log):
    log.log_params({"heal.lr": 0.003, "heal.memory": "auto", "heal.taps": None})
    for step in range(1, 4):
        log.log_metrics({"loss": 1.0 / step, "lr": 1e-3 * step}, step=step)
    log.log_metrics({"heldout": 0.25})
    log.set_tags({"kind": "x"})
    log.log_artifact("/tmp/out.cmf", "models")


def test_jsonl_logger_replays_every_call_in_order(tmp_path):
    direct = tracking.MemoryLogger()
    _calls(direct)
    f = tmp_path / "log.jsonl"
    _calls(tracking.JsonlLogger(f))
    back = tracking.MemoryLogger()
    assert tracking.replay(f, back) == 7
    assert (back.params, back.metrics, back.tags, back.artifacts) == (direct.params, direct.metrics, direct.tags,
                                                                      direct.artifacts)
    # scoped on replay as the caller's logger scopes what a stage logs in process
    scoped = tracking.MemoryLogger()
    tracking.replay(f, tracking.scoped(scoped, "train."))
    assert scoped.series("train.loss") == direct.series("loss")
    # a killed rank's torn last line is dropped; no file, no call
    with open(f, "a") as h:
        h.write('{"call": "log_metrics", "metr')
    again = tracking.MemoryLogger()
    assert tracking.replay(f, again) == 7 and again.metrics == direct.metrics
    assert tracking.replay(tmp_path / "none.jsonl", again) == 0


def test_the_ranks_errors_read_as_one_line(tmp_path):
    assert runner.rank_errors(tmp_path) == ""
    for t, (r, msg) in enumerate([(2, "x.cmf: bad"), (0, "x.cmf: bad"), (1, "RuntimeError: boom"), (10, "x.cmf: bad")]):
        f = runner.error_file(tmp_path, r)
        f.write_text(msg)
        os.utime(f, ns=(10**9 * (100 + t),) * 2)  # written one after another, in this order
    assert runner.rank_errors(tmp_path) == "ranks 0, 2, 10: x.cmf: bad; rank 1: RuntimeError: boom"
    # the first error written comes first: the cause (a rank whose peer failed errs after it)
    os.utime(runner.error_file(tmp_path, 1), ns=(10**9 * 50,) * 2)
    assert runner.rank_errors(tmp_path) == "rank 1: RuntimeError: boom; ranks 0, 2, 10: x.cmf: bad"


def test_the_injected_failure_names_a_stage_and_optionally_a_rank(monkeypatch):
    monkeypatch.setenv(runner.FAIL_ENV, "train")
    assert runner._injected("train", 0) and runner._injected("train", 1) and not runner._injected("heal", 0)
    monkeypatch.setenv(runner.FAIL_ENV, "train@1")
    assert runner._injected("train", 1) and not runner._injected("train", 0)


def test_the_worker_refuses_to_run_outside_torchrun(tmp_path, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert runner_worker.main([str(tmp_path / "job.json")]) == 2
    assert capsys.readouterr().err.startswith("cortiq.runner_worker: runs one rank of a stage under torchrun")
    assert not Path(tmp_path / "job.json").exists()
