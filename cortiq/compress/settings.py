"""Settings of the compress stages: DTG-MA masks, the fold, Gram capture, GPTQ.

Defaults come from the original GPU tool's mask settings where it names them (keep 0.75,
growth ×1.5, gate init 2.0, τ 0.5) and are sized so the whole pipeline runs
on SmolLM2-135M on a CPU in minutes (window 256, batch 4, ≤ 200 steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CortiqError

LOSS_ON = ("answer", "all")
SCOPES = ("per_layer", "global")
GPTQ_CODECS = ("q4", "q4_64", "q8")
#: compute dtypes of the compress forward passes (f16 would need a loss scale for the gates' gradients)
COMPUTE = ("auto", "f32", "bf16")


def _frac(name: str, v: float, lo: float = 0.0, hi: float = 1.0, lo_open: bool = True) -> None:
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise CortiqError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")


@dataclass
class MaskSettings:
    """S2, DTG-MA: a gate σ(m) on every MLP neuron trained under a rising L1 pull."""

    # ── target ──
    #: share of MLP neurons the plan keeps (the mask aims to prune the rest)
    keep_frac: float = 0.75
    # ── optimiser (Adam on the gate logits only; the weights are frozen) ──
    lr: float = 0.05
    #: initial L1 pressure; the pull per neuron is l1/n_all·σ(m)
    l1_init: float = 1.0
    #: pressure added at every evaluation below the target
    l1_step: float = 1.0
    #: pressure growth per evaluation below the target (l1 ← l1·grow + step);
    #: a linear rise (grow 1) stalls at ~15 % pruned, ×1.5 reaches 25 %
    l1_grow: float = 1.5
    #: initial logit of every gate (σ(2) = 0.88)
    mask_init: float = 2.0
    #: hard-mask threshold on σ(m)
    tau: float = 0.5
    # ── schedule ──
    eval_every: int = 10
    max_steps: int = 200
    #: evaluations past the first one at the target before stopping
    settle: int = 2
    # ── data ──
    window: int = 256
    batch: int = 4
    #: which tokens score the LM loss: "answer" (the tdata's scored span) or "all"
    loss_on: str = "answer"
    #: at most this many val windows score each evaluation (0: all)
    val_windows: int = 32
    seed: int = 0

    def __post_init__(self):
        _frac("mask keep_frac", self.keep_frac)
        for k in ("lr", "l1_grow", "window", "batch", "eval_every", "max_steps"):
            if getattr(self, k) <= 0:
                raise CortiqError(f"mask {k} must be positive, got {getattr(self, k)}")
        for k in ("l1_init", "l1_step", "settle", "val_windows"):
            if getattr(self, k) < 0:
                raise CortiqError(f"mask {k} must not be negative, got {getattr(self, k)}")
        _frac("mask tau", self.tau, 0.0, 1.0)
        if self.tau >= 1.0:
            raise CortiqError("mask tau must be below 1 (σ never reaches 1)")
        if self.loss_on not in LOSS_ON:
            raise CortiqError(f"mask loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")


@dataclass
class FoldSettings:
    """Keep the top neurons (by mask logit, else by activation score) and slice the MLPs."""

    keep_frac: float = 0.75
    #: "per_layer": every layer keeps keep_frac of its neurons; "global": one
    #: ranking over all layers, each layer keeping at least `floor` of its own
    scope: str = "per_layer"
    floor: float = 0.25
    #: least-squares repair of down_proj from the Grams of the MLP activations
    repair: bool = False
    #: ridge of the repair: λ = damp·mean(diag G[S, S])
    damp: float = 0.01

    def __post_init__(self):
        _frac("fold keep_frac", self.keep_frac)
        if self.scope not in SCOPES:
            raise CortiqError(f"fold scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        _frac("fold floor", self.floor, 0.0, 1.0, lo_open=False)
        if self.scope == "global" and self.floor > self.keep_frac:
            raise CortiqError(f"fold floor {self.floor} is above keep_frac {self.keep_frac}")
        if self.damp < 0:
            raise CortiqError(f"fold damp must not be negative, got {self.damp}")


@dataclass
class GramSettings:
    """Illumination: Grams of the MLP activations (down_proj inputs) over train windows."""

    window: int = 256
    batch: int = 4
    #: at most this many windows (0: all train windows)
    max_windows: int = 64
    #: memory room for the accumulators in MB (0: a quarter of the RAM);
    #: CORTIQ_GRAM_ROOM_MB caps it (forces several passes)
    room_mb: int = 0

    def __post_init__(self):
        for k in ("window", "batch"):
            if getattr(self, k) <= 0:
                raise CortiqError(f"gram {k} must be positive, got {getattr(self, k)}")
        for k in ("max_windows", "room_mb"):
            if getattr(self, k) < 0:
                raise CortiqError(f"gram {k} must not be negative, got {getattr(self, k)}")


@dataclass
class GptqSettings:
    """GPTQ (Frantar et al.) into a cortiq block codec, from the captured Grams."""

    codec: str = "q4"
    #: columns per lazy-update block
    block: int = 128
    #: Hessian dampening: damp·mean(diag H) on the diagonal
    damp: float = 0.01
    #: quantize columns by decreasing diag(H) (with static groups)
    act_order: bool = False

    def __post_init__(self):
        if self.codec not in GPTQ_CODECS:
            raise CortiqError(f"gptq codec must be one of {', '.join(GPTQ_CODECS)}, got {self.codec!r}")
        if self.block <= 0:
            raise CortiqError(f"gptq block must be positive, got {self.block}")
        if not self.damp > 0:
            raise CortiqError(f"gptq damp must be positive, got {self.damp}")


@dataclass
class CompressSettings:
    """The whole compress chain: masks → (grams) → fold → (gptq)."""

    masks: MaskSettings = field(default_factory=MaskSettings)
    fold: FoldSettings = field(default_factory=FoldSettings)
    grams: GramSettings = field(default_factory=GramSettings)
    gptq: GptqSettings = field(default_factory=GptqSettings)
    #: learn DTG-MA masks (False: rank by activation score from the Grams)
    learn_masks: bool = True
    #: quantize the student with GPTQ into gptq.codec
    use_gptq: bool = False
    # ── resources (how, not what: outside every stage's digest) ──
    #: where masks, Grams, the repair and GPTQ compute: "auto" (CUDA when
    #: present), "cpu", "cuda", "cuda:1", ...
    device: str = "auto"
    #: forward passes under autocast: "auto" (bf16 on CUDA, f32 on the CPU),
    #: "f32", "bf16"; Gram accumulators, the repair's and GPTQ's solves stay f64
    compute_dtype: str = "auto"

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE:
            raise CortiqError(f"compress compute_dtype must be one of {', '.join(COMPUTE)}, got {self.compute_dtype!r}")
        for k, cls in (("masks", MaskSettings), ("fold", FoldSettings), ("grams", GramSettings), ("gptq", GptqSettings)):
            v = getattr(self, k)
            if isinstance(v, dict):
                setattr(self, k, cls(**v))

    @property
    def needs_grams(self) -> bool:
        return self.fold.repair or self.use_gptq or not self.learn_masks
