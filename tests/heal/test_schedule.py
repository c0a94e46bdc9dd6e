"""The heal run's rate schedules: warm-up then cosine to 0.1, and Genesis."""

import math

import pytest

from cortiq.heal.schedule import genesis_decay, genesis_from
from cortiq.train_loop import lr_shape, warm_steps


def test_warmup_is_linear_then_cosine_to_a_tenth():
    total, warm = 100, 0.1
    assert warm_steps(total, warm) == 10
    assert [lr_shape(s, total, warm) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_shape(total, total, warm) == pytest.approx(0.1)
    mid = 10 + 45
    assert lr_shape(mid, total, warm) == pytest.approx(0.1 + 0.9 * 0.5)
    vals = [lr_shape(s, total, warm) for s in range(10, total + 1)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_warmup_is_at_least_one_step():
    assert warm_steps(5, 0.0) == 1
    assert lr_shape(1, 5, 0.0) == 1.0


def test_genesis_rate_curve():
    T = 90
    tau = T / 3
    for t in (1, 30, 60, 90):
        assert lr_shape(t, T, 0.1, genesis=True) == pytest.approx((1 - math.exp(-t / tau)) * math.exp(-t / (2 * T)))
    # it rises, peaks and falls
    vals = [lr_shape(t, T, 0.1, genesis=True) for t in range(1, T + 1)]
    peak = max(range(T), key=vals.__getitem__)
    assert 0 < peak < T - 1


def test_genesis_window_widens_from_the_top():
    assert [genesis_from(e, 64, 0) for e in range(5)] == [52, 40, 24, 0, 0]
    assert [genesis_from(e, 30, 0) for e in range(4)] == [30 - 6, 30 - 12, 30 - 19, 0]
    assert genesis_from(3, 30, 7) == 7  # never below train_from
    assert genesis_from(0, 2, 0) == 1  # at least one layer


def test_genesis_decay():
    assert genesis_decay(10, 10, 0) == 1.0
    assert genesis_decay(15, 10, 0) == pytest.approx(math.exp(-0.5))
    assert genesis_decay(15, 10, 1) == pytest.approx(math.exp(-0.25))
    assert genesis_decay(3, 10, 0) == 1.0
