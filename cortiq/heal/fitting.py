"""Which layers a heal trains where the step must fit the device: `train_from`
left unset ("auto") is decided here, and a setting that cannot fit is refused
here, before the teacher pass or any other heavy work.

The estimate is the memory plan's (cortiq.heal.memory.step_bytes) on the
student's geometry, read from its CMF without loading it: for each candidate
`train_from` t, the trained layers t.. (their weights, gradients and Adam
moments, their activations) beside the weights on the device (the embedding,
head and trained layers in f32; the frozen layers too when their output is not
cached: cortiq.heal.prefix.prefix_dtype). Fewer trained layers never need more,
so the lowest t that fits is found by walking up from 0.

The rules (docs/internals.md, "Defaults that fit"):
- auto, memory auto: every layer when some plan fits them; else the lowest t from
  which one does, said in one line; none from the last layer alone: one error line;
- auto with a memory plan named: every layer, and that plan must fit them;
- an explicit train_from: the memory plan in effect (the one named, or some plan
  under auto) must fit from it.
A setting that does not fit is one CortiqError line with the estimate, the
allowance and the settings that would fit. Nothing is planned (every layer, no
check) where no allowance is known (a CPU without `device_mem_gb`) or the step
spreads over GPUs (FSDP splits the weights, gradients and moments there).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from .. import dist
from ..errors import CortiqError
from . import memory as mem
from .settings import HealSettings, mem_budget_bytes

#: bytes a weight takes on the device while training (f32 master weights)
F32 = 4


@dataclass
class Geometry:
    """What the estimate needs of a student, read from its CMF's tensor shapes."""

    weights: list[int]  # per layer: every weight
    trained: list[int]  # per layer: the weights a tail from it trains (the MLP's only with ffn_only)
    inter: list[int]  # per layer: the MLP's width
    other: int  # embedding, final norm, head, draft block: on the device whatever trains
    hidden: int
    vocab: int
    teacher: int = 0  # weights of a teacher run online at every step ("full" targets)


def geometry(student_cmf, ffn_only: bool, teacher_cmf=None) -> Geometry:
    from ..cmf import open_cmf

    f = open_cmf(student_cmf)
    a = f.arch
    n = a.num_layers
    weights, trained, inter, other = [0] * n, [0] * n, [2 * a.hidden_size] * n, 0
    for name in f.names:
        shape = f.info(name).shape
        size = _numel(shape)
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            other += size
            continue
        i = int(parts[2])
        weights[i] += size
        trained[i] += size if not ffn_only or parts[3] == "mlp" else 0
        if name.endswith("mlp.down_proj.weight"):
            inter[i] = max(inter[i], int(shape[1]))
    teacher = 0
    if teacher_cmf is not None:
        te = open_cmf(teacher_cmf)
        teacher = sum(_numel(te.info(x).shape) for x in te.names)
    return Geometry(weights, trained, inter, other, int(a.hidden_size), int(a.vocab_size), teacher)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


class Fit:
    """The estimate of a heal's step for every `train_from`, against the allowance."""

    def __init__(self, g: Geometry, s: HealSettings, device, windows: int):
        from .prefix import prefix_dtype

        self.g, self.s, self.device = g, s, device
        self.n = len(g.weights)
        budget = mem_budget_bytes(s.mem_budget_gb)
        #: whether the frozen layers' output is cached from each t (else they stay on the device)
        self.cached = [prefix_dtype(windows, s.window, g.hidden, budget, t) != "none" for t in range(self.n)]
        self.have = mem.adam8_asker(mem.have_adam8)
        self.micro = s.micro_windows()
        #: measured once: every candidate is judged against the same free memory
        self.free = mem.free_bytes(device) if device.type == "cuda" else 0

    def shape(self, t: int) -> mem.StepShape:
        g, s = self.g, self.s
        return mem.StepShape(trained=sum(g.trained[t:]), tokens=s.batch * s.window, windows=s.batch, hidden=g.hidden,
                             inter=max(g.inter[t:]), layers=self.n - t, vocab=g.vocab, chunk=s.head_chunk,
                             head_entry=s.target_kind.head_entry)

    def there(self, t: int) -> int:
        """Bytes of weights on the device before the step, training from `t`."""
        g = self.g
        on = g.other + sum(g.weights[t:]) + (0 if self.cached[t] else sum(g.weights[:t]))
        return F32 * (on + (g.teacher if self.s.target_kind.online else 0))

    def allow(self, t: int) -> tuple[float | None, str]:
        return mem.allowance(self.s.device_mem_gb, self.device, self.there(t), loaded=False, free=self.free)

    def need(self, t: int, plan: mem.MemoryPlan) -> int:
        return mem.step_bytes(self.shape(t), plan.parts, self.micro, plan.layers)

    def named(self, t: int) -> mem.MemoryPlan:
        """The plan the settings name, trained from `t`."""
        return mem.named_plan(self.s.memory_parts(), self.shape(t), self.s.checkpoint_layers)

    def fastest(self, t: int) -> mem.MemoryPlan | None:
        """What memory auto would run from `t`, when some plan fits."""
        return mem.fastest_fit(self.shape(t), self.micro, self.allow(t)[0], self.have, self.s.checkpoint_layers)

    def fits(self, t: int, plan: mem.MemoryPlan) -> bool:
        return self.need(t, plan) <= self.allow(t)[0]

    def lowest(self, t0: int, named: bool) -> int | None:
        """The lowest t >= t0 from which the named plan (`named`), else some plan, fits."""
        return next((t for t in range(t0, self.n)
                     if (self.fits(t, self.named(t)) if named else self.fastest(t) is not None)), None)


def fit_layers(student_cmf, teacher_cmf, tdata_dir, s: HealSettings, say: bool = True) -> HealSettings:
    """`s` with `train_from` decided where it is unset, once the step's estimate fits the
    allowance (the module's rules); one line to stderr (with `say`) when auto trains fewer
    than every layer; CortiqError when a setting given cannot fit."""
    from ..devices import rank_device
    from .targets import window_sets

    if "adam8" in (s.memory_parts() or ()):
        mem.adam8_class()  # named 8-bit moments without torchao: said now, not after the teacher pass
    auto = s.train_from is None
    done = s.every_layer_when_unset()
    if s.gpus > 1 or dist.active():
        return done
    device = rank_device(s.device, "heal settings")
    g = geometry(student_cmf, s.ffn_only, teacher_cmf if s.target_kind.online else None)
    if mem.allowance(s.device_mem_gb, device, 0)[0] is None:
        return done
    _, wins = window_sets(tdata_dir, s)
    fit = Fit(g, s, device, sum(len(w) for w in wins.values()))
    t = done.train_from
    named = s.memory_parts() is not None
    if named:
        if not fit.fits(t, fit.named(t)):
            raise CortiqError(_named_too_big(fit, t))
        return done
    if fit.fastest(t) is not None:
        return done
    up = fit.lowest(t + 1, named=False)
    if not auto or up is None:
        raise CortiqError(_auto_too_big(fit, t, up, auto))
    if say:
        allow, budget = fit.allow(t)
        lean = mem.leanest(fit.shape(t), fit.have)
        print(f"cortiq: heal: training every layer does not fit the {mem.size(allow)} the step may use{budget}: "
              f"{mem.size(fit.need(t, lean))} with the leanest plan, {mem.plan_option(lean)}; training "
              f"layers {up}-{fit.n - 1} (train_from {up}), plan {fit.fastest(up)}", file=sys.stderr)
    return dataclasses.replace(s, train_from=up)


def _named_too_big(fit: Fit, t: int) -> str:
    """The line that refuses the named memory plan from `t`, with what would fit instead."""
    plan = fit.named(t)
    allow, budget = fit.allow(t)
    head = (f"heal: --memory {fit.s.memory} needs {mem.size(fit.need(t, plan))}"
            f"{'' if t == 0 else f' from train_from {t}'}, {mem.size(allow)} allowed{budget}")
    ways = []
    other = fit.fastest(t)
    if other is not None:
        ways.append(f"--memory {mem.plan_option(other)} fits")
    up = fit.lowest(t + 1, named=True)
    if up is not None:
        ways.append(f"--train-from {up}")
    if not ways:
        up = fit.lowest(t + 1, named=False)
        if up is None:
            return f"{head}: {_nothing(fit)}"
        ways.append(f"--train-from {up} with --memory {mem.plan_option(fit.fastest(up))} fits")
    return f"{head}: {', or '.join(ways)}"


def _auto_too_big(fit: Fit, t: int, up: int | None, auto: bool) -> str:
    """The line that says no plan fits from `t` (the explicit train_from, or every layer under auto)."""
    lean = mem.leanest(fit.shape(t), fit.have)
    allow, budget = fit.allow(t)
    what = "training every layer" if auto else f"train_from {t}"
    head = (f"heal: {what} needs {mem.size(fit.need(t, lean))} with the leanest plan "
            f"({mem.plan_option(lean)}), {mem.size(allow)} allowed{budget}")
    if up is None:
        return f"{head}: {_nothing(fit)}"
    return f"{head}: --train-from {up} fits (plan {fit.fastest(up)})"


def _nothing(fit: Fit) -> str:
    return (f"not even the last layer alone fits (a larger --device-mem-gb or device, or a smaller --batch or "
            f"--window: {fit.s.batch} windows of {fit.s.window} now)")
