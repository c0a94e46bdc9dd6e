"""The student step's memory plan: which savings it runs with (activation
checkpointing of some or all trained layers, micro-batches with gradient
accumulation, 8-bit Adam moments), the estimate `memory: auto` decides by, and
the optimizer each plan trains with.

Where a plain step's memory goes (bench/RESULTS.md, "Every plan in whole":
Qwen3-1.7B geometry, all layers trained, bf16 autocast): its peak, the end of
the forward, is the f32 weights + two f32 Adam moments of the trained weights
+ the layers' saved activations (the largest part) + the fused head's
[chunk, vocab] buffers. The savings cut the last three: checkpointing keeps one
[tokens, hidden] input per recomputed layer instead of its activations,
micro-batches divide what remains by their count, and 8-bit moments (blockwise,
torchao's AdamW8bit with weight decay 0, i.e. Adam) are 2 B per trained weight
instead of 8.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from ..errors import CortiqError
from ..train_loop import adam
from .kinds import DEFAULT, KINDS, TargetKind
from .settings import MEMORY_PARTS

#: the share of the free device memory the step's estimate may take when no budget is
#: set (the estimate leaves out the allocator's fragmentation and cuBLAS/compile workspaces)
STEP_SHARE = 0.85
#: extra step time of each saving, as a share of the plain step's (bench/RESULTS.md, "Every
#: plan in whole": Qwen3-1.7B, 4 windows of 2048, all layers trained): checkpoint of every
#: trained layer (recomputing a layer costs about its forward, so k of L layers cost k/L of
#: this), micro-batches of one window (larger micro-batches cost less), 8-bit moments
#: (torchao's per-parameter kernels). Together they cost about the product of their
#: factors: auto ranks plans by it.
COST = {"checkpoint": 1 / 0.78 - 1, "micro": 1 / 0.72 - 1, "adam8": 1 / 0.70 - 1}
GiB = float(1 << 30)


@dataclass
class StepShape:
    """What the estimate of one student step needs."""

    trained: int  # trained weights (each with an f32 gradient and two Adam moments)
    tokens: int  # tokens per step (windows × window)
    windows: int  # windows per step
    hidden: int
    inter: int  # the trained layers' widest MLP
    layers: int  # trained layers
    vocab: int
    chunk: int  # rows per chunk of the fused head + loss
    head_entry: int = 4  # bytes per [chunk, vocab] entry of the head + loss (TargetKind.head_entry)


def shape_of(tail, batch: int, window: int, chunk: int, kind: TargetKind = KINDS[DEFAULT]) -> StepShape:
    """The step shape of a StudentTail at `batch` windows of `window` tokens, target `kind`."""
    V, H = tail.model.head_weight.shape
    inter = 2 * H
    for ps in tail.params.values():
        for n, p in ps:
            if n.endswith("mlp.down_proj.weight"):
                inter = max(inter, int(p.shape[1]))
    return StepShape(trained=sum(p.numel() for _, p in tail.named()), tokens=batch * window,
                     windows=batch, hidden=int(H), inter=inter, layers=len(tail.params), vocab=int(V), chunk=chunk,
                     head_entry=kind.head_entry)


def layer_bytes(tokens: int, hidden: int, inter: int) -> int:
    """What one decoder layer saves for its backward under bf16 autocast, `tokens` rows:
    f32 residual inputs of the two norms, bf16 projections, attention output, SwiGLU's
    gate, up and product (fitted at Qwen3-1.7B: `step_bytes`)."""
    return tokens * (24 * hidden + 8 * inter)


def step_bytes(sh: StepShape, parts: tuple[str, ...], micro_windows: int, layers: int | None = None) -> int:
    """Estimated peak bytes of one step beyond the weights already on the device,
    under `parts`, with `layers` of the trained layers checkpointed (the lowest;
    None: all of them when "checkpoint" is in `parts`).

    Per token and trained layer a transformer layer under bf16 autocast saves
    about 24·hidden + 8·inter bytes for its backward (f32 residual inputs of the
    two norms, bf16 projections, attention output, SwiGLU's gate, up and
    product); a checkpointed layer keeps only its f32 input (4·hidden). The step
    peaks at one of two moments:
    - the end of a forward: every kept activation, the checkpointed layers'
      inputs and the head's chunk buffers (with the gradients when an earlier
      micro-batch made them);
    - the backward's recompute of the lowest checkpointed layer: every gradient,
      the checkpointed inputs and one layer's activations (checkpointing the
      lowest layers puts this after the upper layers' activations are freed).
    Fitted to the peaks measured at Qwen3-1.7B (the weights added), it is close on
    every plan but micro-batches, where it runs low, a plan auto ranks after
    checkpointing (bench/RESULTS.md, "Every plan in whole"). bench/heal/memory.py
    prints the estimate beside the measured peak."""
    n = -(-sh.windows // micro_windows) if "micro" in parts else 1  # micro-batches
    tok = -(-sh.tokens // n)  # tokens of one (micro-)batch
    L = sh.layers
    k = (L if layers is None else max(0, min(int(layers), L))) if "checkpoint" in parts else 0
    full = layer_bytes(tok, sh.hidden, sh.inter)  # one layer's saved activations
    kept = tok * 4 * sh.hidden  # a checkpointed layer's saved input
    rows = 8 * tok * sh.hidden  # the normed rows and their gradient
    head = sh.head_entry * min(sh.chunk, tok) * sh.vocab + 2 * sh.vocab * sh.hidden + rows  # chunks + bf16 head
    grads = 4 * sh.trained
    moments = sh.trained * (2 if "adam8" in parts else 8)
    forward = (grads if n > 1 else 0) + (L - k) * full + k * kept + head
    backward = grads + k * kept + (full if k else 0) + rows
    return moments + max(forward, backward)


@dataclass(frozen=True)
class MemoryPlan:
    """The savings a step runs with: `parts` (MEMORY_PARTS order) and, with
    "checkpoint", `layers` of the `of` trained layers recomputed, the lowest."""

    parts: tuple[str, ...] = ()
    layers: int = 0
    of: int = 0

    def __contains__(self, part: str) -> bool:
        return part in self.parts

    def __str__(self) -> str:
        names = [f"checkpoint:{self.layers}/{self.of}" if p == "checkpoint" and self.layers < self.of else p
                 for p in self.parts]
        return "+".join(names) or "plain"

    def cost(self) -> float:
        """The expected step time as a multiple of the plain step's (COST)."""
        t = 1.0
        for p in self.parts:
            t *= 1.0 + COST[p] * (self.layers / max(self.of, 1) if p == "checkpoint" else 1.0)
        return t


def free_bytes(device: torch.device) -> int:
    """Device memory the step may still use: what the driver calls free plus what the
    caching allocator holds without using."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def have_adam8() -> bool:
    """Whether torchao's AdamW8bit loads here."""
    try:
        adam8_class()
    except CortiqError:
        return False
    return True


def _fewest_layers(sh: StepShape, parts: tuple[str, ...], micro_windows: int, allow: float) -> int | None:
    """The fewest checkpointed layers (1..L) whose estimate under `parts` fits
    `allow`, or None. A search over layers (at most a few dozen estimates, once a run):
    the estimate falls with more layers until the backward's recompute bounds it."""
    return next((k for k in range(1, sh.layers + 1) if step_bytes(sh, parts, micro_windows, k) <= allow), None)


def adam8_asker(adam8_available):
    """`adam8_available` (a bool, or a function asked only when a plan with 8-bit moments
    would be chosen: importing torchao takes seconds) as a function asked at most once."""
    return functools.cache(lambda: bool(adam8_available() if callable(adam8_available) else adam8_available))


def fastest_fit(sh: StepShape, micro_windows: int, allow: float, have, layers: int = 0) -> MemoryPlan | None:
    """Of the plans whose estimate fits `allow` bytes, the one expected to cost the least
    time (COST; with checkpoint, of the fewest layers that fit, or `layers` when set),
    skipping those with 8-bit moments where `have()` (adam8_asker) says torchao does not
    load; None when none fits."""
    L = sh.layers
    fits = []
    for mask in range(1 << len(MEMORY_PARTS)):  # the 8 combinations of savings
        ps = tuple(p for i, p in enumerate(MEMORY_PARTS) if mask >> i & 1)
        k = 0
        if "checkpoint" in ps:
            k = min(layers, L) if layers else _fewest_layers(sh, ps, micro_windows, allow)
            if k is None:
                continue
        if step_bytes(sh, ps, micro_windows, k) <= allow:
            fits.append(MemoryPlan(ps, k, L))
    fits.sort(key=lambda p: (p.cost(), len(p.parts)))
    return next((p for p in fits if "adam8" not in p or have()), None)


def leanest(sh: StepShape, have) -> MemoryPlan:
    """Every saving, 8-bit moments only where torchao loads (`have`, adam8_asker)."""
    return MemoryPlan(tuple(p for p in MEMORY_PARTS if p != "adam8" or have()), sh.layers, sh.layers)


def named_plan(parts: tuple[str, ...], sh: StepShape, layers: int = 0) -> MemoryPlan:
    """The plan the settings name: `parts`, with checkpoint `layers` of the trained ones (0: all)."""
    L = sh.layers
    return MemoryPlan(parts, (min(layers, L) if layers else L) if "checkpoint" in parts else 0, L)


def plan_option(plan: MemoryPlan) -> str:
    """The --memory value (and --checkpoint-layers) that names `plan`."""
    name = "lean" if set(plan.parts) == set(MEMORY_PARTS) else "+".join(plan.parts) or "plain"
    return name + (f" --checkpoint-layers {plan.layers}" if "checkpoint" in plan and plan.layers < plan.of else "")


def size(n: float) -> str:
    """Bytes in words: GiB from one GiB, else MiB or KiB (a tiny model's step is a few KiB)."""
    for unit, b in (("GiB", GiB), ("MiB", float(1 << 20))):
        if abs(n) >= b:
            return f"{n / b:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def allowance(gb: float, device: torch.device, there: int, loaded: bool = True,
              free: int | None = None) -> tuple[float | None, str]:
    """(bytes the step may use beyond the `there` bytes of weights on `device`, the words
    that say where that figure comes from): `gb` GiB less the weights, else on CUDA
    STEP_SHARE of the free memory (`free`: as measured once for several estimates; less
    the weights when they are not `loaded` yet); (None, "") on a CPU without a budget,
    where nothing is planned."""
    if gb > 0:
        return gb * GiB - there, f" (device_mem_gb {gb:g} less {size(there)} already there)"
    if device.type == "cuda":
        free = free_bytes(device) if free is None else free
        return STEP_SHARE * (free - (0 if loaded else there)), f" ({STEP_SHARE:.0%} of the free memory)"
    return None, ""


def choose_memory(memory: str, parts: tuple[str, ...] | None, sh: StepShape, micro_windows: int, allow: float | None,
           adam8_available, layers: int = 0, budget: str = "", say: bool = True) -> MemoryPlan:
    """The plan the step runs with. `parts` is what the settings named (None:
    auto), `layers` the settings' checkpoint_layers (0: all when named, the
    fewest that fit under auto). Auto without an allowance (`allow` None: a
    CPU without a budget) is plain; with one (bytes the step may use beyond
    what is on the device) it is, of the plans whose estimate fits, the one
    expected to cost the least time (`fastest_fit`); when none fits, lean. With
    `say`, one line to stderr says what auto chose and why (`budget` names the
    allowance in it). `adam8_available`: a bool, or a function asked only when a
    plan with 8-bit moments would be chosen (importing torchao takes seconds)."""
    if parts is not None:
        return named_plan(parts, sh, layers)
    if allow is None:
        return MemoryPlan((), 0, sh.layers)
    have = adam8_asker(adam8_available)
    plan = fastest_fit(sh, micro_windows, allow, have, layers)
    if plan is not None:
        if say:
            # a cheaper plan with 8-bit moments fitted, but torchao does not load here
            skipped = fastest_fit(sh, micro_windows, allow, lambda: True, layers) != plan
            _say(plan, sh, micro_windows, allow, budget, True,
                 "; 8-bit Adam moments would cost less time but torchao does not load here "
                 "(pip install 'cortiq[lean]')" if skipped else "")
        return plan
    plan = leanest(sh, have)
    if say:
        _say(plan, sh, micro_windows, allow, budget, False,
             "" if have() else " (without 8-bit Adam moments: torchao does not load here: pip install 'cortiq[lean]')")
    return plan


def _say(plan: MemoryPlan, sh: StepShape, micro_windows: int, allow: float, budget: str, fits: bool, note: str) -> None:
    """One line: what auto chose, its estimate against the allowance, and what it is expected to cost."""
    need = size(step_bytes(sh, plan.parts, micro_windows, plan.layers))
    plain = size(step_bytes(sh, (), micro_windows))
    what = str(plan).replace(f"checkpoint:{plan.layers}/{plan.of}",
                             f"checkpoint of the lowest {plan.layers} of {plan.of} trained layers")
    room = f"the {size(allow)} the step may use{budget}"
    if not plan.parts:
        why = f"its estimate, {plain}, fits {room}"
    elif fits:
        why = f"plain's estimate, {plain}, does not fit {room}; this plan's, {need}, does"
    else:
        why = f"no plan's estimate fits {room}: this, the leanest, needs {need}"
    cost = f"; expected {plan.cost():.2f}x the plain step's time" if plan.parts else ""
    print(f"cortiq: heal memory auto: {what}: {why}{cost}{note}", file=sys.stderr)


def adam8_class():
    """torchao's AdamW8bit, or one line saying how to get it."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise CortiqError(f"heal: memory adam8 needs torchao (pip install 'cortiq[lean]'): {e}") from None
    except Exception as e:  # noqa: BLE001 (a torchao built for another torch fails in many ways)
        raise CortiqError(f"heal: memory adam8: torchao is installed but does not load with torch "
                          f"{torch.__version__} ({type(e).__name__}: {str(e)[:160]})") from None
    return AdamW8bit


def make_optimizer(groups: list[dict], lr: float, device: torch.device, adam8: bool) -> torch.optim.Optimizer:
    """Adam over `groups`: torch's (fused on CUDA), or with 8-bit moments
    (AdamW8bit, weight decay 0: the same update rule). Both keep `group["layer"]`."""
    if adam8:
        return adam8_class()(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return adam(groups, lr, device)


def optimizer_kind(opt: torch.optim.Optimizer) -> str:
    """What a checkpoint's moments are ("adam" f32, "adam8"): a resume restores them only into the same kind."""
    return "adam" if type(opt) is torch.optim.Adam else "adam8"


def set_lr(group: dict, lr: float) -> None:
    """AdamW8bit keeps the rate as a tensor (its compiled update would recompile on
    every new float); torch's Adam keeps a float."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def optim_state(opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict in plain tensors: an 8-bit moment becomes
    {codes, scale, qmap, signed}, so a checkpoint loads (weights only) without
    torchao and without trusting its classes."""
    sd = opt.state_dict()
    if optimizer_kind(opt) == "adam":
        return sd

    def unpacked(v):
        if not isinstance(v, torch.Tensor) or type(v) is torch.Tensor:
            return v
        names, (signed, _dtype) = v.__tensor_flatten__()
        return {"q8": {n: getattr(v, n) for n in names}, "signed": bool(signed)}

    return {**sd, "state": {k: {n: unpacked(v) for n, v in st.items()} for k, st in sd["state"].items()}}


def load_optim_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    """The inverse of `optim_state`, into an optimizer of the same kind."""
    if optimizer_kind(opt) == "adam":
        opt.load_state_dict(sd)
        return
    from torchao.optim.subclass_8bit import OptimState8bit

    def back(v):
        if isinstance(v, dict) and "q8" in v:
            q = v["q8"]
            return OptimState8bit(q["codes"], q["scale"], q["qmap"], v["signed"])
        return v

    opt.load_state_dict({**sd, "state": {k: {n: back(v) for n, v in st.items()} for k, st in sd["state"].items()}})
