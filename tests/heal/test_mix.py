"""The heal's mix of retain sources: the dynamic re-weighting moves toward the larger gap and stays
bounded, fixed shares give exact counts, a resumed dynamic run equals an uninterrupted one; the
token budget sets the steps and the plateau stop ends a run that no longer improves."""

import dataclasses

import numpy as np
import pytest
import torch

from cortiq.heal.mix import MIX_FLOOR, Mixer
from cortiq.heal.settings import HealSettings
from cortiq.heal.train import StudentTail, fit, val_index_by_source

from heal_toy import KillAt, Killed, ToyLM, toy_split

CPU = torch.device("cpu")
NAMES = ("data", "pydoc", "code")


def test_the_dynamic_update_moves_toward_the_source_with_the_larger_gap_and_stays_bounded():
    m = Mixer(np.array([0] * 6 + [1] * 6 + [2] * 4), 3, seed=0, lr=1.0)
    assert m.base.tolist() == pytest.approx([6 / 16, 6 / 16, 4 / 16])
    m.update([0.1, 0.5, 0.1])
    assert m.w[1] > m.base[1] and m.w[0] < m.base[0] and m.w[2] < m.base[2]
    assert m.w.sum() == pytest.approx(1.0)
    # equal gaps: the same exponent for every source, the shares do not move
    before = m.w.copy()
    m.update([0.3, 0.3, 0.3])
    assert m.w[1] < before[1]  # only the pull back toward the starting shares remains
    for _ in range(50):
        m.update([0.0, 1.0, 0.0])
    assert (m.w >= MIX_FLOOR * m.base - 1e-12).all() and m.w[1] < 1.0
    assert 0.85 < m.w[1] <= 1 - MIX_FLOOR * (m.base[0] + m.base[2])


def test_fixed_shares_give_exact_counts_and_every_window_once_a_pass():
    src = np.array([0] * 12 + [1] * 8 + [2] * 4)
    m = Mixer(src, 3, seed=3, lr=1.0)
    drawn = np.concatenate([m.batch(6) for _ in range(4)])  # one pass: 24 windows
    assert np.bincount(src[drawn]).tolist() == [12, 8, 4]
    assert sorted(drawn.tolist()) == list(range(24))
    again = Mixer(src, 3, seed=3, lr=1.0)
    assert np.array_equal(np.concatenate([again.batch(6) for _ in range(4)]), drawn)


def _setup(seed_student=1):
    teacher, student = ToyLM(seed=0), ToyLM(seed=seed_student)
    tail = StudentTail(student, 0, False, drop_prefix=False)
    tr = toy_split(teacher, 24, 8, 4, 5, seed=2)
    va = toy_split(teacher, 9, 8, 4, 5, seed=3, train=False)
    tr = dataclasses.replace(tr, source=np.array([0, 1, 2] * 8), names=NAMES)
    index, src = val_index_by_source(np.array([0, 1, 2] * 3), 4)
    va = dataclasses.replace(va, index=index, source=src, names=NAMES)
    return tail, tr, va


def _s(**kw):
    base = dict(epochs=3.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=4, topk=5,
                mix="dynamic", patience=0)
    base.update(kw)
    return HealSettings(**base)


def test_dynamic_mix_reports_each_source_and_a_killed_run_resumes_to_the_same_end(tmp_path):
    s = _s()
    tail, tr, va = _setup()
    ref = fit(tail, tr, va, s, tmp_path / "a", CPU, torch.float32, key="k", progress=False)
    ref_w = tail.state()
    ev = ref["evals"]
    assert all(f"heldout.{n}" in e and f"mix.{n}" in e for e in ev for n in NAMES)
    assert any(abs(e["mix.code"] - ev[0]["mix.code"]) > 1e-6 for e in ev[1:])  # the shares moved
    # the shares moved toward the source that was furthest from the teacher at the last evaluation
    gaps = [ev[-2][f"heldout.{n}"] for n in NAMES]
    shifts = [ev[-1][f"mix.{n}"] - ev[-2][f"mix.{n}"] for n in NAMES]
    assert int(np.argmax(shifts)) == int(np.argmax(gaps))

    tail2, tr2, va2 = _setup()
    with pytest.raises(Killed):  # past the checkpoint at step 8
        fit(tail2, tr2, va2, s, tmp_path / "b", CPU, torch.float32, key="k", logger=KillAt(10), progress=False)
    tail3, tr3, va3 = _setup()
    rep = fit(tail3, tr3, va3, s, tmp_path / "b", CPU, torch.float32, key="k", progress=False)
    assert [h["loss"] for h in rep["history"]] == [h["loss"] for h in ref["history"]]
    assert rep["evals"] == ref["evals"]
    for n, w in ref_w.items():
        assert torch.equal(w, tail3.state()[n]), n


def test_a_fixed_mix_reports_each_source_and_draws_the_plain_order(tmp_path):
    tail, tr, va = _setup()
    rep = fit(tail, tr, va, _s(mix="fixed"), tmp_path, CPU, torch.float32, progress=False)
    assert all(f"heldout.{n}" in e and "mix.data" not in e for e in rep["evals"] for n in NAMES)
    # the whole held-out loss is the windows' weighted mean, whatever the batches' sources
    e = rep["evals"][0]
    assert min(e[f"heldout.{n}"] for n in NAMES) <= e["heldout"] <= max(e[f"heldout.{n}"] for n in NAMES)


def test_the_token_budget_sets_the_steps_and_a_plateau_stops_the_run(tmp_path):
    tail, tr, va = _setup()
    rep = fit(tail, tr, va, _s(epochs=0.0, tokens=4 * 8 * 10, mix="fixed"), tmp_path / "a", CPU, torch.float32,
              progress=False)
    assert rep["metrics"]["total_steps"] == rep["metrics"]["steps"] == 10 and rep["metrics"]["tokens"] == 320
    # a rate too small to move the loss: no evaluation improves it, the run stops after `patience` of them
    tail, tr, va = _setup()
    rep = fit(tail, tr, va, _s(lr=1e-12, epochs=10.0, patience=2, mix="fixed"), tmp_path / "b", CPU, torch.float32,
              progress=False)
    m = rep["metrics"]
    assert m["total_steps"] == 60 and m["steps"] == m["stopped_at"] == 6 and m["best_step"] <= 6
