"""The mask step's memory: its estimate, and the savings that make it fit the device.

The masks train only the gates, but their gradient runs back through every layer
above each gate, so the step keeps every layer's activations (as a heal's step does)
and, under 16-bit autocast, the 16-bit copy of each weight its backward multiplies
by; the loss keeps a few [tokens, vocab] buffers. Where that does not fit, the
step recomputes the lowest layers in the backward (torch.utils.checkpoint around
each layer: only its input is kept) and, past that, runs the batch in micro-batches
whose gradients add up to the batch's. Both give the plain step's gradients (up to
the order of float sums: tests/compress/test_mask_memory.py).

The estimate is counted from the code (cortiq.compress.masks: `weighted_ce`,
`weighted_kl` and the decoder layers), not fitted to measured peaks as the heal
step's is; its per-layer activations are the heal step's (cortiq.heal.memory.layer_bytes).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..heal import memory as mem

#: bytes per [token, vocab] entry the loss holds at its peak: the 16-bit logits, their f32
#: copy and log-softmax (data); with the source's own distribution beside them, its log-
#: softmax, exp and the difference too (teacher)
ENTRY = {"data": 14, "teacher": 32}


@dataclass(frozen=True)
class MaskPlan:
    """The savings a mask step runs with: the lowest `checkpoint` of the `of` layers
    recomputed in the backward, and `micro` windows per micro-batch (0: the whole batch)."""

    checkpoint: int = 0
    micro: int = 0
    of: int = 0

    @property
    def plain(self) -> bool:
        return not self.checkpoint and not self.micro

    def __str__(self) -> str:
        parts = []
        if self.checkpoint:
            parts.append("checkpoint of every layer" if self.checkpoint >= self.of else
                         f"checkpoint of the lowest {self.checkpoint} of {self.of} layers")
        if self.micro:
            parts.append(f"micro-batches of {self.micro} window{'s' if self.micro > 1 else ''}")
        return ", ".join(parts) or "plain"

    def cost(self) -> float:
        """The expected step time as a multiple of the plain step's (the heal step's COST)."""
        ck = 1.0 + mem.COST["checkpoint"] * self.checkpoint / max(self.of, 1)
        return ck * (1.0 + mem.COST["micro"] if self.micro else 1.0)


@dataclass
class MaskShape:
    """What the estimate of one mask step needs."""

    windows: int
    window: int
    hidden: int
    inter: int  # the widest MLP
    layers: int
    vocab: int
    layer_weights: int  # the largest layer's weights
    cast: int  # bytes per weight of the 16-bit copies autocast makes (0 under f32)
    entry: int  # ENTRY of the objective
    f32: bool = False  # activations in f32 (no autocast)


def shape_of(model, batch: int, window: int, objective: str, compute: torch.dtype) -> MaskShape:
    """The step shape of a CausalLM's mask step: `batch` windows of `window` tokens."""
    V, H = model.head_weight.shape
    layers = list(model.layers)
    half = compute != torch.float32
    return MaskShape(windows=batch, window=window, hidden=int(H),
                     inter=max(int(l.mlp.gate_proj.weight.shape[0]) for l in layers), layers=len(layers), vocab=int(V),
                     layer_weights=max(sum(p.numel() for p in l.parameters()) for l in layers),
                     cast=2 if half else 0, entry=ENTRY[objective], f32=not half)


def step_bytes(sh: MaskShape, plan: MaskPlan) -> int:
    """Estimated peak bytes of one mask step beyond the weights on the device: the larger of
    the end of the forward (every kept layer's activations and weight copies, the
    checkpointed layers' inputs, the loss's buffers) and the backward's recompute of the
    lowest checkpointed layer (the kept inputs and that one layer)."""
    tok = (plan.micro or sh.windows) * sh.window
    L, k = sh.layers, min(plan.checkpoint, sh.layers)
    # the heal step's layer (bf16 autocast) and the gate's product; f32 activations take twice that
    act = (mem.layer_bytes(tok, sh.hidden, sh.inter) + 2 * tok * sh.inter) * (2 if sh.f32 else 1)
    layer = act + sh.cast * sh.layer_weights
    kept = 4 * tok * sh.hidden
    rows = 8 * tok * sh.hidden
    head = sh.entry * tok * sh.vocab + sh.cast * sh.vocab * sh.hidden
    forward = (L - k) * layer + k * kept + head + rows
    backward = k * kept + (layer if k else 0) + rows
    return max(forward, backward)


def _candidates(sh: MaskShape, allow: float) -> list[MaskPlan]:
    """For each micro-batch size (the whole batch, then halves down to one window), the plan
    with the fewest checkpointed layers whose estimate fits `allow`."""
    sizes, m = [0], sh.windows // 2
    while m >= 1:
        sizes.append(m)
        m //= 2
    out = []
    for micro in sizes:
        k = next((k for k in range(sh.layers + 1) if step_bytes(sh, MaskPlan(k, micro, sh.layers)) <= allow), None)
        if k is not None:
            out.append(MaskPlan(k, micro, sh.layers))
    return out


def choose(sh: MaskShape, allow: float | None) -> tuple[MaskPlan, bool]:
    """(the plan, whether its estimate fits): plain without an allowance or where it fits; else
    of the plans that fit, the one expected to cost the least time; else the leanest."""
    if allow is None:
        return MaskPlan(0, 0, sh.layers), True
    fits = sorted(_candidates(sh, allow), key=lambda p: (p.cost(), p.micro == 0))
    if fits:
        return fits[0], True
    return MaskPlan(sh.layers, 1 if sh.windows > 1 else 0, sh.layers), False


def mask_plan(model, batch: int, window: int, objective: str, compute: torch.dtype, device_mem_gb: float,
              say: bool = True) -> MaskPlan:
    """The plan of `model`'s mask step (already on its device), against `device_mem_gb` less
    its weights, else STEP_SHARE of the free memory on CUDA (plain on a CPU without a
    budget); with `say`, one line to stderr when the plan is not plain."""
    dev = next(model.parameters()).device
    there = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else \
        sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    allow, budget = mem.allowance(device_mem_gb, dev, there)
    sh = shape_of(model, batch, window, objective, compute)
    plan, fits = choose(sh, allow)
    if say and not plan.plain:
        room = f"the {mem.size(allow)} the step may use{budget}"
        need = mem.size(step_bytes(sh, plan))
        why = (f"the plain step's estimate, {mem.size(step_bytes(sh, MaskPlan(0, 0, sh.layers)))}, does not fit "
               f"{room}; this plan's, {need}, does" if fits else
               f"no plan's estimate fits {room}: this, the leanest, needs {need}")
        print(f"cortiq: masks memory: {plan}: {why}; expected {plan.cost():.2f}x the plain step's time"
              f"{', eager (no CUDA graphs)' if dev.type == 'cuda' else ''}", file=sys.stderr)
    return plan
