"""The fold: neuron selection, least-squares repair, CMF slicing against the gated model."""

import pytest
import torch
from torch import nn

from cortiq.cmf import open_cmf
from cortiq.compress.folding import (activation_scores, fold_cmf, kept_from_b64, repair_down, select_kept)
from cortiq.errors import CortiqError

from compress_helpers import tiny_cmf


def test_select_per_layer_keeps_the_top_in_order():
    s = [torch.tensor([0.1, 5.0, -1.0, 3.0, 2.0]), torch.arange(10.0)]
    k = select_kept(s, 0.6, "per_layer")
    assert k[0].tolist() == [1, 3, 4]
    assert k[1].tolist() == [4, 5, 6, 7, 8, 9]


def test_select_per_layer_keeps_a_multiple_when_asked():
    torch.manual_seed(0)
    scores = [torch.randn(n) for n in (200, 96, 40)]
    kept = select_kept(scores, 0.75, multiple_of=64)
    # 150 -> 128, 72 -> 64, 30 -> at least one multiple but at most the width: 40
    assert [len(k) for k in kept] == [128, 64, 40]
    for s, k in zip(scores, kept):  # still the best of each layer, in order
        assert torch.equal(k, torch.topk(s, len(k)).indices.sort().values)
    assert [len(k) for k in select_kept(scores, 0.75, multiple_of=1)] == [150, 72, 30]


def test_select_global_rounds_each_layers_count_to_the_multiple():
    g = torch.Generator().manual_seed(1)
    # layer 0 is all better than layer 1: the ranking gives it all 200 and 50 + the floor to layer 1
    scores = [torch.randn(200, generator=g) + 9.0, torch.randn(160, generator=g), torch.randn(100, generator=g) - 9.0]
    raw = select_kept(scores, 0.75, "global", floor=0.25)
    assert [len(k) for k in raw] == [200, 120, 25]
    kept = select_kept(scores, 0.75, "global", floor=0.25, multiple_of=32)
    # 200 -> 192 (the nearest multiple), 120 -> 128, 25 -> one multiple at least
    assert [len(k) for k in kept] == [192, 128, 32]
    for s, k in zip(scores, kept):  # each layer's best that many, in order
        assert torch.equal(k, torch.topk(s, len(k)).indices.sort().values)


def test_select_global_respects_the_floor():
    g = torch.Generator().manual_seed(0)
    s = [torch.randn(40, generator=g) - 5.0, torch.randn(60, generator=g) + 5.0]  # layer 0 is all worse
    k = select_kept(s, 0.5, "global", floor=0.25)
    assert len(k[0]) == 10 and sum(len(x) for x in k) == 50
    assert k[1].numel() == 40
    # the floor takes layer 0's own best ten
    assert set(k[0].tolist()) == set(torch.topk(s[0], 10).indices.tolist())
    assert all(bool((x[1:] > x[:-1]).all()) for x in k)
    # without the floor's pressure, global ranking picks only from layer 1
    k0 = select_kept(s, 0.5, "global", floor=0.0)
    assert len(k0[0]) == 1 and len(k0[1]) == 49
    # a floor above the share asked for gives way to it: 20 of 100 kept, 8 of layer 0's 40 at least
    k2 = select_kept(s, 0.2, "global", floor=0.25)
    assert sum(len(x) for x in k2) == 20 and len(k2[0]) == 8 and len(k2[1]) == 12
    from cortiq.compress.settings import FoldSettings

    assert FoldSettings(scope="global", keep_frac=0.2).floor == 0.25


def _swiglu(hidden=24, width=96, seed=0):
    torch.manual_seed(seed)
    gate, up, down = nn.Linear(hidden, width, bias=False), nn.Linear(hidden, width, bias=False), nn.Linear(width, hidden, bias=False)
    return gate, up, down


def _acts(gate, up, n, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = gate.weight.shape[1]
    # correlated inputs (rank 6 + noise), so pruned neurons have kept look-alikes
    basis = torch.randn(6, hidden, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, 6, generator=g) @ basis + 0.1 * torch.randn(n, hidden, generator=g)
    with torch.no_grad():
        return nn.functional.silu(gate(x)) * up(x)  # [n, I]


def test_repair_lowers_the_mlp_output_error_on_held_out_activations():
    gate, up, down = _swiglu()
    a_tr, a_te = _acts(gate, up, 2000, 1), _acts(gate, up, 500, 2)
    G = a_tr.T @ a_tr
    W = down.weight.detach()
    kept = select_kept([activation_scores(G, len(a_tr), W)], 0.5)[0]
    ref = a_te @ W.T
    plain = a_te[:, kept] @ W[:, kept].T
    fixed = a_te[:, kept] @ repair_down(W, G, kept, damp=0.01).T
    e_plain, e_fixed = float((ref - plain).norm()), float((ref - fixed).norm())
    assert e_fixed < 0.8 * e_plain, (e_fixed, e_plain)


def test_repair_keeping_everything_undamped_is_identity():
    gate, up, down = _swiglu(width=32)
    a = _acts(gate, up, 1000, 3)
    G = a.T @ a + 1e-3 * torch.eye(32)
    W = down.weight.detach()
    out = repair_down(W, G, torch.arange(32), damp=0.0)
    assert torch.allclose(out, W, atol=1e-4)


def test_activation_scores_from_the_gram_diagonal():
    a = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    W = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    s = activation_scores(a.T @ a, 2, W)
    want = (a.pow(2).mean(0).sqrt() * W.norm(dim=0))
    assert torch.allclose(s, want)


def test_fold_all_kept_is_byte_identical(tmp_path):
    src = open_cmf(tiny_cmf(tmp_path / "m.cmf"))
    out = open_cmf(fold_cmf(src, [torch.arange(48)] * 2, tmp_path / "f.cmf"))
    assert out.arch.intermediate_sizes == [48, 48]
    for n in src.names:
        assert torch.equal(src.stored(n), out.stored(n)), n


def test_fold_equals_the_hard_gated_source(tmp_path):
    from cortiq.model import load_model

    path = tiny_cmf(tmp_path / "m.cmf")
    src = open_cmf(path)
    g = torch.Generator().manual_seed(0)
    kept = [torch.randperm(48, generator=g)[:30].sort().values, torch.randperm(48, generator=g)[:17].sort().values]
    out = fold_cmf(src, kept, tmp_path / "f.cmf", provenance={"note": "t"})
    f = open_cmf(out)
    assert f.arch.intermediate_sizes == [30, 17]
    assert [kept_from_b64(b, 48).tolist() for b in f.provenance["fold"]["kept"]] == [k.tolist() for k in kept]
    ids = torch.randint(0, 259, (2, 11), generator=g)
    ref = load_model(path)
    ref.set_neuron_gates(True)
    with torch.no_grad():
        for layer, k in zip(ref.layers, kept):
            m = torch.full_like(layer.mlp.neuron_logits, -float("inf"))
            m[k] = float("inf")
            layer.mlp.neuron_logits.copy_(m)
        want = ref(ids)
        got = load_model(out)(ids)
    assert torch.allclose(got, want, atol=1e-5)
    # the fold keeps every neuron: the logits are the source's, exactly
    full = load_model(fold_cmf(src, [torch.arange(48)] * 2, tmp_path / "a.cmf"))
    with torch.no_grad():
        assert torch.equal(full(ids), load_model(path)(ids))


def test_fold_rejects_bad_kept_sets(tmp_path):
    src = open_cmf(tiny_cmf(tmp_path / "m.cmf"))
    with pytest.raises(CortiqError, match="layer 0: kept indices"):
        fold_cmf(src, [torch.tensor([3, 1]), torch.arange(48)], tmp_path / "f.cmf")
    with pytest.raises(CortiqError, match="1 kept sets for 2 layers"):
        fold_cmf(src, [torch.arange(48)], tmp_path / "f.cmf")
    assert not (tmp_path / "f.cmf").exists()
