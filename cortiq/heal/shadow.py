"""A copy of the trained weights kept beside them through a heal, in the weights' own form (each rank's
shard under FSDP): the moving average that the evaluations score and the heal keeps
(HealSettings.average). It moves with all the weights in one multi-tensor kernel a step; `reference`
is its plain form, weight by weight, that the tests compare it with."""

from __future__ import annotations

import torch

from .parallel import shard_of


class Average:
    """A moving average of the trained weights (HealSettings.average), kept beside them in their own form
    (each rank's shard under FSDP), and the swap that puts it in their place for an evaluation."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], decay: float):
        self.decay = decay
        self.state = {n: p.detach().clone() for n, p in named}  # as a checkpoint saves it: DTensors stay
        self.weights = [shard_of(p) for _, p in named]
        self.mean = [shard_of(m) for m in self.state.values()]

    def decay_at(self, done: int) -> float:
        """The decay of the update after `done` others: short at first (as TensorFlow's moving average
        with num_updates), so the average leaves the student within a few steps rather than carry
        decay^steps of it to the end (0.99^245 is 8 %)."""
        return min(self.decay, (1 + done) / (10 + done))

    @torch.no_grad()
    def update(self, done: int) -> None:
        torch._foreach_lerp_(self.mean, self.weights, 1.0 - self.decay_at(done))

    def reference(self, done: int) -> None:
        """`update`, weight by weight: the plain form the test compares it with."""
        with torch.no_grad():
            for m, w in zip(self.mean, self.weights):
                m.add_((1.0 - self.decay_at(done)) * (w - m))

    @torch.no_grad()
    def load(self, state: dict) -> None:
        """A checkpoint's average (same names, this run's form: shards where the weights are) in place."""
        for m, n in zip(self.mean, self.state):
            m.copy_(shard_of(state[n]))

    @torch.no_grad()
    def swap(self) -> None:
        """The average in the weights' place, and the weights in its. One tensor at a time: the swap
        needs room for the largest, not a third copy of them all."""
        for w, m in zip(self.weights, self.mean):  # a few hundred tensors, once an evaluation
            held = w.clone()
            w.copy_(m)
            m.copy_(held)
