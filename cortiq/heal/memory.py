"""The student step's memory plan: which savings it runs with (activation
checkpointing per trained layer, micro-batches with gradient accumulation,
8-bit Adam moments), the estimate `memory: auto` decides by, and the optimizer
each plan trains with.

Where a plain step's memory goes, measured on an H200 (Qwen3-1.7B geometry, all
28 layers trained, 4 windows of 2048, bf16 autocast, head chunks of 8192 rows):
53.1 GiB = f32 weights (8 GB) + gradients and two f32 Adam moments of the 1.41 B
trained weights (12 B each, 17 GB) + the layers' saved activations (~22 GB) + the
fused head's [chunk, vocab] f32 buffers (~5 GB each). The savings cut the last
three: checkpointing keeps one [tokens, hidden] input per layer instead of its
activations, micro-batches divide what remains by their count, and 8-bit moments
(blockwise, torchao's AdamW8bit with weight decay 0, i.e. Adam) are 2 B per
trained weight instead of 8.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import CortiqError
from .settings import MEMORY_PARTS

#: what `memory: lean` runs with
LEAN = MEMORY_PARTS
#: the share of the free device memory the plain step's estimate may take before auto goes lean
#: (the estimate leaves out the allocator's fragmentation and cuBLAS/compile workspaces)
FIT_SHARE = 0.85


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


def shape_of(tail, batch: int, window: int, chunk: int) -> StepShape:
    """The step shape of a StudentTail at `batch` windows of `window` tokens."""
    V, H = tail.model.head_weight.shape
    inter = 2 * H
    for ps in tail.params.values():
        for n, p in ps:
            if n.endswith("mlp.down_proj.weight"):
                inter = max(inter, int(p.shape[1]))
    return StepShape(trained=sum(p.numel() for _, p in tail.named()), tokens=batch * window,
                     windows=batch, hidden=int(H), inter=inter, layers=len(tail.params), vocab=int(V), chunk=chunk)


def step_bytes(sh: StepShape, parts: tuple[str, ...], micro_windows: int) -> int:
    """Estimated peak bytes of one step beyond the weights already on the device, under `parts`.

    Per token and trained layer a transformer layer under bf16 autocast saves
    about 24·hidden + 8·inter bytes for its backward (f32 residual inputs of the
    two norms, bf16 projections, attention output, SwiGLU's gate, up and
    product); the fused head holds at most ~12 B per [chunk, vocab] entry (bf16
    logits and their gradient, and f32 temporaries where its passes run eager)
    and 8 B per [tokens, hidden] row (the normed rows and their gradient).
    bench/memory.py prints this estimate beside the measured peak."""
    n = -(-sh.windows // micro_windows) if "micro" in parts else 1  # micro-batches
    tok = -(-sh.tokens // n)  # tokens of one (micro-)batch
    per_layer = 24 * sh.hidden + 8 * sh.inter
    if "checkpoint" in parts:
        # each layer's input is kept; one layer's activations live again during its recompute
        act = sh.layers * tok * 4 * sh.hidden + tok * per_layer
    else:
        act = sh.layers * tok * per_layer
    head = 12 * min(sh.chunk, tok) * sh.vocab + 8 * tok * sh.hidden
    state = sh.trained * (4 + (2 if "adam8" in parts else 8))
    return state + act + head


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


def choose(memory: str, parts: tuple[str, ...] | None, sh: StepShape, micro_windows: int, free: int | None,
           adam8_available) -> tuple[str, ...]:
    """The savings the step runs with. `parts` is what the settings named (None:
    auto); auto on a CPU (`free` None) is plain, on a device plain when the plain
    estimate takes at most FIT_SHARE of `free`, else lean (without 8-bit moments
    when torchao is absent: one line says so). `adam8_available`: a bool, or a
    function asked only when lean is chosen (importing torchao takes seconds)."""
    if parts is not None:
        return parts
    if free is None or step_bytes(sh, (), micro_windows) <= FIT_SHARE * free:
        return ()
    avail = adam8_available() if callable(adam8_available) else adam8_available
    lean = tuple(p for p in LEAN if p != "adam8" or avail)
    if not avail:
        print("cortiq: heal memory auto: the plain step would not fit, lean without 8-bit Adam moments "
              "(torchao does not load here: pip install 'cortiq[lean]')", file=sys.stderr)
    return lean


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
    # fused: one kernel for every parameter's update on CUDA (same arithmetic)
    return torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")


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

    def plain(v):
        if not isinstance(v, torch.Tensor) or type(v) is torch.Tensor:
            return v
        names, (signed, _dtype) = v.__tensor_flatten__()
        return {"q8": {n: getattr(v, n) for n in names}, "signed": bool(signed)}

    return {**sd, "state": {k: {n: plain(v) for n, v in st.items()} for k, st in sd["state"].items()}}


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
