"""The target kind in the stages: it enters the targets digest and not the
prefix's (changing it recomputes targets, reuses the prefix); every kind heals
a tiny student; the "full" trainer loss is the dense KL of the teacher's rows;
the gap is reported on held-out text of another source when given."""

import json

import pytest
import torch

from cortiq import store
from cortiq.cmf import open_cmf
from cortiq.heal import HealSettings, heal
from cortiq.heal import stages as heal_stages
from cortiq.heal import targets as targets_mod
from cortiq.heal.loss import dense_kl_reference
from cortiq.heal.train import Objective, StudentTail, batch_loss

from heal_models import arch, perturbed, random_weights, save, tdata


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kinds")
    a = arch()
    w = random_weights(a)
    teacher = save(tmp / "teacher.cmf", a, w)
    student = save(tmp / "student.cmf", a, perturbed(w))
    return teacher, student, tdata(tmp, teacher, chars=3500)


def _s(**kw):
    base = dict(window=32, batch=4, topk=8, ce=0.0, epochs=2.0, lr=3e-3, warm=0.05, eval_every=10, checkpoint_every=0,
                device="cpu")
    base.update(kw)
    return HealSettings(**base)


def test_target_enters_the_targets_digest_not_the_prefix_digest(tmp_path, models):
    teacher, student, td = models
    a, b = _s(train_from=1, target="topk"), _s(train_from=1, target="sampled")
    assert heal_stages.targets_digest(teacher, td, a) != heal_stages.targets_digest(teacher, td, b)
    assert heal_stages.prefix_digest(student, td, a) == heal_stages.prefix_digest(student, td, b)
    # with ce = 1 no teacher takes part: the kind changes nothing
    assert heal_stages.targets_digest(None, td, _s(ce=1.0, target="topk")) == heal_stages.targets_digest(None, td, _s(ce=1.0, target="full"))
    # the draws' seed matters to "sampled" only
    assert heal_stages.targets_digest(teacher, td, _s(target="sampled", seed=1)) != heal_stages.targets_digest(teacher, td, b)
    assert heal_stages.targets_digest(teacher, td, _s(target="topk", seed=1)) == heal_stages.targets_digest(teacher, td, a)
    # heal twice in one work directory: the second run makes new targets, reuses the prefix
    work = tmp_path / "work"
    heal(student, teacher, td, _s(train_from=1, target="topk", epochs=0.3), tmp_path / "a.cmf", work_dir=work,
         progress=False, score_split=None)
    prefix_dir = next(work.glob("prefix-*"))
    stamp = (prefix_dir / "meta.json").stat().st_mtime_ns
    heal(student, teacher, td, _s(train_from=1, target="sampled", epochs=0.3), tmp_path / "b.cmf", work_dir=work,
         progress=False, score_split=None)
    assert len(list(work.glob("targets-*"))) == 2 and len(list(work.glob("prefix-*"))) == 1
    assert (prefix_dir / "meta.json").stat().st_mtime_ns == stamp
    kinds = sorted(store.read_meta(d)["kind"] for d in work.glob("targets-*"))
    assert kinds == ["sampled", "topk"]


@pytest.mark.parametrize("target,ce", [("topk+rest", 0.0), ("sampled", 0.0), ("full", 0.3)])
def test_every_kind_heals(tmp_path, models, target, ce):
    teacher, student, td = models
    rep = heal(student, teacher, td, _s(target=target, ce=ce, epochs=1.0), tmp_path / "h.cmf", progress=False)
    m = rep["metrics"]
    assert m["heldout_best"] < m["heldout_start"]
    nll = rep["nll"]
    assert nll["healed"] < nll["student"]
    prov = open_cmf(tmp_path / "h.cmf").provenance["heal"]
    assert prov["settings"]["target"] == target and prov["gap"]["nll"] == nll


def test_full_trainer_loss_is_the_dense_kl_of_the_teacher(tmp_path, models):
    from cortiq.model import load_model

    teacher_cmf, student_cmf, td = models
    s = _s(target="full", ce=0.3)
    tdir = tmp_path / "targets-f"
    heal_stages.teacher_targets(teacher_cmf, td, s, tdir, progress=False)
    tg = targets_mod.Targets(tdir)
    assert tg.k == 1 and tg.kind == "full" and tg.teacher == str(teacher_cmf)
    _, wins = targets_mod.window_sets(td, s)
    w = wins["train"]
    ids = torch.from_numpy(w.ids[:4])
    tid = torch.from_numpy(tg.ids["train"].take([0, 1, 2, 3]).astype("int64")).reshape(-1, 1)
    tp = torch.from_numpy(tg.probs["train"].take([0, 1, 2, 3])).reshape(-1, 1)
    assert torch.equal(tid[:, 0], torch.from_numpy(w.next[:4]).reshape(-1).long())
    teacher = load_model(teacher_cmf).eval()
    student = load_model(student_cmf)
    tail = StudentTail(student, 0, False, drop_prefix=False)
    got = batch_loss(tail, ids, None, tid, tp, 7, torch.device("cpu"), torch.float32, Objective("full", teacher, 0.3))
    with torch.no_grad():
        th, _ = teacher.forward_hidden(ids)
        sh, _ = student.forward_hidden(ids)
    ref = dense_kl_reference(sh.reshape(-1, sh.shape[-1]).double(), student.head_weight.double(),
                             th.reshape(-1, th.shape[-1]).double(), teacher.head_weight.double(), tid[:, 0],
                             tp[:, 0].double(), 0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_gap_is_reported_on_other_text_when_given(tmp_path, models, capsys):
    from cortiq.cli import main
    from cortiq.data import BuildSettings, build

    teacher, student, td = models
    other = tmp_path / "other.txt"
    other.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
                     "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. " * 6)
    ev = tmp_path / "eval"
    build([str(other)], teacher, ev, BuildSettings(record_tokens=64, fractions=(1.0, 0.0, 0.0)))
    out = tmp_path / "h.cmf"
    rc = main(["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--out", str(out), "--window", "32",
               "--batch", "4", "--topk", "8", "--target", "sampled", "--lr", "3e-3", "--epochs", "1",
               "--eval-data", str(ev), "--device", "cpu", "--retain-sources", "none", "--quiet"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # the three measures last: the heal data's own test split, the general panel (here the other text), the facts
    assert lines[-3].startswith("your data: gap recovered")
    assert lines[-2].startswith("general panel: gap recovered") and lines[-2].endswith("never trained on: eval)")
    assert lines[-1].startswith("facts kept (the fact probe's held part, ")
    gap = open_cmf(out).provenance["heal"]["gap"]
    assert gap["text"].startswith("general panel") and gap["parts"]["eval"]["text"].startswith(str(ev))
    # the NLLs recorded are those of the three model files on every record of the other text, as
    # `cortiq nll` scores them (the eval data is all train split)
    n = gap["nll"]
    for name, path in (("source", teacher), ("student", student), ("healed", out)):
        assert main(["nll", str(path), str(ev), "--split", "train", "--json", "--device", "cpu"]) == 0
        assert n[name] == pytest.approx(json.loads(capsys.readouterr().out)["nll"], rel=1e-5), name
    assert gap["gap_recovered"] == pytest.approx((n["student"] - n["healed"]) / (n["student"] - n["source"]))
