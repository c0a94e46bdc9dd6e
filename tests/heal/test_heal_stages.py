"""The heal stages on tiny models: healing a perturbed student lowers the held-out
KL and moves test NLL toward the teacher; the prefix cache changes no loss;
export keeps the student's codecs; bad input fails before any work."""

import pytest
import torch

from cortiq import store
from cortiq.cmf import open_cmf
from cortiq.errors import CortiqError
from cortiq.heal import HealSettings, check_inputs, heal
from cortiq.heal import prefix as prefix_mod
from cortiq.heal import stages as heal_stages
from cortiq.heal import targets as targets_mod
from cortiq.heal.stages import train
from cortiq.tokenizer import byte_tokenizer_json
from cortiq.tracking import MemoryLogger

from heal_models import arch, perturbed, random_weights, save, tdata


@pytest.fixture
def models(tmp_path):
    a = arch()
    w = random_weights(a)
    teacher = save(tmp_path / "teacher.cmf", a, w)
    mlp16 = {n: "f16" for n in w if ".mlp." in n}
    student = save(tmp_path / "student.cmf", a, perturbed(w), codecs=mlp16)
    return teacher, student, tdata(tmp_path, teacher)


def _s(**kw):
    base = dict(window=32, batch=4, topk=8, ce=0.0, epochs=2.0, lr=3e-3, warm=0.05, eval_every=10, checkpoint_every=20,
                device="cpu")
    base.update(kw)
    return HealSettings(**base)


def test_heal_lowers_heldout_kl_and_moves_nll_toward_the_teacher(tmp_path, models):
    teacher, student, td = models
    log = MemoryLogger()
    rep = heal(student, teacher, td, _s(), tmp_path / "healed.cmf", log, progress=False)
    m = rep["metrics"]
    assert m["heldout_best"] < 0.7 * m["heldout_start"]
    nll = rep["nll"]
    assert abs(nll["healed"] - nll["source"]) < 0.7 * abs(nll["student"] - nll["source"])
    assert 0.3 < m["gap_recovered"]
    # the export: the student's codecs, the heal provenance, the trained weights
    f = open_cmf(tmp_path / "healed.cmf")
    assert f.info("model.layers.0.mlp.up_proj.weight").codec == "f16"
    assert f.info("model.layers.0.self_attn.q_proj.weight").codec == "f32"
    prov = f.provenance["heal"]
    assert prov["steps"] == m["steps"] and prov["best_step"] == m["best_step"] and prov["ce"] == 0.0
    assert prov["heldout_best"] == m["heldout_best"]
    s0 = open_cmf(student)
    assert not torch.equal(f.tensor("model.layers.1.mlp.down_proj.weight"), s0.tensor("model.layers.1.mlp.down_proj.weight"))
    assert torch.equal(f.tensor("model.embed_tokens.weight"), s0.tensor("model.embed_tokens.weight"))  # frozen
    assert [v for _, v in log.series("train.loss")] == [h["loss"] for h in rep["history"]]


def test_prefix_cache_gives_the_same_losses_as_running_the_prefix(tmp_path, models):
    teacher, student, td = models
    s = _s(train_from=1, epochs=0.5)
    tdir = tmp_path / "targets-x"
    heal_stages.teacher_targets(teacher, td, s, tdir, progress=False)
    pdir = tmp_path / "prefix-x"
    assert heal_stages.prefix_cache(student, td, s, pdir, progress=False)["dtype"] == "f32"
    cached = train(student, tdir, pdir, td, s, tmp_path / "w1", progress=False)
    plain = train(student, tdir, None, td, s, tmp_path / "w2", progress=False)
    assert cached["prefix_cached"] and not plain["prefix_cached"]
    torch.testing.assert_close(torch.tensor([h["loss"] for h in cached["history"]]),
                               torch.tensor([h["loss"] for h in plain["history"]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([e["heldout"] for e in cached["evals"]]),
                               torch.tensor([e["heldout"] for e in plain["evals"]]), rtol=1e-5, atol=1e-6)


def test_prefix_plan_by_budget():
    n, T, H = 10, 100, 64
    b32 = n * T * H * 4
    assert prefix_mod.prefix_dtype(n, T, H, int(b32 / 0.3) + 1, 1) == "f32"
    assert prefix_mod.prefix_dtype(n, T, H, int(b32 / 0.3) - 10, 1) == "f16"
    assert prefix_mod.prefix_dtype(n, T, H, int(b32 / 2 / 0.3) - 10, 1) == "none"
    assert prefix_mod.prefix_dtype(n, T, H, 1 << 40, 0) == "none"


def test_f16_prefix_cache_is_read_back(tmp_path, models):
    teacher, student, td = models
    s = _s(train_from=1)
    n = sum(len(w) for w in targets_mod.window_sets(td, s)[1].values())
    s.mem_budget_gb = (n * 32 * 32 * 4 * 0.75) / 0.3 / (1 << 30)  # f32 does not fit, f16 does
    pdir = tmp_path / "prefix-y"
    assert heal_stages.prefix_cache(student, td, s, pdir, progress=False)["dtype"] == "f16"
    pre = prefix_mod.Prefix(pdir)
    assert pre.h["train"].take([0]).dtype.name == "float16"
    assert store.is_complete(pdir)


def test_ce_one_runs_no_teacher_and_targets_are_the_next_tokens(tmp_path, models):
    _, student, td = models
    s = _s(ce=1.0)
    tdir = tmp_path / "targets-ce"
    rep = heal_stages.teacher_targets(None, td, s, tdir, progress=False)
    assert rep["teacher"] is False
    tg = targets_mod.Targets(tdir)
    _, wins = targets_mod.window_sets(td, s)
    assert tg.k == 1
    ids = tg.ids["train"].take(list(range(len(wins["train"]))))[..., 0]
    probs = tg.probs["train"].take(list(range(len(wins["train"]))))[..., 0]
    assert (ids == wins["train"].next).all()
    assert (probs == wins["train"].weight).all()


def test_bad_inputs_fail_before_any_work(tmp_path, models):
    teacher, student, td = models
    other_tok = save(tmp_path / "other.cmf", arch(), random_weights(arch()),
                     tok_json=byte_tokenizer_json(("<|a|>", "<|b|>", "<|c|>")))
    with pytest.raises(CortiqError, match="tokenizer differs"):
        check_inputs(student, other_tok, td, _s())
    other_vocab = save(tmp_path / "v.cmf", arch(vocab=300), random_weights(arch(vocab=300)))
    with pytest.raises(CortiqError, match="vocabulary of 300 ids"):
        check_inputs(student, other_vocab, td, _s())
    with pytest.raises(CortiqError, match="train_from 2 is beyond its 2 layers"):
        check_inputs(student, teacher, td, _s(train_from=2))
    with pytest.raises(CortiqError, match="fewer than one batch of 5000"):
        check_inputs(student, teacher, td, _s(batch=5000))
    (tmp_path / "nv").mkdir()
    td_noval = tdata(tmp_path / "nv", teacher, fractions=(0.9, 0.0, 0.1))
    with pytest.raises(CortiqError, match="val split has no scored window"):
        heal(student, teacher, td_noval, _s(), tmp_path / "x.cmf", progress=False)
    assert not (tmp_path / "x.cmf.work").exists() and not (tmp_path / "x.cmf").exists()
