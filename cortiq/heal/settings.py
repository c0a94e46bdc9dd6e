"""Settings of the heal stage (S4): the seed's `Cfg` plus what a resumable
torch run needs. Defaults heal a 25 %-pruned SmolLM2-135M on a CPU in a few
minutes (window 256, batch 4, top-32, lr 1e-4: a pruned 135M model sits far
from its teacher and takes a larger step than the seed's 1e-5 for a 0.8B)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..devices import COMPUTE, resolve_compute  # noqa: F401  (heal's names for them)
from ..devices import resolve_device as _resolve_device
from ..errors import CortiqError


@dataclass
class HealSettings:
    # ── what trains ──
    #: lowest trained layer; layers below are frozen (their output is cached once)
    train_from: int = 0
    #: train only the MLPs of the trained layers
    ffn_only: bool = False
    #: Genesis: the trained window widens epoch by epoch from the last layers
    #: down (12/64, 24/64, 40/64, all), per-layer rate decaying with distance
    genesis: bool = False

    # ── the loss ──
    #: teacher top-k entries kept per row
    topk: int = 32
    #: weight of the data's own next token: 0 = KL to the teacher's top-k only,
    #: 1 = plain cross-entropy (no teacher runs), between: α·onehot + (1−α)·topk.
    #: 0.3 by default: a top-k target renormalised over k pushes every other
    #: token down, and with ce 0 the 25 %-pruned SmolLM2 healed to a WORSE test
    #: NLL (3.200 → 3.228, top-16) while its held-out KL fell 40 %; ce 0.3,
    #: top-32 recovered 68 % of the gap (3.200 → 2.942, source 2.821)
    ce: float = 0.3
    #: which tokens are scored: "answer" (from each record's first scored position) or "all"
    loss_on: str = "answer"

    # ── the run ──
    #: passes over the train windows (fractions allowed)
    epochs: float = 1.0
    #: peak learning rate (Adam)
    lr: float = 1e-4
    #: share of the steps the rate ramps up over (then cosine down to 0.1 of the peak)
    warm: float = 0.1
    #: gradient-norm clip
    clip: float = 1.0
    #: tokens per window
    window: int = 256
    #: windows per step
    batch: int = 4
    #: held-out loss every this many steps (and at the end)
    eval_every: int = 50
    #: a resumable checkpoint every this many steps (0 = none)
    checkpoint_every: int = 50
    seed: int = 0

    # ── resources ──
    #: "auto" (cuda when available), "cpu", "cuda", "cuda:1", ...
    device: str = "auto"
    #: "auto" (bf16 on CUDA, f32 on CPU), "f32", "bf16", "f16" (f16 runs a loss scale)
    compute_dtype: str = "auto"
    #: host memory the prefix cache may plan with, GB (0 = half of this machine's memory)
    mem_budget_gb: float = 0.0
    #: rows per chunk of the fused head + loss
    head_chunk: int = 1024
    #: torch.compile each decoder layer on CUDA (teacher and student; the CPU stays eager)
    compile: bool = True

    def __post_init__(self):
        def bad(msg):
            raise CortiqError(f"heal settings: {msg}")

        if self.train_from < 0:
            bad(f"train_from {self.train_from} is negative")
        if not 0.0 <= self.ce <= 1.0:
            bad(f"ce {self.ce} is not between 0 and 1")
        if self.topk < 1:
            bad(f"topk {self.topk} must be at least 1")
        if self.loss_on not in ("answer", "all"):
            bad(f"loss_on {self.loss_on!r} is neither 'answer' nor 'all'")
        if not self.epochs > 0:
            bad(f"epochs {self.epochs} must be positive")
        if not self.lr > 0:
            bad(f"lr {self.lr} must be positive")
        if not 0.0 <= self.warm < 1.0:
            bad(f"warm {self.warm} is not in [0, 1)")
        if not self.clip > 0:
            bad(f"clip {self.clip} must be positive")
        for name in ("window", "batch", "eval_every", "head_chunk"):
            if getattr(self, name) < 1:
                bad(f"{name} {getattr(self, name)} must be at least 1")
        if self.checkpoint_every < 0:
            bad(f"checkpoint_every {self.checkpoint_every} is negative")
        if self.compute_dtype not in COMPUTE:
            bad(f"compute_dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE)}")
        if self.mem_budget_gb < 0:
            bad(f"mem_budget_gb {self.mem_budget_gb} is negative")

    @property
    def slots(self) -> int:
        """Target entries per row: the teacher's top-k, one more when the hard target is mixed in, 1 for pure CE."""
        if self.ce >= 1.0:
            return 1
        return self.topk + 1 if self.ce > 0.0 else self.topk

    def to_dict(self) -> dict:
        return asdict(self)

    def targets_key(self) -> dict:
        """The settings the teacher targets depend on (their digest)."""
        return {"topk": self.topk, "ce": self.ce, "window": self.window, "batch": self.batch, "loss_on": self.loss_on}

    def prefix_key(self) -> dict:
        return {"train_from": self.train_from, "window": self.window, "batch": self.batch, "loss_on": self.loss_on,
                "mem_budget_gb": self.mem_budget_gb}


def resolve_device(name: str):
    return _resolve_device(name, "heal settings")


def mem_budget_bytes(gb: float) -> int:
    if gb > 0:
        return int(gb * (1 << 30))
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30
