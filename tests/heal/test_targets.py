"""Targets: the hard-target slot and the ce mix against a dense reference; the KL of the mix."""

import pytest
import torch

from cortiq.heal.loss import topk_kl
from cortiq.heal.kinds import mix_targets
from cortiq.heal.targets import mix_targets_reference


def _teacher(n=23, v=41, k=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    probs = torch.softmax(torch.randn(n, k, generator=g), -1)
    nxt = torch.randint(0, v, (n,), generator=g)
    nxt[::3] = ids[::3, 2]  # some rows: the teacher ranked the data's token
    weight = (torch.rand(n, generator=g) > 0.25).float()
    return ids, probs, nxt, weight, v


def _dense(ids, probs, v):
    out = torch.zeros(ids.shape[0], v, dtype=torch.float64)
    return out.scatter_add_(1, ids.long(), probs.double())


@pytest.mark.parametrize("ce", [0.0, 0.3, 0.75, 1.0])
def test_mix_matches_dense_reference(ce):
    ids, probs, nxt, weight, v = _teacher()
    mi, mp = mix_targets(ids, probs, nxt, weight, ce)
    ref = mix_targets_reference(ids, probs, nxt, weight, ce, v)
    torch.testing.assert_close(_dense(mi, mp, v), ref, rtol=1e-6, atol=1e-7)
    # ids stay distinct within a row (the kernel-free loss would double count otherwise)
    srt = mi.sort(1).values
    assert torch.all(srt[:, 1:] != srt[:, :-1])
    # every scored row carries its weight as mass; unscored rows none
    torch.testing.assert_close(mp.sum(1), weight, rtol=1e-5, atol=1e-6)


def test_hard_slot_kl_matches_plain_reference():
    ids, probs, nxt, weight, v = _teacher()
    ce = 0.4
    mi, mp = mix_targets(ids, probs, nxt, weight, ce)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(len(nxt), 16, generator=g, dtype=torch.float64)
    w = torch.randn(v, 16, generator=g, dtype=torch.float64)
    dense = mix_targets_reference(ids, probs, nxt, weight, ce, v)
    logp = torch.log_softmax(h @ w.t(), -1)
    ref = (torch.xlogy(dense, dense) - dense * logp).sum()
    torch.testing.assert_close(topk_kl(h, w, mi, mp, chunk=5), ref, rtol=1e-6, atol=1e-6)


def test_ce_one_is_the_nll_of_the_next_token():
    ids, probs, nxt, weight, v = _teacher()
    mi, mp = mix_targets(ids, probs, nxt, weight, 1.0)
    assert mi.shape == (len(nxt), 1) and torch.equal(mi[:, 0], nxt)
    h = torch.randn(len(nxt), 8, dtype=torch.float64)
    w = torch.randn(v, 8, dtype=torch.float64)
    nll = (torch.nn.functional.cross_entropy(h @ w.t(), nxt, reduction="none") * weight.double()).sum()
    torch.testing.assert_close(topk_kl(h, w, mi, mp), nll)


def test_row_writer_renames_when_done_and_leaves_nothing_when_it_fails(tmp_path):
    import numpy as np
    import pyarrow as pa

    from cortiq.heal.rows import RowWriter, open_table

    with RowWriter(tmp_path / "ok.arrow", {"x": (pa.float32(), 3)}) as wr:
        wr.write(x=np.arange(6, dtype=np.float32).reshape(2, 3))
    assert open_table(tmp_path / "ok.arrow").column("x").to_pylist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(RuntimeError, match="boom"):
        with RowWriter(tmp_path / "bad.arrow", {"x": (pa.float32(), 3)}) as wr:
            wr.write(x=np.zeros((1, 3), dtype=np.float32))
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.arrow"]


@pytest.mark.parametrize("kind", ["topk", "topk+rest", "sampled"])
def test_confident_rows_weigh_one_plus_the_teachers_top_probability(kind):
    from cortiq.heal.kinds import KINDS, REST_ID
    from cortiq.heal.targets import weigh_confident

    g = torch.Generator().manual_seed(5)
    n, V, k = 13, 50, 8
    z = torch.randn(n, V, generator=g) * 3
    nxt = torch.randint(0, V, (n,), generator=g)
    weight = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    tid, tp = KINDS[kind].chunk_rows(z, nxt, weight, k, 0.0, g) if kind != "topk" else \
        mix_targets(*torch.softmax(z, -1).topk(k, -1)[::-1], nxt, weight, 0.0)
    p2, w2 = weigh_confident(tid, tp, weight, 2.0)
    if kind == "sampled":  # the most drawn id's share of the k draws
        top = torch.stack([tp[r].max() / weight[r] if weight[r] > 0 else torch.tensor(0.0) for r in range(n)])
    else:  # the teacher's own top probability
        top = torch.softmax(z, -1).max(-1).values
    f = 1 + 2.0 * torch.where(weight > 0, top, torch.zeros(n))
    assert torch.allclose(w2, weight * f, rtol=1e-5)
    assert torch.allclose(p2, tp * f[:, None], rtol=1e-5)
    assert (tid[p2 > 0] != REST_ID).any()
    assert (w2[weight == 0] == 0).all() and (p2[weight == 0] == 0).all()


def test_confident_needs_stored_teacher_targets():
    from cortiq.errors import CortiqError
    from cortiq.heal.settings import HealSettings

    with pytest.raises(CortiqError, match="heal settings: confident 1.0 weighs stored teacher targets, and target 'full'"):
        HealSettings(target="full", confident=1.0)
    with pytest.raises(CortiqError, match="target 'ce' stores none"):
        HealSettings(ce=1.0, confident=1.0)
