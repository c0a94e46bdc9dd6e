"""The training loop's shared parts (cortiq.train_loop): the update rule says a skipped step
is skipped (on the device and on the host alike), the skip limit's one line, the loop state's
checkpoint form (the keys heal checkpoints have always had) and the best-so-far rule."""

import math

import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.heal.train import HealState
from cortiq.train_loop import MAX_SKIPPED, Best, LoopState, adam, skips_on_device, update

CPU = torch.device("cpu")


def _opt():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    return p, adam([{"params": [p]}], 0.1, CPU)


@pytest.mark.parametrize("on_device", [True, False])
def test_a_non_finite_step_is_skipped_and_says_so(on_device):
    p, opt = _opt()
    assert skips_on_device(opt)  # fused Adam on a CPU too
    up = update(opt, torch.tensor(float("nan")), torch.tensor(1.0), lambda: 0.1, on_device)
    assert up.skipped and math.isnan(up.loss) and up.grad_norm == 1.0
    assert torch.equal(p.detach(), torch.ones(3))  # no update made
    up = update(opt, torch.tensor(2.0), torch.tensor(1.0), lambda: 0.25, on_device)
    assert not up.skipped and (up.loss, up.grad_norm, up.lr) == (2.0, 1.0, 0.25)
    assert torch.all(p.detach() < 1.0)


def test_the_skip_limit_aborts_with_one_line():
    st = LoopState(done=7)
    for _ in range(MAX_SKIPPED - 1):
        st.skip("heal", "lower lr")
    with pytest.raises(CortiqError, match=f"^heal: {MAX_SKIPPED} non-finite steps \\(last at step 8\\); lower lr$"):
        st.skip("heal", "lower lr")


def test_the_heal_state_plain_form_is_the_checkpoints_state_table():
    # the keys a heal checkpoint's "state" has held since checkpoints began: an older one resumes
    keys = {"done", "cursor", "skipped", "scale", "step_secs", "history", "evals", "stale", "stopped", "mix"}
    st = HealState(done=3, cursor=5, scale=8.0, history=[{"step": 1}], mix={"w": [0.5]})
    assert set(st.to_checkpoint()) == keys
    assert HealState.from_checkpoint(st.to_checkpoint()) == st


def test_best_keeps_only_a_better_value():
    b = Best(1.0, 0, "w0")
    assert not b.offer(1.0, 3, lambda: "w3") and (b.value, b.step, b.state) == (1.0, 0, "w0")
    assert b.offer(0.5, 4, lambda: "w4") and (b.value, b.step, b.state) == (0.5, 4, "w4")
    hi = Best(0.2)
    assert hi.offer(0.3, 2, lambda: "x", higher=True) and not hi.offer(0.1, 3, lambda: "y", higher=True)
