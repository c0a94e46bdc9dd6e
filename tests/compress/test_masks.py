"""The DTG-MA mask loop with injected step/val callables, then on a tiny model."""

import pytest
import torch
from torch import nn

from cortiq.compress.masks import train_masks
from cortiq.compress.settings import MaskSettings
from cortiq.errors import CortiqError


def _toy(widths=(30, 50), seed=0):
    """Neuron j costs c_j when its gate closes: the loss is Σ c_j (1 − σ(m_j))."""
    g = torch.Generator().manual_seed(seed)
    n = sum(widths)
    imp = [torch.rand(w, generator=g) * 10 + 0.1 for w in widths]
    params = [nn.Parameter(torch.zeros(w)) for w in widths]

    def step_loss(b):
        return sum(((1 - torch.sigmoid(p)) * c).sum() for p, c in zip(params, imp)) / n

    def val():
        with torch.no_grad():
            return float(sum(((1 - torch.sigmoid(p)) * c).sum() for p, c in zip(params, imp)) / n)

    return params, imp, step_loss, val


def test_mask_reaches_the_target_pruning_the_least_important():
    params, imp, step_loss, val = _toy()
    s = MaskSettings(keep_frac=0.75, lr=0.1, l1_init=0.5, l1_step=0.5, eval_every=5, max_steps=400, settle=2)
    r = train_masks(params, 7, step_loss, val, s)
    assert r.reached and r.pruned >= 0.25
    at = [h for h in r.history if h["pruned"] >= 0.25]
    # the best checkpoint at the target, and `settle` evaluations after the first one there
    assert r.nll_hard == min(h["val_hard"] for h in at)
    assert r.steps == at[0]["step"] + s.settle * s.eval_every
    assert r.nll_open == 0.0 and r.nll_hard > 0.0
    # the pressure grew l1·1.5 + step at every evaluation below the target, and not after
    l1 = s.l1_init
    for h in r.history:
        if h["pruned"] < 0.25:
            l1 = l1 * s.l1_grow + s.l1_step
        assert h["l1"] == pytest.approx(l1)
    # what the hard mask pruned is the cheapest: all in the lowest 40 % by importance
    allimp = torch.cat(imp)
    pruned = torch.cat([torch.sigmoid(m) <= s.tau for m in r.logits])
    assert float(pruned.float().mean()) == pytest.approx(r.pruned)
    assert float(allimp[pruned].max()) <= float(torch.quantile(allimp, 0.4))


def test_mask_short_of_the_target_falls_back_to_the_most_pruned():
    params, imp, step_loss, val = _toy()
    s = MaskSettings(keep_frac=0.2, lr=0.05, l1_init=0.1, l1_step=0.1, eval_every=5, max_steps=60)
    r = train_masks(params, 3, step_loss, val, s)
    assert not r.reached and r.steps == 60
    top = max(h["pruned"] for h in r.history)
    most = [h for h in r.history if h["pruned"] == top][-1]  # ties: the later, more trained checkpoint
    assert r.pruned == most["pruned"] and r.step == most["step"]


def test_no_pruning_at_all_still_ranks_by_the_trained_logits():
    # gates far from the threshold: nothing is pruned in 20 steps, yet the
    # logits have moved by importance, and it is those that rank the neurons
    params, imp, step_loss, val = _toy()
    for p in params:
        p.data.fill_(5.0)
    s = MaskSettings(keep_frac=0.75, lr=0.05, l1_init=1.0, l1_step=1.0, eval_every=5, max_steps=20, mask_init=5.0)
    r = train_masks(params, 3, step_loss, val, s)
    assert not r.reached and r.pruned == 0.0
    assert r.step == 20
    assert all(torch.equal(a, b.detach()) for a, b in zip(r.logits, params))
    assert float(torch.cat(r.logits).std()) > 0  # not the flat initial logits


def test_non_finite_steps_are_skipped_then_abort():
    params, imp, step_loss, val = _toy()
    calls = {"n": 0}

    def flaky(b):
        calls["n"] += 1
        return step_loss(b) * (float("nan") if calls["n"] % 3 == 0 else 1.0)

    r = train_masks(params, 4, flaky, val, MaskSettings(max_steps=20, eval_every=5))
    assert r.steps == 20 and r.skipped == 9

    def broken(b):
        return step_loss(b) * float("inf")

    with pytest.raises(CortiqError, match="^DTG-MA: 20 non-finite steps in a row$"):
        train_masks(params, 4, broken, val, MaskSettings(max_steps=50))


def test_mask_settings_are_checked():
    with pytest.raises(CortiqError, match=r"^mask settings: keep_frac 0 is outside \(0, 1\]$"):
        MaskSettings(keep_frac=0.0)
    with pytest.raises(CortiqError, match="loss_on"):
        MaskSettings(loss_on="some")


# ── the teacher objective on a model ──────────────────────────────────────


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    from compress_helpers import tiny_cmf

    from cortiq.model import load_model

    path = tiny_cmf(tmp_path_factory.mktemp("kl") / "m.cmf", width=40)
    source = load_model(path)
    model = load_model(path)
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_neuron_gates(True, init=0.0)
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        with torch.no_grad():
            layer.mlp.neuron_logits.copy_(torch.randn(layer.mlp.neuron_logits.shape, generator=g) * 2)
    ids = torch.randint(0, source.arch.vocab_size, (3, 7), generator=g)
    weight = torch.rand(3, 7, generator=g) * (torch.rand(3, 7, generator=g) > 0.3)
    return source, model, ids, weight


def test_teacher_objective_is_the_weighted_kl_to_the_ungated_source(gated):
    from cortiq.compress.masks import weighted_kl

    source, model, ids, weight = gated
    gates = [l.mlp.neuron_logits for l in model.layers]
    tot, w = weighted_kl(model, ids, ids, weight)
    tot.backward()
    got = [g.grad.clone() for g in gates]
    for g in gates:
        g.grad = None
    # the plain computation: the source as its own model, torch's kl_div per row
    with torch.no_grad():
        t = torch.log_softmax(source(ids).double(), -1)
    s = torch.log_softmax(model(ids).double(), -1)
    ref = (torch.nn.functional.kl_div(s, t, log_target=True, reduction="none").sum(-1) * weight.double()).sum()
    ref.backward()
    assert float(tot.detach()) == pytest.approx(float(ref.detach()), rel=1e-4, abs=1e-6)
    assert float(w) == pytest.approx(float(weight.sum()), rel=1e-6)
    for a, g in zip(got, gates):
        assert torch.allclose(a.double(), g.grad.double(), rtol=1e-3, atol=1e-6)
        g.grad = None
    assert all(l.mlp.neuron_logits is g for l, g in zip(model.layers, gates)), "the gates are back after the source's pass"


def test_teacher_objective_is_zero_with_every_gate_open(gated):
    from cortiq.compress.masks import weighted_kl

    _, model, ids, weight = gated
    saved = [l.mlp.neuron_logits.detach().clone() for l in model.layers]
    with torch.no_grad():
        for l in model.layers:
            l.mlp.neuron_logits.fill_(1e4)
        tot, _ = weighted_kl(model, ids, ids, weight)
        for l, v in zip(model.layers, saved):
            l.mlp.neuron_logits.copy_(v)
    assert abs(float(tot)) < 1e-5
