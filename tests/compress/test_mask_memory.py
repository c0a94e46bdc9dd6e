"""The mask step that fits: recomputed layers and micro-batches give the plain step's gate
gradients, and a device budget set small makes the masks stage plan them (one line) and learn
the same gates."""

import pytest
import torch

from cortiq.compress import learn_masks, read_masks
from cortiq.compress.masks import OBJECTIVES, _micro_step, l1_pull
from cortiq.compress.memory import MaskPlan, choose, shape_of, step_bytes
from cortiq.compress.settings import MaskSettings
from cortiq.heal import memory as hmem

from compress_helpers import tiny_cmf, tiny_tdata

MASK = dict(keep_frac=0.75, lr=0.1, eval_every=5, max_steps=10, settle=1, window=32, batch=4, val_windows=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("maskmem")
    m = tiny_cmf(tmp / "m.cmf", width=48, layers=3)
    return m, tiny_tdata(m, tmp / "td")


def _gated(path):
    from cortiq.model import load_model

    model = load_model(path)
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_neuron_gates(True, init=0.0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.neuron_logits.copy_(torch.randn(layer.mlp.neuron_logits.shape, generator=g) * 2)
    return model


def _gate_grads(model):
    out = [l.mlp.neuron_logits.grad.clone() for l in model.layers]
    for l in model.layers:
        l.mlp.neuron_logits.grad = None
    return out


@pytest.mark.parametrize("objective", ["data", "teacher"])
def test_recomputed_layers_and_micro_batches_give_the_plain_gate_gradients(tiny, objective):
    from cortiq.data import Tdata, windows

    path, td = tiny
    model = _gated(path)
    params = [l.mlp.neuron_logits for l in model.layers]
    n_all = sum(p.numel() for p in params)
    train = windows(Tdata.open(td), "train", 32, loss_on="all")
    loss = OBJECTIVES[objective]
    bt = train.batch(0, 4)
    ids, nxt, weight = (torch.from_numpy(x) for x in (bt.ids, bt.next, bt.weight))

    def plain_step():
        tot, w = loss(model, ids, nxt, weight)
        (tot / w.clamp_min(1e-9) + l1_pull(params, 2.0, n_all)).backward()
        return _gate_grads(model)

    want = plain_step()
    assert all(g.abs().sum() > 0 for g in want)
    got = {}
    for k in range(1, len(model.layers) + 1):  # the lowest k layers recomputed in the backward
        for i, layer in enumerate(model.layers):
            layer.recompute = i < k
        got[f"checkpoint {k}"] = plain_step()
    for micro in (1, 3):
        step = _micro_step(params, lambda i, n, w: loss(model, torch.from_numpy(i), torch.from_numpy(n),
                                                         torch.from_numpy(w))[0], train, 4, micro, n_all)
        step(0, 2.0)
        got[f"checkpoint 3, micro {micro}"] = _gate_grads(model)
    for name, grads in got.items():
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_the_estimate_falls_with_each_saving_and_choose_takes_the_cheapest_that_fits(tiny):
    path, _ = tiny
    sh = shape_of(_gated(path), 4, 32, "data", torch.float32)
    L = sh.layers
    plain = step_bytes(sh, MaskPlan(0, 0, L))
    ck = [step_bytes(sh, MaskPlan(k, 0, L)) for k in range(L + 1)]
    assert ck[0] == plain and all(b < a for a, b in zip(ck, ck[1:]))
    assert step_bytes(sh, MaskPlan(L, 1, L)) < step_bytes(sh, MaskPlan(L, 2, L)) < ck[-1]
    assert choose(sh, None) == (MaskPlan(0, 0, L), True)  # a CPU without a budget: plain
    assert choose(sh, plain) == (MaskPlan(0, 0, L), True)
    assert choose(sh, ck[1]) == (MaskPlan(1, 0, L), True)  # the fewest layers recomputed that fit
    assert choose(sh, ck[1] - 1) == (MaskPlan(2, 0, L), True)
    assert choose(sh, step_bytes(sh, MaskPlan(L, 1, L))) == (MaskPlan(L, 1, L), True)
    assert choose(sh, 1) == (MaskPlan(L, 1, L), False)  # nothing fits: the leanest, said so
    assert str(MaskPlan(1, 0, L)) == f"checkpoint of the lowest 1 of {L} layers"
    assert str(MaskPlan(L, 2, L)) == "checkpoint of every layer, micro-batches of 2 windows"


def test_a_small_device_budget_checkpoints_the_masks_and_learns_the_same_gates(tiny, tmp_path, capsys):
    path, td = tiny
    plain = learn_masks(path, td, MaskSettings(**MASK), tmp_path / "plain", device="cpu")
    assert plain["memory"] == "plain" and "masks memory" not in capsys.readouterr().err
    model = _gated(path)
    sh = shape_of(model, 4, 32, MaskSettings().objective, torch.float32)
    there = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    L = sh.layers
    # room for the step with its lowest layer recomputed, not for the plain step
    gb = (there + (step_bytes(sh, MaskPlan(0, 0, L)) + step_bytes(sh, MaskPlan(1, 0, L))) / 2) / hmem.GiB
    rep = learn_masks(path, td, MaskSettings(**MASK, device_mem_gb=gb), tmp_path / "ck", device="cpu")
    err = capsys.readouterr().err
    assert rep["memory"] == f"checkpoint of the lowest 1 of {L} layers"
    lines = [x for x in err.splitlines() if x.startswith("cortiq: masks memory: ")]
    assert len(lines) == 1 and lines[0].startswith(f"cortiq: masks memory: checkpoint of the lowest 1 of {L} layers: "
                                                   "the plain step's estimate, ")
    assert "does not fit the " in lines[0] and f"(device_mem_gb {gb:g} less " in lines[0]
    # tighter: every layer recomputed and micro-batches; the same gates either way
    gb2 = (there + step_bytes(sh, MaskPlan(L, 1, L)) * 1.01) / hmem.GiB
    rep2 = learn_masks(path, td, MaskSettings(**MASK, device_mem_gb=gb2), tmp_path / "lean", device="cpu")
    assert "micro-batches of" in rep2["memory"]
    want, _ = read_masks(tmp_path / "plain")
    for d in ("ck", "lean"):
        got, _ = read_masks(tmp_path / d)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=d)
    assert rep["metrics"]["mask_pruned"] == plain["metrics"]["mask_pruned"] == rep2["metrics"]["mask_pruned"]
