"""Heal across ranks (two gloo processes on the CPU): the teacher and prefix
passes' shards read back as one rank's rows; two-rank training (DDP and FSDP2)
takes the steps one rank takes with the same global batch; a checkpoint of two
ranks resumes on one; the digests do not depend on the number of GPUs."""

import numpy as np
import pytest
import torch

from cortiq import dist, store
from cortiq.heal import parallel
from cortiq.heal import prefix as prefix_mod
from cortiq.heal import stages as heal_stages
from cortiq.heal import targets as targets_mod
from cortiq.heal.settings import HealSettings
from cortiq.heal.train import StudentTail, fit
from cortiq.tracking import NULL

from heal_models import arch, healing_pair, random_weights, save, tdata
from heal_toy import KillAt as _KillAt, Killed as _Kill, ToyLM, toy_split
from ranks import run_ranks

CPU = torch.device("cpu")


def test_shares_cover_the_items_in_order_by_whole_units():
    for n, unit, w in [(0, 3, 2), (1, 3, 2), (10, 3, 2), (10, 3, 4), (11, 1, 3), (7, 4, 3)]:
        shares = [dist.shard(n, unit, r, w) for r in range(w)]
        assert [i for s in shares for i in s] == list(range(n))
        assert all(s.start % unit == 0 for s in shares if len(s))
        units = [len(range(s.start, s.stop, unit)) for s in shares]
        assert max(units) - min(units) <= 1
    assert dist.shard(5) == range(5) and dist.world() == 1 and dist.is_main()  # one process: all of it


def test_the_digests_do_not_depend_on_the_gpus(tmp_path):
    from cortiq.heal.stages import TRAIN
    from cortiq.mtp.stages import MTP, TRUNK
    from cortiq.mtp.settings import MtpSettings
    from cortiq.runner import key_of

    one, two = HealSettings(), HealSettings(gpus=2, shard="fsdp")
    for stage in (heal_stages.TARGETS, heal_stages.PREFIX, TRAIN):
        assert key_of(stage, one) == key_of(stage, two)
    for stage in (TRUNK, MTP):
        assert key_of(stage, MtpSettings()) == key_of(stage, MtpSettings(gpus=2))


# ── the passes ──


def _pass_settings(**kw):
    base = dict(window=32, batch=3, topk=6, target="sampled", ce=0.25, train_from=1, device="cpu", compile=False)
    base.update(kw)
    return HealSettings(**base)


def _passes(rank, teacher, student, td, out, kw):
    s = _pass_settings(**kw)
    heal_stages.teacher_targets(teacher, td, s, out / "targets-x", progress=False)
    heal_stages.prefix_cache(student, td, s, out / "prefix-x", progress=False)


def _passes_of_kinds(rank, teacher, student, td, root, kinds):
    for kind in kinds:
        _passes(rank, teacher, student, td, root / f"two-{kind}", {"target": kind})


#: the target kinds whose passes run on two ranks
KINDS = ("sampled", "topk+rest")


# ── training ──


def _setup():
    teacher = ToyLM(seed=0)
    tail = StudentTail(ToyLM(seed=1), 0, False, drop_prefix=False)
    return tail, toy_split(teacher, 24, 8, 4, 5, seed=2), toy_split(teacher, 6, 8, 4, 5, seed=3, train=False)


def _settings(**kw):
    base = dict(epochs=3.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=4, topk=5)
    base.update(kw)
    return HealSettings(**base)


#: the moving average's decay of the cases that keep one (HealSettings.average): short, so that the toy's
#: 18 steps move it far from the weights
AVERAGE = 0.7

#: FSDP2's share under which each layer's gathered weights are kept (cortiq's own), restored between jobs
_KEEP = parallel.KEEP_GATHERED_SHARE


def _fit(rank, work, kw, kill_at, out):
    kw = dict(kw)
    # 0: FSDP2 gathers each layer's weights again for its backward
    parallel.KEEP_GATHERED_SHARE = kw.pop("keep_share", _KEEP)
    compiled = kw.pop("compiled", False)
    tail, tr, va = _setup()
    if compiled:  # dynamo + AOT autograd (no C++ build), FSDP2's hooks around each compiled layer
        for layer in tail.model.layers:
            layer.compiled = torch.compile(layer._forward, backend="aot_eager", dynamic=False)
    try:
        rep = fit(tail, tr, va, _settings(**kw), work, CPU, torch.float32, key="k",
                  logger=_KillAt(kill_at) if kill_at else NULL, progress=False)
    except _Kill:
        return
    state = tail.state()
    if rank == 0 and out is not None:
        torch.save({"history": rep["history"], "evals": rep["evals"], "metrics": rep["metrics"], "state": state}, out)


def _fits(rank, jobs):
    for job in jobs:
        _fit(rank, *job)


def _same_run(a, b, state_b):
    torch.testing.assert_close(torch.tensor([h["loss"] for h in a["history"]]),
                               torch.tensor([h["loss"] for h in b["history"]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([e["heldout"] for e in a["evals"]]),
                               torch.tensor([e["heldout"] for e in b["evals"]]), rtol=1e-5, atol=1e-6)
    assert a["metrics"]["best_step"] == b["metrics"]["best_step"]
    for n, t in a["state"].items():
        torch.testing.assert_close(t, state_b[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """One process's run of `_settings()` by genesis and the average (the settings of the two-rank cases
    that change a single process's run), with the student's state: what the ranks' runs must equal."""
    out = {}
    for genesis, average in {(c[1], c[5]) for c in TWO_RANK_CASES}:
        tail, tr, va = _setup()
        run = fit(tail, tr, va, _settings(genesis=genesis, average=average),
                  tmp_path_factory.mktemp(f"one-{genesis}-{average:g}"), CPU, torch.float32, key="k", progress=False)
        out[genesis, average] = {**run, "state": tail.state()}
    return out


#: (shard, genesis, memory, keep share, compiled layers, average): each run on two ranks against one process
#: (the average's case: each rank averages its shard, and the evaluations score the average)
TWO_RANK_CASES = [
    ("ddp", False, "plain", 0.1, False, 0.0), ("ddp", True, "plain", 0.1, False, 0.0),
    ("fsdp", False, "plain", 0.1, False, 0.0), ("ddp", False, "micro", 0.1, False, 0.0),
    ("fsdp", False, "checkpoint+micro", 0.0, False, 0.0), ("fsdp", False, "checkpoint", 0.1, True, 0.0),
    ("fsdp", False, "plain", 0.1, False, AVERAGE)]

#: the checkpoint kinds two ranks write, killed at step 9 (past the checkpoint at step 8 and the epoch boundary at 6)
SHARDS = ("ddp", "fsdp")


# ── every rank job of this file in one pair of rank processes ──


def _all_jobs(rank, passes, fits):
    _passes_of_kinds(rank, *passes)
    _fits(rank, fits)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The rank jobs of the tests below, run once in the same two processes and group (each pair of
    rank processes costs two interpreters, torch's import and the group's set-up): the passes of
    each target kind, then the training runs. The folder they wrote to; each test reads its part
    back and checks it against one process."""
    root = tmp_path_factory.mktemp("ranks")
    teacher, student, td = healing_pair(root, chars=5000)
    # one process's checkpoint, killed at step 9, that two ranks then resume
    tail, tr, va = _setup()
    with pytest.raises(_Kill):
        fit(tail, tr, va, _settings(average=AVERAGE), root / "one-resumed", CPU, torch.float32, key="k",
            logger=_KillAt(9), progress=False)
    assert (root / "one-resumed/checkpoint.pt").is_file()
    # micro: each rank's 2 windows in 2 micro-batches (DDP reduces once, after the second);
    # keep 0: FSDP2 frees each layer's gathered weights after its forward, gathers them again in the backward;
    # keep 0.1 (a CPU's memory): the 3 layers are one FSDP2 unit; compiled: each layer's checkpoint around
    # its compiled body, FSDP2's hooks outside both
    fits = [(root / f"two-{i}", {"shard": shard, "genesis": genesis, "memory": memory, "micro_batch": 1,
                                 "keep_share": keep, "compiled": compiled, "average": average}, 0,
             root / f"two-{i}.pt")
            for i, (shard, genesis, memory, keep, compiled, average) in enumerate(TWO_RANK_CASES)]
    # the resumed runs keep an average: a checkpoint carries it across kinds as it carries the best weights
    fits += [(root / f"killed-{shard}", {"shard": shard, "average": AVERAGE}, 9, None) for shard in SHARDS]
    fits += [(root / "one-resumed", {"shard": "fsdp", "average": AVERAGE}, 0, root / "one-resumed.pt")]
    # conftest's temp home is a test's, set after a module's fixtures: this one gets its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORTIQ_HOME", str(root / "cortiq-home"))
        run_ranks(_all_jobs, 2, (teacher, student, td, root / "passes", KINDS), fits, tmp=root)
    return {"root": root, "teacher": teacher, "student": student, "tdata": td}


def test_teacher_and_prefix_shards_read_as_one_ranks_rows(ranks, tmp_path):
    teacher, student, td = ranks["teacher"], ranks["student"], ranks["tdata"]
    for kind in KINDS:
        d1, d2 = tmp_path / f"one-{kind}", ranks["root"] / "passes" / f"two-{kind}"
        _passes(0, teacher, student, td, d1, {"target": kind})
        one, two = targets_mod.Targets(d1 / "targets-x"), targets_mod.Targets(d2 / "targets-x")
        assert store.read_meta(d2 / "targets-x")["files"]["train"] == ["train-000-of-002.arrow",
                                                                       "train-001-of-002.arrow"], kind
        for split in targets_mod.SPLITS:
            n = len(one.ids[split])
            assert n == len(two.ids[split]) > 3, (kind, split)
            idx = np.arange(n)
            assert np.array_equal(one.ids[split].take(idx), two.ids[split].take(idx)), (kind, split)
            assert np.array_equal(one.probs[split].take(idx), two.probs[split].take(idx)), (kind, split)
            assert np.array_equal(one.total[split], two.total[split]), (kind, split)
        p1, p2 = prefix_mod.Prefix(d1 / "prefix-x"), prefix_mod.Prefix(d2 / "prefix-x")
        assert p1.cached and p2.cached
        for split in targets_mod.SPLITS:
            idx = np.arange(len(p1.h[split]))
            assert len(p2.h[split]) == len(idx) and np.array_equal(p1.h[split].take(idx), p2.h[split].take(idx))
        assert not list(d2.glob("*.partial"))


def test_two_ranks_train_as_one_with_the_same_global_batch(ranks, refs):
    root = ranks["root"]
    for i, case in enumerate(TWO_RANK_CASES):
        ref = refs[case[1], case[5]]
        two = torch.load(root / f"two-{i}.pt", weights_only=True)
        assert len(two["history"]) == 18, case
        try:
            _same_run(two, ref, ref["state"])
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from None
        assert (root / f"two-{i}/checkpoint.dcp/loop.json").is_file(), case
        assert not (root / f"two-{i}/checkpoint.pt").exists(), case


def test_a_two_rank_checkpoint_resumes_on_one(ranks, refs, tmp_path):
    import shutil

    ref = refs[False, AVERAGE]
    for shard in SHARDS:
        w = tmp_path / f"w-{shard}"
        shutil.copytree(ranks["root"] / f"killed-{shard}", w)  # the ranks' checkpoint, left as they wrote it
        shutil.copytree(w, tmp_path / f"w2-{shard}")  # the same checkpoint, for the run of another key below
        tail2, tr2, va2 = _setup()  # a new process: a fresh student
        rep = fit(tail2, tr2, va2, _settings(average=AVERAGE), w, CPU, torch.float32, key="k", progress=False)
        assert [h["step"] for h in rep["history"]] == list(range(1, 19)), shard
        _same_run({**rep, "state": tail2.state()}, ref, ref["state"])
        assert (w / "checkpoint.pt").is_file() and not (w / "checkpoint.dcp").exists(), shard
        # and a checkpoint of another run is not taken for this one's
        assert (tmp_path / f"w2-{shard}/checkpoint.dcp/loop.json").is_file()
        tail3, tr3, va3 = _setup()
        rep = fit(tail3, tr3, va3, _settings(average=AVERAGE), tmp_path / f"w2-{shard}", CPU, torch.float32, key="other",
                  progress=False)
        assert len(rep["history"]) == 18 and rep["history"][0]["step"] == 1, shard


def test_a_one_process_checkpoint_resumes_on_two_ranks(ranks, refs):
    ref = refs[False, AVERAGE]
    two = torch.load(ranks["root"] / "one-resumed.pt", weights_only=True)
    assert [h["step"] for h in two["history"]] == list(range(1, 19))
    _same_run(two, ref, ref["state"])


def test_cli_gpus_2_reruns_itself_under_torchrun_and_heals_as_one_gpu(tmp_path, capsys):
    from safetensors.torch import load_file

    from cortiq.cli import main

    teacher, student, td = healing_pair(tmp_path)
    argv = ["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--window", "32", "--batch", "4",
            "--topk", "8", "--lr", "3e-3", "--train-from", "1", "--device", "cpu", "--quiet", "--no-score",
            # 12 steps, evaluated every 4 (the default budget, 2M tokens, ran hundreds of steps to the plateau stop)
            "--tokens", "1536", "--eval-every", "4", "--retain-sources", "none"]
    # two stage caches: with one, the 2-GPU run would reuse the 1-GPU outputs (their digests do not depend on gpus)
    assert main(argv + ["--out", str(tmp_path / "one.cmf"), "--work", str(tmp_path / "one.work")]) == 0
    assert main(argv + ["--out", str(tmp_path / "two.cmf"), "--work", str(tmp_path / "two.work"), "--gpus", "2"]) == 0
    one = load_file(str(next((tmp_path / "one.work").glob("train-*/trained.safetensors"))))
    two = load_file(str(next((tmp_path / "two.work").glob("train-*/trained.safetensors"))))
    assert one.keys() == two.keys()
    for n in one:
        torch.testing.assert_close(one[n], two[n], rtol=1e-4, atol=1e-5, msg=n)
    meta = store.read_meta(next((tmp_path / "two.work").glob("targets-*")))
    assert meta["files"]["val"] == ["val-000-of-002.arrow", "val-001-of-002.arrow"]
    assert (tmp_path / "two.cmf").is_file()


def test_cli_gpus_2_bad_input_is_one_line_before_any_rank_starts(tmp_path, capsys):
    from cortiq.cli import main

    a = arch()
    teacher = save(tmp_path / "t.cmf", a, random_weights(a))
    td = tdata(tmp_path, teacher, chars=2000)
    rc = main(["heal", str(teacher), "--teacher", str(teacher), "--data", str(td), "--out", str(tmp_path / "h.cmf"),
               "--train-from", "5", "--gpus", "2", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("cortiq: ") and "train_from 5 is beyond" in err and err.count("\n") == 1
