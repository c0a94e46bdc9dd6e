"""heal's resumable checkpoints against the disk (cortiq.heal.disk): two copies, one at a time, or none,
each said; the run's result the same in every mode, and a killed run still resumes where one fits."""

import pytest
import torch

from cortiq.heal import disk
from cortiq.heal.parallel import CHECKPOINT
from cortiq.heal.settings import HealSettings
from cortiq.heal.train import StudentTail, fit

from heal_toy import KillAt, Killed, ToyLM, toy_split

CPU = torch.device("cpu")
GIB = 1 << 30


def test_checkpoint_size_and_mode():
    assert disk.checkpoint_bytes(1000, adam8=False) == 16_000 + disk.OVERHEAD
    assert disk.checkpoint_bytes(1000, adam8=True) == 10_000 + disk.OVERHEAD
    assert disk.checkpoint_bytes(1000, adam8=False, averaged=True) == 20_000 + disk.OVERHEAD  # the f32 average too
    need, reserve = 10 * GIB, 3 * GIB
    base = reserve + disk.SLACK
    assert disk.checkpoint_mode(need, base + 2 * need, reserve) == disk.KEEP
    assert disk.checkpoint_mode(need, base + 2 * need - 1, reserve) == disk.REPLACE
    assert disk.checkpoint_mode(need, base + need, reserve) == disk.REPLACE
    assert disk.checkpoint_mode(need, base + need - 1, reserve) == disk.OFF
    # the Qwen3-8B geometry's student (75 % of the MLP neurons, 6.9B weights, every layer trained) on a 64 GiB disk
    assert disk.checkpoint_mode(disk.checkpoint_bytes(6_900_000_000, adam8=True), 64 * GIB, 14 * GIB) == disk.OFF


def _setup():
    teacher, student = ToyLM(seed=0), ToyLM(seed=1)
    tail = StudentTail(student, 0, False, drop_prefix=False)
    return tail, toy_split(teacher, 24, 8, 4, 5, seed=2), toy_split(teacher, 6, 8, 4, 5, seed=3, train=False)


def _disk_gb(tail, copies: float) -> float:
    """A disk that holds `copies` checkpoints of this tail beside its healed model and the margin."""
    trained = sum(p.numel() for _, p in tail.named())
    return (2 * trained + disk.SLACK + copies * disk.checkpoint_bytes(trained, False)) / GIB


class _Steps(KillAt):
    """A logger that notes each training step it is told of."""

    def __init__(self):
        super().__init__(None)
        self.seen = []

    def log_metrics(self, metrics, step=None):
        if "loss" in metrics:
            self.seen.append(step)


def _settings(**kw):
    return HealSettings(**{**dict(epochs=3.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=4,
                                  topk=5), **kw})


@pytest.mark.parametrize("copies, mode, said", [(2.5, disk.KEEP, ""), (1.5, disk.REPLACE, "one checkpoint at a time"),
                                                (0.5, disk.OFF, "no resumable checkpoints")])
def test_each_mode_gives_the_same_weights_and_says_itself(tmp_path, capsys, copies, mode, said):
    tail, tr, va = _setup()
    ref = fit(tail, tr, va, _settings(), tmp_path / "ref", CPU, torch.float32, key="k", progress=False)
    want = tail.state()
    tail2, tr2, va2 = _setup()
    capsys.readouterr()
    rep = fit(tail2, tr2, va2, _settings(disk_gb=_disk_gb(tail2, copies)), tmp_path / "b", CPU, torch.float32,
              key="k", progress=False)
    err = capsys.readouterr().err
    assert (said in err) if said else "resumable checkpoint" not in err
    assert (tmp_path / "b" / CHECKPOINT).exists() == (mode != disk.OFF)
    assert rep["metrics"]["best_step"] == ref["metrics"]["best_step"]
    for n, w in want.items():
        assert torch.equal(w, tail2.state()[n]), n


def test_one_checkpoint_at_a_time_still_resumes_a_killed_run(tmp_path):
    s = _settings()
    tail, tr, va = _setup()
    fit(tail, tr, va, s, tmp_path / "a", CPU, torch.float32, key="k", progress=False)
    want = tail.state()
    tail2, tr2, va2 = _setup()
    s1 = _settings(disk_gb=_disk_gb(tail2, 1.5))
    with pytest.raises(Killed):  # killed after step 9, past the checkpoint at step 8
        fit(tail2, tr2, va2, s1, tmp_path / "b", CPU, torch.float32, key="k", logger=KillAt(9), progress=False)
    tail3, tr3, va3 = _setup()
    steps = _Steps()
    fit(tail3, tr3, va3, s1, tmp_path / "b", CPU, torch.float32, key="k", logger=steps, progress=False)
    assert steps.seen == list(range(9, 19))  # it went on from the checkpoint at step 8
    for n, w in want.items():
        assert torch.equal(w, tail3.state()[n]), n
