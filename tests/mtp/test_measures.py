"""Hold rates, drafts per round, the chain layout and the round-ordered walk on hand-built and random cases."""

import pytest
import torch

from cortiq.mtp import measures as M


def T(x):
    return torch.tensor(x, dtype=torch.long)


def test_chain_counts_hand_built():
    # one window of 6 tokens; the trunk's top-1 t1[p] is its guess for token p+1
    ids = T([[5, 1, 2, 3, 4, 9]])
    t1 = T([[1, 2, 3, 7, 9, 0]])  # rows 0..2 and 4 are right; row 3 guesses 7 for token 4
    lens = T([6])
    # step 1: row p guesses token p+2 and holds when it equals t1[p+1]
    d1 = T([[2, 0, 7, 9, 0, 0]])  # rows 0, 2, 3 hold (2==t1[1], 7==t1[3], 9==t1[4]); row 1 misses
    # step 2: row p guesses token p+3 (t1[p+2])
    d2 = T([[3, 0, 9, 0, 0, 0]])  # row 0 holds (3==t1[2]); row 2: 9==t1[4]
    draft = torch.stack([d1, d2])
    got = M.chain_counts(ids, lens, t1, draft)
    # step 1 counts rows p < 5 whose fed token ids[p+1] == t1[p]: p=0,1,2 (ids[4]=4 != t1[3]=7, p=3 out; ids[5]=9==t1[4] p=4 in)
    # rows 0,1,2,4 counted; held: 0 (2==2), 2 (7==7); row 1 (0!=3) and row 4 (0 != t1[5]=0? d1[4]=0, t1[5]=0 -> holds)
    assert got[0].tolist() == [4, 3]
    # step 2 rows p < 4 held at step 1 and fed ids[p+2]==t1[p+1]: p=0 (ids2=2==t1[1]=2) counted, holds;
    # p=2: ids[4]=4 != t1[3]=7 -> not fed
    assert got[1].tolist() == [1, 1]
    assert torch.equal(got, M.chain_counts_reference(ids, lens, t1, draft))
    r = M.rates(got)
    assert r == [0.75, 1.0]
    assert M.drafts_per_round(got) == pytest.approx(0.75 + 0.75 * 1.0)


def test_drafts_per_round_is_sum_of_prefix_products():
    assert M.drafts_per_round([0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert M.drafts_per_round([1.0, 0.0, 1.0]) == pytest.approx(1.0)
    assert M.drafts_per_round(torch.tensor([[0, 0], [4, 4]])) == 0.0  # nothing counted at step 1: rate 0


def _random_case(seed, N=5, Tn=23, chain=3, V=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N, Tn), generator=g)
    # the trunk mostly agrees with the text and the draft mostly with the trunk, so chains reach deep steps
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    t1 = torch.where(torch.rand(N, Tn, generator=g) < 0.8, nxt, torch.randint(0, V, (N, Tn), generator=g))
    lens = torch.randint(1, Tn + 1, (N,), generator=g)
    lens[0] = Tn
    draft = torch.stack([
        torch.where(torch.rand(N, Tn, generator=g) < 0.7, torch.cat([t1[:, j:], t1[:, :j]], 1), torch.randint(0, V, (N, Tn), generator=g))
        for j in range(1, chain + 1)
    ])
    return ids, lens, t1, draft


@pytest.mark.parametrize("seed", range(6))
def test_chain_counts_matches_reference(seed):
    ids, lens, t1, draft = _random_case(seed)
    got = M.chain_counts(ids, lens, t1, draft)
    assert torch.equal(got, M.chain_counts_reference(ids, lens, t1, draft))
    assert got[-1, 0] > 0  # the case reaches the last step
    assert (got[1:, 0] <= got[:-1, 1]).all()  # a step only counts rows the step before held


def test_splice_hand_built():
    # one window of 8 rows, H=1: src rows are 10+p, out rows 100+p
    src = (10 + torch.arange(8.0)).view(1, 8, 1)
    out = (100 + torch.arange(8.0)).view(1, 8, 1)
    lens, off = T([7]), T([1])
    # stride 3, step 2: chains start at 1, 4 (n+2 < 7; 7 is not); row q = n+1 reads out[q-1]
    got = M.splice(src, out, lens, off, 3, 2)
    want = src.clone()
    want[0, 2, 0] = 101
    want[0, 5, 0] = 104
    assert torch.equal(got, want)
    # step 3: n + 3 < 7 -> n = 1 only; row 3 reads out[2]
    got3 = M.splice(src, out, lens, off, 3, 3)
    want3 = src.clone()
    want3[0, 3, 0] = 102
    assert torch.equal(got3, want3)


@pytest.mark.parametrize("seed", range(4))
def test_splice_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    N, Tn, H, stride = 4, 19, 3, 4
    src, out = torch.randn(N, Tn, H, generator=g), torch.randn(N, Tn, H, generator=g)
    lens = torch.randint(2, Tn + 1, (N,), generator=g)
    off = torch.randint(0, stride, (N,), generator=g)
    for j in (2, 3, 4):
        assert torch.equal(M.splice(src, out, lens, off, stride, j), M.splice_reference(src, out, lens, off, stride, j))


def test_round_counts_hand_built():
    ids = T([[0, 1, 2, 3, 4, 5, 6, 7]])
    t1 = T([[1, 2, 3, 4, 9, 6, 7, 0]])  # the trunk agrees with the text but at row 4 (9 != 5)
    lens = T([8])
    # the draft on the layout: row q guesses token q+2, held when == t1[q+1]
    d = T([[2, 3, 0, 5, 6, 7, 0, 0]])  # rows 0,1 hold; row 2 misses; row 3 guesses 5 != t1[4]=9; rows 4,5 hold
    # stride 3, offset 0: chains at 0, 3, 6; chain 2
    got = M.round_counts(ids, lens, t1, d, T([0]), 3, 2)
    # chain 0: q=0 fed (ids1==t1[0]), hit -> q=1 fed, hit: step1 1/1, step2 1/1
    # chain 3: q=3 fed (ids4=4==t1[3]=4), miss (5 != 9): step1 +1 counted 0 held
    # chain 6: q=6 fed (ids7=7==t1[6]=7), d[6]=0 vs t1[7]=0 -> hit; q=7: q+1 = 8 >= len -> stop
    assert got.tolist() == [[3, 2], [1, 1]]
    assert torch.equal(got, M.round_counts_reference(ids, lens, t1, d, T([0]), 3, 2))


@pytest.mark.parametrize("seed", range(6))
def test_round_counts_matches_reference(seed):
    ids, lens, t1, draft = _random_case(seed, chain=1)
    stride, chain = 4, 3
    off = torch.randint(0, stride, (ids.shape[0],), generator=torch.Generator().manual_seed(seed))
    got = M.round_counts(ids, lens, t1, draft[0], off, stride, chain)
    assert torch.equal(got, M.round_counts_reference(ids, lens, t1, draft[0], off, stride, chain))


def test_order_counts_hand_built():
    # stride 3, chain 2: the walk starts at 0; a round at n reads top[n % 3]
    ids = T([[0, 1, 2, 3, 4, 5, 6]])
    t1 = T([[1, 2, 3, 4, 5, 6, 0]])  # the trunk agrees with the text everywhere
    lens = T([7])
    top = torch.zeros(3, 1, 7, dtype=torch.long)
    top[0, 0] = T([2, 3, 0, 0, 0, 0, 0])  # round at 0: rows 0, 1 hold -> kept 2, next round at 3
    top[0, 0, 3] = 9  # round at 3 (3 % 3 = 0): row 3 misses (9 != 5) -> next at 4
    top[1, 0, 4] = 6  # round at 4 (4 % 3 = 1): row 4 holds (6 == t1[5]); row 5 guesses 0 == t1[6] -> holds
    top[1, 0, 5] = 0
    # next round at 7: past the end
    got = M.order_counts(ids, lens, t1, top, 3, 2)
    # rounds at 0 (2 steps, both hold), 3 (step 1 miss), 4 (step 1 hold, step 2: q=5, q+1=6 < 7 fed, hold)
    assert got.tolist() == [[3, 2], [2, 2]]
    assert torch.equal(got, M.order_counts_reference(ids, lens, t1, top, 3, 2))


@pytest.mark.parametrize("seed", range(8))
def test_order_counts_matches_reference(seed):
    g = torch.Generator().manual_seed(100 + seed)
    N, Tn, V, stride, chain = 4, 37, 2, 4, 3
    ids = torch.randint(0, V, (N, Tn), generator=g)
    t1 = torch.where(torch.rand(N, Tn, generator=g) < 0.8, torch.cat([ids[:, 1:], ids[:, :1]], 1), 1 - torch.cat([ids[:, 1:], ids[:, :1]], 1))
    lens = torch.randint(2, Tn + 1, (N,), generator=g)
    top = torch.randint(0, V, (stride, N, Tn), generator=g)
    got = M.order_counts(ids, lens, t1, top, stride, chain)
    assert torch.equal(got, M.order_counts_reference(ids, lens, t1, top, stride, chain))
    assert got[0, 0] > 0


def test_walk_counts_hand_built():
    # chain 2; the trunk agrees with the text everywhere; the walk starts at row 2 (a prompt of 3)
    ids = T([[0, 1, 2, 3, 4, 5, 6, 7, 8]])
    t1 = T([[1, 2, 3, 4, 5, 6, 7, 8, 0]])
    lens = T([9])
    d = torch.zeros(2, 1, 9, dtype=torch.long)  # d[j-1, 0, n]: the chain starting at n, step j (guess for n+j+1)
    d[:, 0, 2] = T([4, 5])  # round at 2: both hold (t1[3]=4, t1[4]=5) -> next round at 5
    d[:, 0, 5] = T([9, 8])  # round at 5: step 1 misses (9 != t1[6]=7) -> next at 6
    d[:, 0, 6] = T([8, 0])  # round at 6: holds (8 == t1[7]); step 2: q=7, 8 < 9 fed, 0 == t1[8] -> holds; next at 9
    d[:, 0, 0] = T([2, 3])  # row 0 is before the start: never walked
    got = M.walk_counts(ids, lens, t1, d, T([2]))
    assert got.tolist() == [[3, 2], [2, 2]]
    assert torch.equal(got, M.walk_counts_reference(ids, lens, t1, d, T([2])))
    # a decode of 4 new tokens runs the rounds starting before row 2 + 4: those at 2 and 5
    got = M.walk_counts(ids, lens, t1, d, T([2]), span=4)
    assert got.tolist() == [[2, 1], [1, 1]]
    assert torch.equal(got, M.walk_counts_reference(ids, lens, t1, d, T([2]), 4))
    # drafts a round = what such a decode accepts: 2 drafts over 2 rounds
    assert M.drafts_per_round(got) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(8))
def test_walk_counts_matches_reference(seed):
    g = torch.Generator().manual_seed(200 + seed)
    N, Tn, V, chain = 5, 41, 2, 3
    ids = torch.randint(0, V, (N, Tn), generator=g)
    t1 = torch.where(torch.rand(N, Tn, generator=g) < 0.85, torch.cat([ids[:, 1:], ids[:, :1]], 1),
                     1 - torch.cat([ids[:, 1:], ids[:, :1]], 1))
    lens = torch.randint(2, Tn + 1, (N,), generator=g)
    draft = torch.randint(0, V, (chain, N, Tn), generator=g)
    start = torch.randint(0, Tn + 2, (N,), generator=g)  # some past the window's end
    for span in (None, 1, 7, 100):
        got = M.walk_counts(ids, lens, t1, draft, start, span)
        assert torch.equal(got, M.walk_counts_reference(ids, lens, t1, draft, start, span)), span
    assert M.walk_counts(ids, lens, t1, draft, start)[0, 0] > 0


@pytest.mark.parametrize("seed", range(3))
def test_walk_from_zero_is_the_order_walk_of_one_layout(seed):
    """A layout's row q at step j is the chain starting at q-j+1: with one layout (stride 1)
    the round-ordered walk reads the same drafts as the walk over chain starts."""
    g = torch.Generator().manual_seed(300 + seed)
    N, Tn, V, chain = 3, 29, 2, 3
    ids = torch.randint(0, V, (N, Tn), generator=g)
    t1 = torch.where(torch.rand(N, Tn, generator=g) < 0.85, torch.cat([ids[:, 1:], ids[:, :1]], 1), 1 - ids)
    lens = torch.randint(2, Tn + 1, (N,), generator=g)
    top = torch.randint(0, V, (1, N, Tn), generator=g)
    draft = torch.stack([torch.cat([top[0, :, j:], top[0, :, :j]], 1) for j in range(chain)])  # [chain, N, T]
    zero = torch.zeros(N, dtype=torch.long)
    assert torch.equal(M.walk_counts(ids, lens, t1, draft, zero), M.order_counts(ids, lens, t1, top, 1, chain))
