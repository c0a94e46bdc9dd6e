"""The parts of a training loop the heal's student and the MTP draft share: the
learning-rate shape (warm-up then cosine, or Genesis), Adam, the update rule
(a step whose loss or gradient norm is not finite is skipped, `MAX_SKIPPED` of
them abort) and the loop's state, which writes itself into a checkpoint and
reads itself back.

Each loop (cortiq.heal.train.fit, cortiq.mtp.draft.train) is its setup and a
short `while` over these parts; what differs between them (the batches, the
evaluation, what "better" means) stays in the loop's own module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import CortiqError

#: non-finite steps in a run that abort it
MAX_SKIPPED = 20


# ── the schedule ─────────────────────────────────────────────────────────


def warm_steps(total: int, warm: float) -> int:
    return max(1, int(total * warm))


def lr_shape(step: int, total: int, warm: float = 0.1, genesis: bool = False) -> float:
    """The multiplier of the peak rate at 1-based `step` of `total`.

    Plain: linear warm-up over max(1, warm·total) steps (Adam's first steps
    move every trained weight by ~lr at once; a long ramp keeps the held-out
    loss from jumping), then a cosine down to 0.1 of the peak at the end.
    Genesis: (1 − e^(−t/τ))·e^(−t/2T) with τ = T/3."""
    if genesis:
        t, tt = float(step), float(total)
        return (1.0 - math.exp(-t / (tt / 3.0))) * math.exp(-t / (2.0 * tt))
    w = warm_steps(total, warm)
    if step <= w:
        return step / w
    pr = min(1.0, (step - w) / max(1, total - w))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * pr))


# ── the optimizer and the update rule ────────────────────────────────────


def adam(groups: list[dict], lr: float, device):
    """torch's Adam over `groups`, fused on CUDA and on a CPU alike: one kernel for
    every parameter's update, the same arithmetic, and a non-finite step skipped
    on the device (found_inf)."""
    import torch

    return torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type in ("cuda", "cpu"))


def skips_on_device(opt) -> bool:
    """Whether `opt` takes a device flag that skips its step (`opt.found_inf`, 1.0:
    skip; torch's fused Adam), so the step can be launched before the host knows
    whether the loss was finite."""
    import torch

    return type(opt) is torch.optim.Adam and bool(opt.defaults.get("fused"))


@dataclass(frozen=True)
class Update:
    """What one step's update did: the step's loss and gradient norm (read on the
    host), whether it was skipped (either not finite), and the rate it ran at (NaN
    when skipped before a rate was set)."""

    loss: float
    grad_norm: float
    skipped: bool
    lr: float = math.nan


def update(opt, loss, grad_norm, set_rate, on_device: bool) -> Update:
    """One update of `opt` unless the step's loss or gradient norm ([] tensors on
    the device, the gradients already clipped) is not finite. `set_rate()` sets
    the rate of the update and returns it; a skipped step's gradients are the
    caller's to clear.

    `on_device` (skips_on_device(opt), decided once a run): the update is launched
    before the host reads the two values, its kernels queued behind the backward,
    and skipped on the device when they are not finite (found_inf: no update, step
    count kept); the host waits once, after (waiting before the update left the GPU
    idle at the end of every sharded step: bench/RESULTS.md, "Where the two-GPU step
    goes"). Otherwise it reads first and steps after."""
    import torch

    rate = math.nan
    if on_device:
        opt.found_inf = (~(torch.isfinite(grad_norm) & torch.isfinite(loss))).float()
        rate = set_rate()
        opt.step()
    lv, gn = torch.stack([loss.float(), grad_norm.float()]).tolist()  # one wait for both
    if not (math.isfinite(lv) and math.isfinite(gn)):
        return Update(lv, gn, True, rate)
    if not on_device:
        rate = set_rate()
        opt.step()
    return Update(lv, gn, False, rate)


# ── the loop's state ─────────────────────────────────────────────────────


@dataclass
class LoopState:
    """What a training loop carries from step to step. `to_checkpoint()` is its checkpoint
    form (plain values and tensors, no classes: a checkpoint never unpickles code),
    `from_checkpoint` reads it back; a loop's own state adds fields to it."""

    #: updates made (skipped steps do not count)
    done: int = 0
    #: steps skipped as not finite
    skipped: int = 0
    #: seconds spent in counted steps
    step_secs: float = 0.0
    #: one row per update: step, loss, lr, grad norm (and what the loop adds)
    history: list = field(default_factory=list)
    #: one row per evaluation
    evals: list = field(default_factory=list)
    #: evaluations in a row that did not count as better (the plateau stop)
    stale: int = 0
    #: the step the run stopped early at (0: it did not)
    stopped: int = 0

    def to_checkpoint(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_checkpoint(cls, d: dict):
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def skip(self, what: str, hint: str) -> None:
        """Count a skipped step; the MAX_SKIPPED-th aborts the run with one line."""
        self.skipped += 1
        if self.skipped >= MAX_SKIPPED:
            raise CortiqError(f"{what}: {MAX_SKIPPED} non-finite steps (last at step {self.done + 1}); {hint}")

    def counted(self, up: Update, secs: float, **extra) -> dict:
        """Count an update that ran: its history row (`extra` added to it)."""
        self.done += 1
        self.step_secs += secs
        row = {"step": self.done, "loss": up.loss, "lr": up.lr, "grad_norm": up.grad_norm, **extra}
        self.history.append(row)
        return row


@dataclass
class Best:
    """The best evaluation so far: its value, its step, the weights then (a snapshot)."""

    value: float
    step: int = 0
    state: Any = None

    def offer(self, value: float, step: int, snapshot, higher: bool = False) -> bool:
        """Keep (`value`, `step`, `snapshot()`) when it is better (lower, or with
        `higher` higher) than the best so far; whether it was."""
        if not (value > self.value if higher else value < self.value):
            return False
        self.value, self.step, self.state = value, step, snapshot()
        return True
