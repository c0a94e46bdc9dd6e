"""Defaults that fit: `train_from` unset trains the most layers whose step fits the device
(one line says so), and a setting that cannot fit is one error line before any work; on a
tiny model, with a device memory budget set small on the CPU."""

import pytest
import torch

from cortiq.cli import main
from cortiq.cmf import open_cmf
from cortiq.errors import CortiqError
from cortiq.heal import memory as mem
from cortiq.heal.fitting import Fit, fit_layers, geometry
from cortiq.heal.settings import HealSettings
from cortiq.heal.stages import PREFIX, TRAIN
from cortiq.heal.targets import window_sets
from cortiq.runner import digest_of

from heal_models import arch, perturbed, random_weights, save, tdata

CPU = torch.device("cpu")
BASE = dict(window=32, batch=4, topk=8, device="cpu")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher, student, tdata): 4 layers, so that the lowest layers can be left frozen."""
    tmp = tmp_path_factory.mktemp("fit")
    a = arch(layers=4)
    w = random_weights(a)
    teacher = save(tmp / "t.cmf", a, w)
    return teacher, save(tmp / "s.cmf", a, perturbed(w)), tdata(tmp, teacher, chars=4000)


def _fit(pair, **kw) -> Fit:
    _, student, td = pair
    s = HealSettings(**{**BASE, "device_mem_gb": 1.0, **kw})
    _, wins = window_sets(td, s)
    return Fit(geometry(student, s.ffn_only), s, CPU, sum(len(w) for w in wins.values()))


def _total(fit: Fit, t: int, plan=None) -> int:
    """The weights on the device and the step's estimate, training from `t` (default: the leanest plan)."""
    plan = plan or mem.leanest(fit.shape(t), fit.have)
    return fit.there(t) + fit.need(t, plan)


def _gb(n_bytes: float) -> float:
    return n_bytes / mem.GiB


def _heal(pair, tmp_path, *args):
    teacher, student, td = pair
    return main(["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--out", str(tmp_path / "h.cmf"),
                 "--window", "32", "--batch", "4", "--topk", "8", "--lr", "3e-3", "--tokens", "512", "--device", "cpu",
                 "--retain-sources", "none", "--work", str(tmp_path / "work"), "--no-score", "--quiet", *args])


def test_the_estimate_falls_with_every_frozen_layer(pair):
    fit = _fit(pair)
    totals = [_total(fit, t) for t in range(fit.n)]
    assert all(b < a for a, b in zip(totals, totals[1:])), totals


def test_auto_trains_the_most_layers_that_fit_and_says_so(pair, tmp_path, capsys):
    fit = _fit(pair)
    gb = _gb((_total(fit, 1) + _total(fit, 2)) / 2)  # room from layer 2 up, not from layer 1
    assert _heal(pair, tmp_path, "--device-mem-gb", f"{gb!r}") == 0
    err = capsys.readouterr().err
    fit = _fit(pair, device_mem_gb=gb)
    allow, budget = fit.allow(0)
    lean = mem.leanest(fit.shape(0), fit.have)
    line = (f"cortiq: heal: training every layer does not fit the {mem.size(allow)} the step may use{budget}: "
            f"{mem.size(fit.need(0, lean))} with the leanest plan, {mem.plan_option(lean)}; training layers 2-3 "
            f"(train_from 2), plan {fit.fastest(2)}")
    assert line in err.splitlines(), err
    assert sum(x.startswith("cortiq: heal: training every layer") for x in err.splitlines()) == 1
    # what trained: layers 2 and 3, and the healed model's provenance records the value decided
    assert open_cmf(tmp_path / "h.cmf").provenance["heal"]["settings"]["train_from"] == 2


def test_auto_trains_every_layer_where_they_fit_and_says_nothing(pair, tmp_path, capsys):
    s = HealSettings(**BASE, device_mem_gb=_gb(_total(_fit(pair), 0) * 1.01))
    teacher, student, td = pair
    assert fit_layers(student, teacher, td, s).train_from == 0
    assert "training every layer" not in capsys.readouterr().err


def test_an_explicit_memory_plan_too_big_is_one_line_before_any_work(pair, tmp_path, capsys):
    fit = _fit(pair)
    fit_plain = _fit(pair, memory="plain")
    # room for every layer under some plan, and for plain from layer 3 only
    gb = _gb(max(_total(fit, 0), _total(fit_plain, 3, fit_plain.named(3))) * 1.01)
    assert _total(fit_plain, 2, fit_plain.named(2)) > gb * mem.GiB
    assert _heal(pair, tmp_path, "--memory", "plain", "--device-mem-gb", f"{gb!r}") == 1
    fit = _fit(pair, memory="plain", device_mem_gb=gb)
    allow, budget = fit.allow(0)
    other = fit.fastest(0)
    assert other is not None and other.parts
    assert capsys.readouterr().err == (
        f"cortiq: heal: --memory plain needs {mem.size(fit.need(0, fit.named(0)))}, {mem.size(allow)} allowed{budget}: "
        f"--memory {mem.plan_option(other)} fits, or --train-from 3\n")
    # refused before the teacher pass or any other stage: nothing written
    assert not (tmp_path / "h.cmf").exists() and not list((tmp_path / "work").glob("*-*"))


def test_an_explicit_train_from_that_cannot_fit_names_the_one_that_does(pair):
    teacher, student, td = pair
    fit = _fit(pair)
    gb = _gb((_total(fit, 1) + _total(fit, 2)) / 2)
    s = HealSettings(**BASE, device_mem_gb=gb, train_from=1)
    with pytest.raises(CortiqError) as e:
        fit_layers(student, teacher, td, s)
    fit = _fit(pair, device_mem_gb=gb)
    lean = mem.leanest(fit.shape(1), fit.have)
    allow, budget = fit.allow(1)
    assert str(e.value) == (f"heal: train_from 1 needs {mem.size(fit.need(1, lean))} with the leanest plan "
                            f"({mem.plan_option(lean)}), {mem.size(allow)} allowed{budget}: --train-from 2 fits "
                            f"(plan {fit.fastest(2)})")
    # from 2 it fits: kept as given, nothing said
    assert fit_layers(student, teacher, td, HealSettings(**BASE, device_mem_gb=gb, train_from=2)).train_from == 2


def test_nothing_that_fits_is_one_line(pair, tmp_path, capsys):
    teacher, student, td = pair
    gb = _gb(_total(_fit(pair), 3) * 0.9)  # not even the last layer alone
    with pytest.raises(CortiqError, match=r"^heal: training every layer needs .* allowed \(device_mem_gb .*\): not even "
                                          r"the last layer alone fits \(a larger --device-mem-gb or device, or a "
                                          r"smaller --batch or --window: 4 windows of 32 now\)$"):
        fit_layers(student, teacher, td, HealSettings(**BASE, device_mem_gb=gb))
    assert _heal(pair, tmp_path, "--device-mem-gb", f"{gb!r}", "--memory", "checkpoint+micro") == 1
    err = capsys.readouterr().err
    assert err.startswith("cortiq: heal: --memory checkpoint+micro needs ") and err.endswith("not even the last layer alone "
                                                                                "fits (a larger --device-mem-gb or "
                                                                                "device, or a smaller --batch or "
                                                                                "--window: 4 windows of 32 now)\n")
    assert err.count("\n") == 1


def test_unset_is_every_layer_without_a_budget_and_keys_as_every_layer(pair):
    teacher, student, td = pair
    # a CPU without a budget plans nothing; more than one GPU neither (FSDP splits the step)
    assert fit_layers(student, teacher, td, HealSettings(**BASE)).train_from == 0
    assert fit_layers(student, teacher, td, HealSettings(**BASE, gpus=2, device_mem_gb=1e-9)).train_from == 0
    # a stage given it unset trains every layer, under that digest: the outputs made before keep theirs
    ins = {"student": {"digest": "s"}, "targets": {"digest": "t"}, "prefix": None, "tdata": {"digest": "d"}}
    assert digest_of(TRAIN, **ins, settings=HealSettings()) == digest_of(TRAIN, **ins, settings=HealSettings(train_from=0))
    assert digest_of(PREFIX, student=ins["student"], tdata=ins["tdata"], settings=HealSettings()) == \
        digest_of(PREFIX, student=ins["student"], tdata=ins["tdata"], settings=HealSettings(train_from=0))
    assert digest_of(TRAIN, **ins, settings=HealSettings(train_from=2)) != \
        digest_of(TRAIN, **ins, settings=HealSettings(train_from=0))


def test_named_8bit_moments_without_torchao_are_refused_before_any_work(pair, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    assert _heal(pair, tmp_path, "--memory", "lean") == 1
    err = capsys.readouterr().err
    assert err.startswith("cortiq: heal: memory adam8 needs torchao (pip install 'cortiq[lean]'): ") and err.count("\n") == 1
    assert not list((tmp_path / "work").glob("*-*"))


def test_the_caches_spill_to_disk_in_chunks_and_read_back_mapped_with_the_values_made(pair, tmp_path):
    """The teacher's targets and the frozen prefix are written a pass batch at a time and read
    back memory-mapped: neither is ever whole in host memory, whatever mem_budget_gb says
    (that chooses the prefix's precision only), and the rows read are the ones made."""
    import math

    import pyarrow as pa

    from cortiq import store
    from cortiq.heal import stages as heal_stages
    from cortiq.heal.prefix import Prefix, run_prefix
    from cortiq.heal.targets import Targets
    from cortiq.model import load_model

    teacher, student, td = pair
    s = HealSettings(**BASE, train_from=2)
    heal_stages.teacher_targets(teacher, td, s, tmp_path / "targets", progress=False)
    assert heal_stages.prefix_cache(student, td, s, tmp_path / "prefix", progress=False)["dtype"] == "f32"
    _, wins = window_sets(td, s)
    for d, col in ((tmp_path / "prefix", "h"), (tmp_path / "targets", "probs")):
        for split, w in wins.items():
            assert store.read_arrow(d / f"{split}.arrow").column(col).num_chunks == math.ceil(len(w) / s.batch) > 1
    before = pa.total_allocated_bytes()
    pre, tg = Prefix(tmp_path / "prefix"), Targets(tmp_path / "targets")
    on_disk = sum(p.stat().st_size for d in ("prefix", "targets") for p in (tmp_path / d).glob("*.arrow"))
    assert pa.total_allocated_bytes() - before < on_disk / 50  # mapped, not read into memory (the totals aside)
    assert not pre.h["train"].parts[0].flags.owndata and not tg.probs["train"].parts[0].flags.owndata
    model = load_model(student)
    want = run_prefix(model, torch.from_numpy(wins["train"].ids[: s.batch]), 2)  # the stage's first pass batch
    assert torch.equal(torch.from_numpy(pre.h["train"].take(range(s.batch))), want)
