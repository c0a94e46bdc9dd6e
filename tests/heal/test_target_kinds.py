"""The target kinds against plain dense references: the rest bucket's fused
loss (values, gradients, numerics at a peaked row), the online dense KL, the
stored rows of "topk+rest" and "sampled", and the sampled estimate's mean
gradient against the dense KL's (unbiased) next to top-k's (biased)."""

import math

import pytest
import torch

from cortiq.heal.loss import dense_kl, dense_kl_reference, topk_kl, topk_rest_kl, topk_rest_kl_reference
from cortiq.heal.kinds import REST_ID
from cortiq.heal.targets import sparse_rows, topk_rest_reference

N, H, V, K = 37, 24, 101, 5


def _rows(seed=0, n=N, h=H, v=V, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * scale
    return hidden, w, g


def _weights(g, n=N):
    wt = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    wt[[3, 17, n - 1]] = 0.0
    return wt


def _grads(fn, hidden, w):
    h, ww = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, ww)
    (out * 1.3).backward()
    return out.detach(), h.grad, ww.grad


@pytest.mark.parametrize("ce", [0.0, 0.3])
@pytest.mark.parametrize("chunk", [1, 8, 100])
def test_topk_rest_loss_and_gradients_match_the_dense_reference(ce, chunk):
    hidden, w, g = _rows()
    zt = torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0  # a teacher's logits
    nxt = torch.randint(0, V, (N,), generator=g)
    nxt[::4] = zt[::4].argmax(1)  # some rows: the token is the teacher's first choice
    ids, probs = sparse_rows(zt, nxt, _weights(g), "topk+rest", K, ce)
    assert ids.shape == (N, K + (ce > 0) + 1) and torch.all(ids[:, -1] == REST_ID)
    ids, probs, rest = ids[:, :-1], probs[:, :-1].double(), probs[:, -1].double()
    fast = _grads(lambda h, ww: topk_rest_kl(h, ww, ids, probs, rest, chunk=chunk), hidden, w)
    ref = _grads(lambda h, ww: topk_rest_kl_reference(h, ww, ids, probs, rest), hidden, w)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    assert torch.all(fast[1][[3, 17, N - 1]] == 0)  # unscored rows: no gradient


def test_topk_rest_is_zero_at_the_teacher_and_finite_on_a_peaked_row():
    hidden, w, _ = _rows(1)
    z = hidden @ w.t()
    ids, probs = sparse_rows(z, z.argmax(1), torch.ones(N, dtype=torch.float64), "topk+rest", K, 0.0)
    # the student is the teacher: the KL and its gradient vanish, rest bucket
    # included (to the f32 precision the rows are stored in)
    val, gh, gw = _grads(lambda h, ww: topk_rest_kl(h, ww, ids[:, :-1], probs[:, :-1].double(),
                                                    probs[:, -1].double(), chunk=9), hidden, w)
    assert abs(float(val)) < 1e-5 and gh.abs().max() < 1e-5 and gw.abs().max() < 1e-5
    # f32, a row whose listed ids hold all but ~e^-60 of the mass: 1 − Σq is 0 in
    # f32, the logsumexp off the listed ids is not
    hp = torch.zeros(2, 4)
    hp[:, 0] = 60.0
    wp = torch.eye(4, dtype=torch.float32).repeat(3, 1)[:10]  # V = 10, H = 4: logit 60 on ids 0, 4, 8
    lid = torch.tensor([[0, 4], [0, 4]])
    lp = torch.tensor([[0.5, 0.49], [0.5, 0.5]])
    rest = torch.tensor([0.01, 0.0])
    h = hp.clone().requires_grad_()
    loss = topk_rest_kl(h, wp, lid, lp, rest)
    loss.backward()
    # the rest's part: 0.01·(log 0.01 − log q_rest), q_rest = (1 + 7e^-60)/(3 + 7e^-60) ≈ 1/3
    assert torch.isfinite(loss) and torch.isfinite(h.grad).all()
    ref = topk_rest_kl_reference(hp.double(), wp.double(), lid, lp.double(), rest.double())
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    # all but e^-60 of the mass listed: f32 1 − Σq underflows, the fused loss does not
    lid2 = torch.tensor([[0, 4, 8], [0, 4, 8]])
    lp2 = torch.tensor([[0.3, 0.3, 0.3], [0.3, 0.3, 0.4]])
    rest2 = torch.tensor([0.1, 0.0])
    h2 = hp.clone().requires_grad_()
    loss2 = topk_rest_kl(h2, wp, lid2, lp2, rest2)
    loss2.backward()
    # row 0's rest term: 0.1·(log 0.1 − (log(7) − 60 − log 3)) exactly (7 ids at logit 0, 3 at 60)
    lq_rest = math.log(7.0) - 60.0 - math.log(3.0 + 7.0 * math.exp(-60.0))
    listed = sum(p * (math.log(p) + math.log(3.0)) for p in (0.3, 0.3, 0.3, 0.3, 0.3, 0.4))
    expect = listed + 0.1 * (math.log(0.1) - lq_rest)
    assert abs(float(loss2.detach()) - expect) < 1e-4 * abs(expect)
    assert torch.isfinite(h2.grad).all()


@pytest.mark.parametrize("ce", [0.0, 0.3])
def test_dense_kl_matches_the_reference(ce):
    hidden, w, g = _rows(2)
    th = torch.randn(N, 16, generator=g, dtype=torch.float64)
    tw = torch.randn(V, 16, generator=g, dtype=torch.float64) * 0.4
    nxt = torch.randint(0, V, (N,), generator=g)
    wt = _weights(g)
    fast = _grads(lambda h, ww: dense_kl(h, ww, th, tw, nxt, wt, ce, chunk=8), hidden, w)
    ref = _grads(lambda h, ww: dense_kl_reference(h, ww, th, tw, nxt, wt, ce), hidden, w)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("ce", [0.0, 0.3])
def test_topk_rest_rows_match_the_plain_construction(ce):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(N, V, generator=g) * 3.0
    nxt = torch.randint(0, V, (N,), generator=g)
    nxt[::3] = z[::3].topk(K).indices[:, 2]  # some rows: the token among the teacher's k
    nxt[1::5] = z[1::5].topk(K + 1).indices[:, K]  # some: exactly the (k+1)-th
    wt = _weights(g).float()
    ids, probs = sparse_rows(z, nxt, wt, "topk+rest", K, ce)
    ref = topk_rest_reference(z, nxt, wt, K, ce)
    for r in range(N):
        got = {int(i): float(p) for i, p in zip(ids[r, :-1], probs[r, :-1])}
        want = {i: p for i, p in ref[r].items() if i != "rest"}
        assert got.keys() == want.keys()
        for i in got:
            assert abs(got[i] - want[i]) < 1e-5
        assert abs(float(probs[r, -1]) - ref[r]["rest"]) < 1e-5
    torch.testing.assert_close(probs.sum(1), wt, rtol=1e-5, atol=1e-6)  # listed + rest = the row's weight


@pytest.mark.parametrize("ce", [0.0, 0.3])
def test_sampled_rows_are_counts_and_reproducible(ce):
    g = torch.Generator().manual_seed(4)
    z = torch.randn(N, V, generator=g) * 2.0
    nxt = torch.randint(0, V, (N,), generator=g)
    wt = _weights(g).float()
    ids, probs = sparse_rows(z, nxt, wt, "sampled", K, ce, torch.Generator().manual_seed(7))
    again = sparse_rows(z, nxt, wt, "sampled", K, ce, torch.Generator().manual_seed(7))
    assert torch.equal(ids, again[0]) and torch.equal(probs, again[1])
    assert ids.shape == (N, K + (ce > 0))
    for r in range(N):  # distinct ids among the slots that carry weight
        live_ids = ids[r][probs[r] > 0].tolist()
        assert len(live_ids) == len(set(live_ids))
    torch.testing.assert_close(probs.sum(1), wt, rtol=1e-5, atol=1e-6)
    live = wt > 0
    # each entry is weight·((1−ce)·count/k + ce·[token]): counts are whole numbers
    hard = ((ids == nxt[:, None]) & (probs > 0)).float() * ce
    counts = (probs[live] / wt[live, None] - hard[live]) * K / (1.0 - ce)
    torch.testing.assert_close(counts, counts.round(), rtol=0, atol=1e-4)
    if ce > 0:  # the token always has a slot with at least its ce share
        at = ((ids == nxt[:, None]) & (probs > 0)).float() * probs
        assert torch.all(at.sum(1)[live] >= ce * wt[live] - 1e-6)


def test_sampled_mean_gradient_approaches_the_dense_kl_gradient_and_topk_does_not():
    hidden, w, g = _rows(5, n=13, v=61)
    n, v, k, draws = 13, 61, 4, 3000
    zt = torch.randn(n, v, generator=g, dtype=torch.float64) * 1.5
    nxt = torch.randint(0, v, (n,), generator=g)
    wt = torch.ones(n, dtype=torch.float64)
    # the dense KL's gradient w.r.t. the hidden rows, against the teacher's whole distribution
    h = hidden.clone().requires_grad_()
    p = torch.softmax(zt, -1)
    logq = torch.log_softmax(h @ w.t(), -1)
    (-(p * logq).sum()).backward()
    dense = h.grad.clone()
    # `draws` independent sampled target sets, all rows at once
    rep = zt.repeat(draws, 1)
    ids, probs = sparse_rows(rep, nxt.repeat(draws), wt.repeat(draws), "sampled", k, 0.0,
                             torch.Generator().manual_seed(11))
    hr = hidden.repeat(draws, 1).requires_grad_()
    topk_kl(hr, w, ids, probs.double(), chunk=4096).backward()
    per = hr.grad.view(draws, n, -1)  # [draws, n, H]
    mean, se = per.mean(0), per.std(0) / math.sqrt(draws)
    z = (mean - dense).abs() / se.clamp_min(1e-12)
    assert z.max() < 5.5, float(z.max())  # within ~5 standard errors everywhere
    # top-k renormalised over the same k: its gradient stays far off however many rows it sees
    tid = zt.topk(k, -1).indices
    tp = torch.softmax(zt.gather(1, tid), -1)
    ht = hidden.clone().requires_grad_()
    topk_kl(ht, w, tid, tp).backward()
    assert ((ht.grad - dense).abs() / se.clamp_min(1e-12)).max() > 20



@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_kinds_under_bf16_autocast_match_the_f64_reference(dev):
    """The fused losses under bf16 autocast (f32 accumulation; on the GPU as
    training runs them) and the rows drawn on that device by its generator:
    values and gradients to bf16 precision, the draws reproducible."""
    hidden, w, g = _rows(8, n=300, v=517)
    zt = torch.randn(300, 517, generator=g, dtype=torch.float64) * 2.0
    nxt = torch.randint(0, 517, (300,), generator=g)
    wt = torch.ones(300, dtype=torch.float64)
    ids, probs = sparse_rows(zt.to(dev), nxt.to(dev), wt.to(dev), "topk+rest", 16, 0.3)
    ids_c, probs_c = sparse_rows(zt, nxt, wt, "topk+rest", 16, 0.3)
    assert torch.equal(ids.cpu(), ids_c)
    torch.testing.assert_close(probs.cpu(), probs_c, rtol=1e-5, atol=1e-6)
    def bf(t):  # what the bf16 products see
        return t.float().bfloat16().double()

    hb, wb = bf(hidden), bf(w)
    th, tw = torch.randn(300, 24, generator=g, dtype=torch.float64), torch.randn(517, 24, generator=g, dtype=torch.float64) * 0.3
    for fn, ref in (
        (lambda h, ww: topk_rest_kl(h, ww, ids[:, :-1], probs[:, :-1], probs[:, -1], chunk=64),
         lambda h, ww: topk_rest_kl_reference(h, ww, ids_c[:, :-1], probs_c[:, :-1].double(), probs_c[:, -1].double())),
        (lambda h, ww: dense_kl(h, ww, th.float().to(dev), tw.float().to(dev), nxt.to(dev), wt.float().to(dev), 0.3, chunk=64),
         lambda h, ww: dense_kl_reference(h, ww, bf(th), bf(tw), nxt, wt, 0.3)),
    ):
        h, ww = hidden.float().to(dev).requires_grad_(), w.float().to(dev).requires_grad_()
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = fn(h, ww)
        (out * 1.3).backward()  # as _grads does
        r = _grads(ref, hb, wb)
        torch.testing.assert_close(out.double().cpu(), r[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(h.grad.double().cpu(), r[1], rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(ww.grad.double().cpu(), r[2], rtol=5e-2, atol=5e-2)
    gen = lambda: torch.Generator(device=dev).manual_seed(3)  # noqa: E731
    a = sparse_rows(zt.to(dev), nxt.to(dev), wt.to(dev), "sampled", 12, 0.0, gen())
    b = sparse_rows(zt.to(dev), nxt.to(dev), wt.to(dev), "sampled", 12, 0.0, gen())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[1].sum(1).cpu(), wt.float(), rtol=1e-5, atol=1e-6)

