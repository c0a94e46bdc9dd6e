"""Settings of the compress stages: DTG-MA masks, the fold, Gram capture, GPTQ.

Defaults come from the original GPU tool's mask settings where it names them (keep 0.75,
growth ×1.5, gate init 2.0, τ 0.5) and are sized so the whole pipeline runs
on SmolLM2-135M on a CPU in minutes (window 256, batch 4, ≤ 200 steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..errors import CortiqError
from ..settings_meta import BATCH, WINDOW, check, derived_error, setting

LOSS_ON = ("answer", "all")
SCOPES = ("auto", "per_layer", "global")
GPTQ_CODECS = ("q4", "q4_64", "q8")
#: compute dtypes of the compress forward passes (f16 would need a loss scale for the gates' gradients)
COMPUTE = ("auto", "f32", "bf16")


def _group_device():
    """A compress group's device: how, not what; within CompressSettings its device sets it."""
    return setting("auto", "where the stage computes (auto: CUDA when present)", how=True, set_by="device")


def _group_compute():
    """A compress group's autocast dtype: how, not what; within CompressSettings its compute_dtype sets it."""
    return setting("auto", "dtype of the forward passes (auto: bf16 on CUDA)", choices=COMPUTE, how=True,
                   set_by="compute_dtype")


@dataclass
class MaskSettings:
    """S2, DTG-MA: a gate σ(m) on every MLP neuron trained under a rising L1 pull."""

    # ── target ──
    #: share of MLP neurons the plan keeps (the mask aims to prune the rest); within
    #: CompressSettings its keep_frac sets it, so masks and fold cannot disagree
    keep_frac: float = setting(0.75, "share of MLP neurons the masks aim to keep", gt=0, hi=1, set_by="keep_frac")
    # ── optimiser (Adam on the gate logits only; the weights are frozen) ──
    lr: float = setting(0.05, "Adam learning rate of the gate logits", gt=0)
    #: initial L1 pressure; the pull per neuron is l1/n_all·σ(m)
    l1_init: float = setting(1.0, "initial L1 pressure", lo=0)
    l1_step: float = setting(1.0, "L1 pressure added per evaluation below the target", lo=0)
    #: pressure growth per evaluation below the target (l1 ← l1·grow + step);
    #: a linear rise (grow 1) stalls at ~15 % pruned, ×1.5 reaches 25 %
    l1_grow: float = setting(1.5, "L1 pressure growth per evaluation below the target", gt=0)
    #: initial logit of every gate (σ(2) = 0.88)
    mask_init: float = setting(2.0, "initial logit of every gate")
    #: hard-mask threshold on σ(m) (σ never reaches 0 or 1)
    tau: float = setting(0.5, "hard-mask threshold on the gate σ(m)", gt=0, lt=1)
    # ── schedule ──
    eval_every: int = setting(10, "steps between hard-mask evaluations", lo=1)
    max_steps: int = setting(200, "most mask training steps", lo=1)
    settle: int = setting(2, "evaluations past the first at the target before stopping", lo=0)
    # ── data ──
    window: int = setting(256, "tokens per window", **WINDOW)
    batch: int = setting(4, "windows per step", **BATCH)
    loss_on: str = setting("answer", "tokens the LM loss scores (answer: each record's scored span)", choices=LOSS_ON)
    #: what the gates are trained (and their checkpoints chosen) against: "data", the LM loss of the
    #: data's next tokens; "teacher", the KL of the gated model's next-token distribution to the
    #: ungated source's, so a neuron counts by every prediction it changes, the confident ones most
    #: (bench/QUALITY.md, "Facts kept: the methods"); the masks' held-out figures (mask_nll_open,
    #: mask_nll_hard) are then that KL. "teacher" by default: at uniform widths it kept more facts
    #: than the data's loss (bench/QUALITY.md, "Facts kept: uniform widths with the knowledge methods")
    objective: str = setting("teacher", "mask loss: teacher (KL to the source's own next-token distribution) or "
                                        "data (LM loss of the data's next tokens)", choices=("data", "teacher"),
                             added=True, was="data")
    val_windows: int = setting(32, "most val windows scored per evaluation (0: all)", lo=0)
    seed: int = setting(0, "order of the train windows")
    #: the device memory the mask step may allocate, the model's weights included: where the plain
    #: step's estimate does not fit, the lowest layers are recomputed in the backward and the batch
    #: runs in micro-batches (the same gates: cortiq.compress.memory). How, not what
    device_mem_gb: float = setting(0.0, "device memory the mask step may allocate, GiB: past it, layers are "
                                        "recomputed in the backward and the batch runs in micro-batches (0: 85% "
                                        "of the free memory on CUDA; on a CPU, no limit)", lo=0, how=True)
    device: str = _group_device()
    compute_dtype: str = _group_compute()

    def __post_init__(self):
        check(self, "mask settings")


@dataclass
class FoldSettings:
    """Keep the top neurons (by mask logit, else by activation score) and slice the MLPs."""

    #: within CompressSettings its keep_frac sets it (one share for the masks and the fold)
    keep_frac: float = setting(0.75, "share of MLP neurons the fold keeps", gt=0, hi=1, set_by="keep_frac")
    #: "per_layer": every layer keeps keep_frac of its neurons; "global": one
    #: ranking over all layers, each layer keeping at least `floor` of its own; "auto": global
    #: where the masks' gates rank the neurons, per_layer where the activation score does.
    #: per_layer by default: one MLP width is what a Llama or Qwen config of transformers and vLLM
    #: holds, so only a uniform model loads smaller there (docs/export.md, "Per-layer MLP widths");
    #: global widths (auto, with the gates) kept a few more facts and a few hundredths of a nat on
    #: some texts (bench/QUALITY.md, "Facts kept: uniform widths with the knowledge methods"), and
    #: CMF and GGUF carry them. With the activation score global was far worse: each layer's
    #: activations and down-projection norms have their own scale, so one ranking of them prunes
    #: some layers bare (bench/QUALITY.md, "Activation score and global scope with the default
    #: retain source")
    scope: str = setting("per_layer", "rank neurons per layer (one width: smaller in every runtime) or over all "
                                      "layers (auto: global by the masks' gates, per layer by the activation "
                                      "score; widths that differ, smaller only in CMF and GGUF)", choices=SCOPES)
    #: at most keep_frac: a fold asked to keep less than the floor keeps that share in every
    #: layer at least (the floor then leaves nothing to rank, as per_layer)
    floor: float = setting(0.25, "global scope: the least share of its neurons each layer keeps (at most "
                                 "keep_frac)", lo=0, hi=1)
    repair: bool = setting(False, "refit down_proj by least squares from the Grams of the MLP activations")
    #: ridge of the repair: λ = damp·mean(diag G[S, S])
    damp: float = setting(0.01, "ridge of the repair, times the mean diagonal of the Gram", lo=0)
    #: each layer keeps a multiple of this many neurons (the nearest to what the scope gives it, at
    #: least one multiple, at most the width): 64 or 128 give widths a GPU's matrix kernels tile
    #: without a ragged last block and that GPTQ's blocks follow; 1 keeps the scope's counts as they
    #: are; 0 is 64 where every layer is at least 1024 wide, else 1 (cortiq.compress.folding.AUTO_MULTIPLE)
    multiple_of: int = setting(0, "each layer keeps a multiple of this many neurons (0: 64 where every layer is "
                                  "at least 1024 wide, else 1)", lo=0, hi=1 << 16, added=True)
    device: str = _group_device()

    def __post_init__(self):
        check(self, "fold settings")


@dataclass
class GramSettings:
    """Illumination: Grams of the MLP activations (down_proj inputs) over train windows."""

    window: int = setting(256, "tokens per window", **WINDOW)
    batch: int = setting(4, "windows per forward", **BATCH)
    max_windows: int = setting(64, "most train windows the Grams see (0: all)", lo=0)
    #: memory room for the accumulators in MB (0: a quarter of the RAM);
    #: CORTIQ_GRAM_ROOM_MB caps it (forces several passes)
    room_mb: int = setting(0, "memory for the Gram accumulators in MB (0: a quarter of the RAM)", lo=0)
    device: str = _group_device()
    compute_dtype: str = _group_compute()

    def __post_init__(self):
        check(self, "gram settings")


@dataclass
class GptqSettings:
    """GPTQ (Frantar et al.) into a cortiq block codec, from the captured Grams."""

    codec: str = setting("q4", "codec GPTQ quantizes into", choices=GPTQ_CODECS)
    block: int = setting(128, "columns per lazy-update block", lo=1)
    damp: float = setting(0.01, "Hessian dampening, times the mean of its diagonal", gt=0)
    #: quantize columns by decreasing diag(H) (with static groups)
    act_order: bool = setting(False, "quantize columns by decreasing Hessian diagonal")
    #: each group's q4/q8 grid searched among shrunk ranges, each refitted to its codes by least squares
    #: weighted by diag H (cortiq.compress.gptq_solver._searched_grid); 1: the group's min/max grid.
    #: Measured on Student-t weights with random input energies: q4's weighted rounding error 0.84x
    #: the min/max grid's with 11, 0.88x with 2 (the refits alone); q8 0.97x
    clip_grid: int = setting(1, "grids: range shrink factors tried per group, from 1 down to 0.5, each refitted "
                                "by weighted least squares (1: the group's min/max grid)", lo=1, hi=101, added=True)
    device: str = _group_device()

    def __post_init__(self):
        check(self, "gptq settings")


@dataclass
class CompressSettings:
    """The whole compress chain: masks → (grams) → fold → (gptq)."""

    masks: MaskSettings = field(default_factory=MaskSettings)
    fold: FoldSettings = field(default_factory=FoldSettings)
    grams: GramSettings = field(default_factory=GramSettings)
    gptq: GptqSettings = field(default_factory=GptqSettings)
    learn_masks: bool = setting(True, "learn DTG-MA masks (--no-learn-masks: rank neurons by activation score "
                                      "from the Grams)")
    use_gptq: bool = setting(False, "quantize the student with GPTQ into gptq.codec")
    # ── resources (how, not what: outside every stage's digest) ──
    device: str = setting("auto", "where masks, Grams, the repair and GPTQ compute: auto (CUDA when present), "
                                  "cpu, cuda, cuda:1, ...", how=True)
    compute_dtype: str = setting("auto", "dtype of the forward passes (auto: bf16 on CUDA, f32 on the CPU; "
                                         "Gram accumulators and the solves stay f64)", choices=COMPUTE, how=True)
    # ── target ──
    #: the one share of MLP neurons kept: the masks aim at it and the fold keeps it (it sets
    #: masks.keep_frac and fold.keep_frac, which are not set on their own)
    keep_frac: float = setting(0.75, "share of MLP neurons kept (the masks aim at it, the fold keeps it)",
                               gt=0, hi=1)

    def __post_init__(self):
        check(self, "compress settings")
        for k, cls in (("masks", MaskSettings), ("fold", FoldSettings), ("grams", GramSettings), ("gptq", GptqSettings)):
            v = getattr(self, k)
            if isinstance(v, dict):
                for f in fields(cls):
                    if "set_by" in f.metadata and f.name in v:
                        raise derived_error(f"compress.{k}.", f)
                setattr(self, k, cls(**v))
        # a field set_by names sets the groups' own (keep_frac, device, compute_dtype): a group built by
        # hand with another value is a contradiction
        for k in ("masks", "fold", "grams", "gptq"):
            v = getattr(self, k)
            for f in fields(v):
                by = f.metadata.get("set_by")
                if by is None or getattr(v, f.name) == getattr(self, by):
                    continue
                if getattr(v, f.name) != f.default:
                    raise CortiqError(f"compress settings: {k}.{f.name} {getattr(v, f.name)} differs from {by} "
                                      f"{getattr(self, by)}: set {by} (it sets every {f.name} under it)")
                v = replace(v, **{f.name: getattr(self, by)})
            setattr(self, k, v)

    @property
    def needs_grams(self) -> bool:
        return self.fold.repair or self.use_gptq or not self.learn_masks
