"""The depth policy of `--spec-auto`, on a fake clock: the step times and acceptances it learns
are given, so each test says which kind of step it must choose. It never chooses a kind that is
not measured to beat a plain step, recovers from one bad sample, measures again the kinds it does
not choose, and reads a batch's acceptance as arrays."""

from __future__ import annotations

import numpy as np
import pytest

from cortiq.serve.policy import PLAIN, DepthPolicy, expected_tokens

KEY = (8, 256)  # (batch bucket, key length): what the engine's `step_key` gives


class NoIter(np.ndarray):
    """An array a Python loop cannot walk: the policy must read a batch with array expressions."""

    def __iter__(self):
        raise AssertionError("the policy looped over the batch in Python")


def slots(n: int) -> np.ndarray:
    return np.arange(n).view(NoIter)


def seeded(k: int, costs: dict, tree: bool = False, key=KEY, **kw) -> DepthPolicy:
    """A policy seeded with start-up times {(depth, tree): seconds} at `key`."""
    pol = DepthPolicy(k, 32, tree=tree, **kw)
    pol.seed({(key, d, t): s for (d, t), s in costs.items()})
    return pol


def accept(pol: DepthPolicy, n: int, kept: int, depth: int, tree: bool = False, rounds: int = 20) -> None:
    """`rounds` rounds of the first n slots, each keeping `kept` of `depth` drafts."""
    for _ in range(rounds):
        pol.kept(slots(n), np.full(n, kept), depth, tree)


def serve(pol: DepthPolicy, truth: dict, turns: int, n: int = 8, key=KEY) -> list:
    """`turns` steps on a fake clock: each chosen kind costs truth[kind] seconds -> the kinds chosen."""
    out = []
    for _ in range(turns):
        a = pol.choose(key, slots(n))
        pol.record(key, a[0], truth[a], a[1])
        out.append(a)
    return out


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 3) == 1.0
    pol = DepthPolicy(3, 4)
    accept(pol, 2, 3, 3)  # slots 0 and 1 keep every draft; 2 and 3 have no rounds: the prior
    got = pol.tokens(slots(4))
    a = pol.acceptance(np.arange(4))
    assert got[PLAIN] == 4 and got[(3, False)] == pytest.approx(sum(expected_tokens(x, 3) for x in a))
    assert a[0] == a[1] > a[2] == a[3] == pytest.approx(pol.alpha[False])


def test_no_time_measured_means_plain_then_each_kind_once():
    pol = DepthPolicy(2, 32)
    assert pol.choose(KEY, slots(8)) == PLAIN  # nothing measured: plain
    assert pol.choose(KEY, slots(8)) == PLAIN  # its time still unknown
    pol.record(KEY, 0, 1.0)
    tried = serve(pol, {PLAIN: 1.0, (1, False): 1.05, (2, False): 1.1}, 2)
    assert tried == [(1, False), (2, False)]  # the kinds with no time, once each
    assert serve(pol, {PLAIN: 1.0, (1, False): 1.05, (2, False): 1.1}, 3) == [(2, False)] * 3


def test_slow_drafts_run_plain_steps():
    """Rounds that cost more than their accepted drafts save (a compute-bound batch): plain, but for
    one turn in `explore`, which measures the others again."""
    truth = {PLAIN: 1.0, (1, False): 2.0, (2, False): 3.0, (3, False): 4.0}
    pol = seeded(3, truth, explore=16)
    accept(pol, 8, 3, 3)  # every draft right: still not worth it
    got = serve(pol, truth, 160)
    assert [a for i, a in enumerate(got, 1) if i % 16] == [PLAIN] * 150
    assert sorted({a for i, a in enumerate(got, 1) if i % 16 == 0}) == [(1, False), (2, False), (3, False)]


def test_rarely_accepted_drafts_run_plain_steps():
    truth = {PLAIN: 1.0, (1, False): 1.05, (2, False): 1.1, (3, False): 1.15}
    pol = seeded(3, truth, explore=1000)
    assert serve(pol, truth, 1) == [(3, False)]  # cheap rounds at the prior acceptance: they pay
    accept(pol, 8, 0, 3, rounds=60)  # then every draft is wrong
    assert serve(pol, truth, 50) == [PLAIN] * 50


def test_a_round_that_barely_pays_is_not_taken():
    """A round has to beat a plain step by the margin: 1.04 tokens a second over 1.0 is not enough."""
    pol = seeded(1, {PLAIN: 1.0, (1, False): 1.0})
    pol.alpha[False] = 0.04
    assert pol.choose(KEY, slots(1)) == PLAIN
    pol.alpha[False] = 0.2
    assert pol.choose(KEY, slots(1)) == (1, False)


def test_the_tree_where_it_pays_the_chain_where_its_rows_cost():
    """A small batch: a tree round costs about a chain round and keeps more, so it runs; at a large one
    the tree's verify rows cost, and the chain runs."""
    cost = {(1, 0): {PLAIN: 1.0, (1, False): 1.2, (2, False): 1.3, (1, True): 1.25, (2, True): 1.4},
            (32, 0): {PLAIN: 2.0, (1, False): 2.6, (2, False): 3.0, (1, True): 4.0, (2, True): 6.5}}
    pol = DepthPolicy(2, 32, tree=True, explore=1000)
    pol.seed({(key, *a): s for key, c in cost.items() for a, s in c.items()})
    assert pol.actions == [PLAIN, (1, False), (2, False), (1, True), (2, True)]
    accept(pol, 32, 1, 2)  # chain rounds keep half their drafts
    accept(pol, 32, 2, 2, tree=True, rounds=3)  # tree rounds all of them
    accept(pol, 32, 1, 2, tree=True, rounds=1)
    assert pol.choose((1, 0), slots(1)) == (2, True)
    assert pol.choose((32, 0), slots(32)) == (2, False)
    assert pol.summary()["chosen"] == {"0": 0, "1": 0, "2": 1, "tree 1": 0, "tree 2": 1}


def test_one_bad_early_sample_does_not_stay():
    """A tree round of 3 timed once at five times its cost (a stall at start-up) is not the best by
    that time (a tree round of 2 is); it runs again when it is the kind measured longest ago, and
    from then on it is chosen."""
    truth = {PLAIN: 1.0, (1, False): 1.2, (2, False): 1.3, (3, False): 1.4, (1, True): 1.25, (2, True): 1.35,
             (3, True): 1.45}
    pol = seeded(3, {**truth, (3, True): 5 * truth[(3, True)]}, tree=True, explore=8)
    accept(pol, 8, 2, 3)
    accept(pol, 8, 3, 3, tree=True)
    got = serve(pol, truth, 8 * 8)  # got[i]: turn i + 1
    first = got.index((3, True))
    assert first == 8 * 6 - 1  # the sixth exploring turn: the kinds measured longest ago ran first, in turn
    assert [got[i] for i in range(7, first, 8)] == [PLAIN, (1, False), (2, False), (3, False), (1, True)]
    assert {got[i] for i in range(first) if (i + 1) % 8} == {(2, True)}  # the best by the times it had
    assert all(a == (3, True) for i, a in enumerate(got[first + 1:], first + 2) if i % 8)


def test_an_estimate_ages():
    """The kinds not chosen are measured again in turn: each within explore x (kinds - 1) turns."""
    truth = {PLAIN: 1.0, (1, False): 3.0, (2, False): 3.0}
    pol = seeded(2, truth, explore=4)
    last = {}
    for i, a in enumerate(serve(pol, truth, 64), 1):
        last[a] = i
        assert all(i - last.get(b, 0) <= 4 * 2 for b in pol.actions)
    assert pol.explored == 16


def test_a_step_costs_its_turn_where_the_host_is_slower():
    """Device times alone say a round (2 ms) does not pay over a plain step (1 ms) at 0.4 acceptance;
    turns of 3 ms each, whatever the step, say the host sets the pace and the round's 1.4 tokens a
    request are nearly free. When the turns wait for the device again, device time rules."""
    pol = seeded(1, {PLAIN: 1e-3, (1, False): 2e-3}, explore=1000)
    pol.alpha[False] = 0.4
    assert pol.choose(KEY, slots(32)) == PLAIN and pol.cost(KEY, 1) == 2e-3
    for d in (0, 0, 1, 1, 1):
        pol.record_period(KEY, d, 3e-3)
    assert pol.cost(KEY, 0) == pol.cost(KEY, 1) == 3e-3
    assert pol.choose(KEY, slots(32)) == (1, False)
    for _ in range(5):  # a device-bound batch: the turn waits for the step
        pol.record_period(KEY, 0, 1.05e-3)
        pol.record_period(KEY, 1, 2.05e-3)
    assert pol.choose(KEY, slots(32)) == PLAIN
    assert set(pol.summary()["turn_ms"]) == {"8x256 0", "8x256 1"}


def test_a_new_request_starts_from_the_prior():
    pol = DepthPolicy(2, 4)
    accept(pol, 4, 0, 2, rounds=3)
    assert pol.acceptance(np.arange(4)).max() < pol.alpha[False] < 0.5
    pol.join(2)
    a = pol.acceptance(np.arange(4))
    assert a[2] == pol.alpha[False] and a[0] < a[2]
