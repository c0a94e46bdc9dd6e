"""Settings of the heal stage (S4): the original GPU tool's settings plus what a resumable
torch run needs. The defaults are the recipe bench/quality.py measured on an
H200 (bench/QUALITY.md): SmolLM2-135M with 25 % of its MLP neurons pruned,
healed on Shakespeare plays with 32 teacher draws per position, pure
distillation, lr 6e-4, windows of 512, 16 a step; scored on plays it never saw
(97 % of the gap recovered with 1M tokens) and on the pydoc text."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..devices import COMPUTE, resolve_compute  # noqa: F401  (heal's names for them)
from ..devices import resolve_device as _resolve_device
from ..errors import CortiqError

#: what the student learns per row (see `HealSettings.target`)
TARGETS = ("topk", "topk+rest", "sampled", "full")
#: how training spreads over GPUs (see `HealSettings.shard`)
SHARDS = ("auto", "ddp", "fsdp")


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
    #: the teacher's side of the target per row: "topk" (its k most likely ids,
    #: renormalised over them: biased, the tail's mass is lost), "topk+rest" (the
    #: k entries as they are plus one bucket for the rest of the vocabulary),
    #: "sampled" (k ids drawn from the teacher's distribution, each weighted by
    #: its count/k: an unbiased estimate of the whole distribution, random-
    #: sampling KD), "full" (the whole distribution, the teacher run online at
    #: every step: the plain reference, for small models).
    #: "sampled" by default: measured on an H200 (SmolLM2-135M, 25 % of the MLP
    #: neurons pruned, 1M heal tokens, ce 0), the share of the pruning gap
    #: recovered on plays the heal never saw was topk −63 % (worse than pruned:
    #: the renormalised target over-sharpens), topk+rest 86 %, sampled 103 %,
    #: full 104 % (the dense reference); sampled stores what topk stores
    target: str = "sampled"
    #: entries stored per row: the top k, or the draws per row for "sampled"
    #: (32: the storage topk had; not swept)
    topk: int = 32
    #: weight of the data's own next token: 0 = KL to the teacher only,
    #: 1 = plain cross-entropy (no teacher runs), between: α·onehot + (1−α)·teacher.
    #: 0 by default: the data's token adapts the student to the heal text
    #: rather than back to its source; on the pydoc text (another source than
    #: the heal's plays) sampled recovered 23 % of the gap with ce 0, 15 % with
    #: ce 0.3 and ce 1 made it worse than pruned (−10 %), at 1M tokens. (On
    #: more plays ce > 0 scores higher: ce 1 reached 266 %, adapting to Shakespeare.)
    ce: float = 0.0
    #: which tokens are scored: "answer" (from each record's first scored position) or "all"
    loss_on: str = "answer"

    # ── the run ──
    #: passes over the train windows (fractions allowed)
    epochs: float = 1.0
    #: peak learning rate (Adam). Swept at 1M tokens, sampled, ce 0, 16 windows
    #: of 512 a step: 2e-4 recovered 85 % on unseen plays / 33 % on pydoc,
    #: 6e-4 97 % / 36 %, 1.5e-3 103 % / 23 %; 6e-4 gives up 5 points on the
    #: plays for 13 on the other text
    lr: float = 6e-4
    #: share of the steps the rate ramps up over (then cosine down to 0.1 of the peak)
    warm: float = 0.1
    #: gradient-norm clip
    clip: float = 1.0
    #: tokens per window (512, 16 a step: the measured recipe; on a CPU with
    #: little memory lower both, and the rate with them)
    window: int = 512
    #: windows per step
    batch: int = 16
    #: held-out loss every this many steps (and at the end)
    eval_every: int = 50
    #: a resumable checkpoint every this many steps (0 = none)
    checkpoint_every: int = 50
    #: data order seed; also seeds the "sampled" target's draws
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
    #: processes (GPUs) the heal runs on: more than 1 re-runs it under torchrun, one per GPU;
    #: passes split the windows, training splits each batch (the same steps as one GPU)
    gpus: int = 1
    #: how training spreads over more than one GPU: "ddp" (each holds the trained layers whole),
    #: "fsdp" (weights, gradients and Adam state split across GPUs: a tail too big for one),
    #: "auto" (ddp when the tail with its Adam state takes at most half of one GPU)
    shard: str = "auto"

    def __post_init__(self):
        def bad(msg):
            raise CortiqError(f"heal settings: {msg}")

        if self.train_from < 0:
            bad(f"train_from {self.train_from} is negative")
        if not 0.0 <= self.ce <= 1.0:
            bad(f"ce {self.ce} is not between 0 and 1")
        if self.target not in TARGETS:
            bad(f"target {self.target!r} is not one of {', '.join(TARGETS)}")
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
        if self.gpus < 1:
            bad(f"gpus {self.gpus} must be at least 1")
        if self.shard not in SHARDS:
            bad(f"shard {self.shard!r} is not one of {', '.join(SHARDS)}")

    @property
    def teacher_kind(self) -> str:
        """The target kind in effect: "ce" when no teacher takes part (ce = 1)."""
        return "ce" if self.ce >= 1.0 else self.target

    @property
    def slots(self) -> int:
        """Stored entries per row: the teacher's k, one more when the hard target
        is mixed in, one more for the rest bucket; 1 (next token and row weight)
        for pure CE and for the online "full" target."""
        kind = self.teacher_kind
        if kind in ("ce", "full"):
            return 1
        return self.topk + (self.ce > 0.0) + (kind == "topk+rest")

    def to_dict(self) -> dict:
        return asdict(self)

    def targets_key(self) -> dict:
        """The settings the teacher targets depend on (their digest)."""
        return {"topk": self.topk, "ce": self.ce, "window": self.window, "batch": self.batch, "loss_on": self.loss_on,
                "target": self.teacher_kind, "seed": self.seed if self.teacher_kind == "sampled" else 0}

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
