"""Settings of the heal stage (S4): the original GPU tool's settings plus what a resumable
torch run needs. The defaults are the recipe bench/quality/quality.py measured
(bench/QUALITY.md, "The defaults chosen"): SmolLM2-135M with 25 % of its MLP neurons
pruned, healed on Shakespeare plays with 32 teacher draws per position, pure
distillation, lr 6e-4, windows of 512, 16 a step; scored on plays it never saw
and on the pydoc text."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from ..devices import COMPUTE
from ..errors import CortiqError
from ..settings_meta import BATCH, EPOCHS, TOPK, WINDOW, check, setting
from .kinds import CHOICES, DEFAULT, TargetKind, kind_in_effect

#: the memory savings `HealSettings.memory` may name ("lean" is all of them)
MEMORY_PARTS = ("checkpoint", "micro", "adam8")
#: the codecs a heal can train against (see `HealSettings.qat_codec`; "none": plain f32 training)
QAT_CODECS = ("none", "q4", "q4_64", "q8")
#: how training spreads over GPUs (see `HealSettings.shard`)
SHARDS = ("auto", "ddp", "fsdp")
#: how a heal with retain data mixes its sources (see `HealSettings.mix`)
MIXES = ("fixed", "dynamic")
#: `confident` where it is unset and the target stores the teacher's rows
AUTO_CONFIDENT = 2.0


@dataclass
class HealSettings:
    """Distillation of the student from its source."""

    #: the stages a field feeds unless it names its own (`feeds`): the teacher's targets and the
    #: prefix read a few fields each, the training all of what it is not told how to do
    FEEDS: ClassVar[tuple[str, ...]] = ("train",)

    # ── what trains ──
    #: unset ("auto"): every layer where the step fits the device, else the fewest frozen layers from
    #: which a memory plan fits (cortiq.heal.fitting, decided by the heal chain before its first stage
    #: and keyed by the value decided); every layer on a CPU without `device_mem_gb`, on more than one
    #: GPU (FSDP splits the step there), and in a stage run on its own
    train_from: int | None = setting(None, "lowest trained layer (the ones below are frozen and cached)",
                                     show="auto: every layer where the step fits the device, else the most "
                                          "layers that fit", lo=0, feeds=("prefix", "train"))
    ffn_only: bool = setting(False, "train only the MLPs of the trained layers")
    #: Genesis: the trained window widens epoch by epoch from the last layers
    #: down (12/64, 24/64, 40/64, all), per-layer rate decaying with distance
    genesis: bool = setting(False, "Genesis schedule: the trained layers widen from the top down epoch by epoch")

    # ── the loss ──
    #: the teacher's side of the target per row: "topk" (its k most likely ids,
    #: renormalised over them: biased, the tail's mass is lost), "topk+rest" (the
    #: k entries as they are plus one bucket for the rest of the vocabulary),
    #: "sampled" (k ids drawn from the teacher's distribution, each weighted by
    #: its count/k: an unbiased estimate of the whole distribution, random-
    #: sampling KD), "full" (the whole distribution, the teacher run online at
    #: every step: the plain reference, for small models).
    #: "sampled" by default: on plays the heal never saw (bench/QUALITY.md, "What
    #: the first table says": SmolLM2-135M, 25 % of the MLP neurons pruned, ce 0)
    #: topk left the model worse than pruned (the renormalised target
    #: over-sharpens), topk+rest recovered most of the gap, and sampled all of
    #: it, as full (the dense reference) did; sampled stores what topk stores
    target: str = setting(DEFAULT, "the teacher's side of the target: topk (renormalised top-k), topk+rest (the k "
                                     "entries and a bucket for the rest of the vocabulary), sampled (k draws from the "
                                     "teacher, unbiased), full (the whole distribution, teacher run online; small "
                                     "models)", choices=CHOICES, feeds=("targets", "train"))
    #: entries stored per row: the top k, or the draws per row for "sampled"
    #: (32: the storage topk had; not swept)
    topk: int = setting(32, "teacher entries stored per row (the top k, or the draws per row for sampled)", **TOPK, feeds=("targets", "train"))
    #: weight of the data's own next token: 0 = KL to the teacher only,
    #: 1 = plain cross-entropy (no teacher runs), between: α·onehot + (1−α)·teacher.
    #: 0 by default: the data's token adapts the student to the heal text
    #: rather than back to its source; on the pydoc text (another source than
    #: the heal's plays) sampled recovered 23 % of the gap with ce 0, 15 % with
    #: ce 0.3 and ce 1 made it worse than pruned (−10 %), at 1M tokens. (On
    #: more plays ce > 0 scores higher: ce 1 reached 266 %, adapting to Shakespeare.)
    ce: float = setting(0.0, "weight of the data's own next token (0: KL to the teacher only, 1: plain "
                               "cross-entropy, no teacher)", lo=0, hi=1, feeds=("targets", "train"))
    loss_on: str = setting("answer", "tokens scored: answer (from each record's first scored position) or all",
                           choices=("answer", "all"), feeds=("targets", "prefix", "train"))
    #: a row of the target weighs 1 + confident·p_top, p_top the teacher's top probability there (as
    #: stored: the top entry, or the most drawn id's share of the draws): the predictions the source
    #: is sure of, facts among them, count more than the ones it hedges (bench/QUALITY.md, "Facts
    #: kept: the methods"). Unset: 2 where the target stores the teacher's rows (the default's
    #: measured recipe with teacher masks: "Facts kept: uniform widths with the knowledge methods"),
    #: 0 where it stores none (full, ce 1)
    confident: float | None = setting(None, "extra weight of the teacher's confident rows: a row weighs 1 + "
                                            "confident × the teacher's top probability (0: every scored row alike)",
                                      show=f"auto: {AUTO_CONFIDENT:g} where the teacher's rows are stored (topk, "
                                           "topk+rest, sampled with ce below 1), else 0",
                                      lo=0, hi=100, feeds=("targets",), added=True, was=0.0,
                                      when=lambda s: s.target_kind.teacher_pass)

    #: quantization-aware distillation: the trained matrices run fake-quantized in this codec (its own
    #: dequantize(quantize(W)), straight-through gradient), the best checkpoint is chosen on that model's
    #: held-out loss and the healed model is written in it ("none": f32 training, the student's codecs)
    qat_codec: str = setting("none", "train against this codec's rounding and write the healed model in it "
                                     "(none: f32 training, the student's codecs)", choices=QAT_CODECS, added=True)

    #: the weights the held-out evaluations score, the best checkpoint keeps and the heal writes are a
    #: moving average of the trained ones, w̄ <- w̄ + (1 - average)·(w - w̄) after each update (Polyak
    #: averaging, as an EMA of weights in diffusion and self-supervised training). Built because heals of
    #: one pruned model that differ only in their target keep different facts; measured, it keeps as many
    #: facts as one heal, at its NLL (bench/QUALITY.md, "Facts kept: an anchor, a moving average, a soup
    #: and the size curve"), so it is off by default. 0: off; 0.99 weighs about the last 100 updates
    average: float = setting(0.0, "decay of a moving average of the trained weights, which the held-out evaluations "
                                  "score and the healed model keeps (0: off; 0.99: about the last 100 updates)",
                             lo=0, lt=1, why="a decay of 1 or more never moves the average off the student",
                             added=True)

    # ── the run ──
    epochs: float = setting(0.0, "passes over the train windows, fractions allowed (0: as many as --tokens "
                                 "takes)", lo=0, **EPOCHS)
    #: the heal's budget in train tokens (steps × batch × window) when `epochs` is 0, the
    #: windows repeating as often as it takes: one pass over a novel (24 steps) had not
    #: converged, and a 135M model's heal levels off within 2M tokens (bench/QUALITY.md)
    tokens: int = setting(2_000_000, "heal budget in train tokens when --epochs is 0 (the data repeats as needed)",
                          lo=1, metavar="N")
    #: stop when this many held-out evaluations in a row did not lower the best held-out loss
    #: by `min_improve` of it (0: run the whole budget); the best checkpoint is kept either way
    patience: int = setting(4, "stop after this many held-out evaluations in a row without a better loss "
                               "(0: never stop early)", lo=0)
    min_improve: float = setting(0.002, "relative drop of the best held-out loss that counts as better "
                                        "(the plateau stop)", lo=0, lt=1)
    #: with retain data: "fixed" (every batch holds each source at its share), "dynamic" (the
    #: shares move toward the sources whose held-out KL to the teacher is largest at each
    #: evaluation, an exponentiated update as in Sheared-LLaMA's dynamic batch loading)
    mix: str = setting("fixed", "batch mix of the data's sources with retain data: fixed (their shares) or "
                                "dynamic (toward the largest held-out gap to the teacher)", choices=MIXES)
    #: step size of the dynamic mix: shares scale by exp(mix_lr · gap / mean gap) per evaluation
    mix_lr: float = setting(1.0, "step size of the dynamic mix's exponentiated update", gt=0, hi=10)
    #: peak learning rate (Adam). Swept at 1M tokens, sampled, ce 0, 16 windows
    #: of 512 a step: 2e-4 recovered 85 % on unseen plays / 33 % on pydoc,
    #: 6e-4 97 % / 36 %, 1.5e-3 103 % / 23 %; 6e-4 gives up 5 points on the
    #: plays for 13 on the other text
    lr: float = setting(6e-4, "peak learning rate (Adam)", gt=0)
    warm: float = setting(0.1, "share of the steps the rate ramps up over (then cosine to 0.1 of the peak)", lo=0, lt=1)
    clip: float = setting(1.0, "gradient-norm clip", gt=0)
    #: tokens per window (512, 16 a step: the measured recipe; on a CPU with
    #: little memory lower both, and the rate with them)
    window: int = setting(512, "tokens per window", **WINDOW, feeds=("targets", "prefix", "train"))
    batch: int = setting(16, "windows per step", **BATCH, feeds=("targets", "prefix", "train"))
    eval_every: int = setting(50, "steps between held-out evaluations", lo=1)
    checkpoint_every: int = setting(50, "steps between resumable checkpoints (0: none)", lo=0, how=True)
    seed: int = setting(0, "data order seed (also seeds the sampled target's draws)", feeds=("targets", "train"))

    # ── resources ──
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N", how=True)
    #: "auto" (bf16 on CUDA, f32 on CPU), "f32", "bf16", "f16" (f16 runs a loss scale)
    compute_dtype: str = setting("auto", "compute dtype (auto: bf16 on CUDA, f32 on the CPU)", choices=COMPUTE, how=True)
    mem_budget_gb: float = setting(0.0, "host memory the prefix cache plans with, GB (0: half of this machine's)",
                                   lo=0, feeds=("prefix",))
    head_chunk: int = setting(1024, "rows per chunk of the fused head + loss", lo=1, how=True)
    compile: bool = setting(True, "torch.compile each decoder layer on CUDA (--no-compile: eager)", how=True)
    #: the student step's memory plan: "plain" (every activation kept, f32 Adam
    #: moments), "lean" (all three savings below), "auto" (the plan expected to cost
    #: the least time among those whose estimate fits `device_mem_gb`: plain, else
    #: checkpoint of the fewest layers, else more savings; plain on a CPU without
    #: `device_mem_gb`), or a "+"-joined
    #: choice of "checkpoint" (trained layers' activations recomputed in the
    #: backward: `checkpoint_layers` of them), "micro" (the batch in micro-batches of `micro_batch` windows,
    #: gradients accumulated: the same step), "adam8" (Adam's moments in 8 bits,
    #: blockwise, from torchao: the `lean` extra). How, not what: a resumed run may
    #: change it (the optimizer restarts when the moments' kind changes). Each plan's
    #: peak and speed at Qwen3-1.7B: bench/RESULTS.md, "Every plan in whole"
    memory: str = setting("auto", "the step's memory plan: auto (the fastest plan whose estimate fits "
                          "--device-mem-gb: plain, else checkpoint of the fewest layers, else more savings), "
                          "plain, lean (all of: checkpoint, micro, adam8), or a '+'-joined choice of checkpoint "
                          "(recompute trained layers in the backward: --checkpoint-layers), micro (micro-batches, gradients "
                          "accumulated), adam8 (8-bit Adam moments; pip install 'cortiq[lean]')", how=True)
    micro_batch: int = setting(0, "windows per micro-batch with --memory micro/lean (0: a quarter of --batch)", lo=0, how=True)
    #: with checkpoint in the plan: how many trained layers recompute their activations in the
    #: backward, counted from the lowest trained layer (0: all of them when the memory setting names
    #: checkpoint, the fewest whose estimate fits under auto). Recomputing a layer costs about its
    #: forward, so k of L layers cost k/L of what checkpointing all of them costs (bench/RESULTS.md,
    #: "Every plan in whole")
    checkpoint_layers: int = setting(0, "with checkpoint: how many trained layers, from the lowest, are recomputed "
                                        "in the backward (0: all when --memory names checkpoint, the fewest that "
                                        "fit under auto)", lo=0, how=True)
    #: the device memory the training step may allocate, weights and optimizer state included, that
    #: `memory: auto` plans against: a cap for a GPU shared with other work (0: 85 % of what is free
    #: on the device when training starts, the rest left to the allocator's fragmentation and the
    #: compiler's and cuBLAS's workspaces)
    device_mem_gb: float = setting(0.0, "device memory the training step may allocate, GiB, that --memory auto "
                                        "plans against (0: 85% of the device's free memory)", lo=0, how=True)
    #: the disk the resumable checkpoints may take (cortiq.heal.disk): where two copies do not fit beside
    #: the healed model, one at a time; where one does not, none, said in one line
    disk_gb: float = setting(0.0, "disk the resumable checkpoints may take, GiB (0: the work folder's free space)",
                             lo=0, how=True)
    gpus: int = setting(1, "GPUs to run on: more than 1 re-runs the heal under torchrun, one process per GPU "
                           "(the same steps and results as one GPU)", lo=1, how=True)
    #: how training spreads over more than one GPU: "ddp" (each holds the trained layers whole),
    #: "fsdp" (weights, gradients and Adam state split across GPUs: a tail too big for one),
    #: "auto" (fsdp on GPUs from 1B trained weights, or when the tail with its Adam state takes
    #: more than half of one GPU; else ddp; ddp for Genesis: cortiq.heal.parallel says why)
    shard: str = setting("auto", "how training spreads over GPUs: ddp (each GPU holds the trained layers), fsdp "
                                 "(weights, gradients and Adam state split), auto (fsdp from 1B trained weights "
                                 "or when they do not fit half a GPU, else ddp)",
                         choices=SHARDS, how=True)

    def __post_init__(self):
        check(self, "heal settings")
        if self.memory not in ("auto", "plain", "lean"):
            unknown = [p for p in self.memory.split("+") if p not in MEMORY_PARTS]
            if unknown or not self.memory:
                raise CortiqError(f"heal settings: memory {self.memory!r} is not auto, plain, lean or a '+'-joined "
                                  f"choice of {', '.join(MEMORY_PARTS)}")
        if self.confident and not self.target_kind.teacher_pass:  # set, not left to auto
            raise CortiqError(f"heal settings: confident {self.confident} weighs stored teacher targets, and target "
                              f"{self.target_kind.name!r} stores none: use topk, topk+rest or sampled with ce below 1")
        named = self.memory_parts()
        if self.checkpoint_layers and named is not None and "checkpoint" not in named:
            raise CortiqError(f"heal settings: checkpoint_layers {self.checkpoint_layers} needs a memory plan with "
                              f"checkpoint (auto, lean or one naming checkpoint), not {self.memory!r}")

    @property
    def confident_weight(self) -> float:
        """`confident` as the targets apply it: unset, AUTO_CONFIDENT where the target stores the
        teacher's rows, else 0."""
        if self.confident is not None:
            return self.confident
        return AUTO_CONFIDENT if self.target_kind.teacher_pass else 0.0

    def memory_parts(self) -> tuple[str, ...] | None:
        """The savings named by `memory`, in MEMORY_PARTS order; None for "auto" (decided at the step)."""
        if self.memory == "auto":
            return None
        named = set(MEMORY_PARTS) if self.memory == "lean" else set() if self.memory == "plain" else set(self.memory.split("+"))
        return tuple(p for p in MEMORY_PARTS if p in named)

    def every_layer_when_unset(self) -> "HealSettings":
        """These settings with `train_from` 0 where it is unset: what a stage run on its own
        trains (the heal chain decides it against the device first: cortiq.heal.fitting),
        and what it keys as."""
        return self if self.train_from is not None else replace(self, train_from=0)

    def micro_windows(self) -> int:
        """Windows per micro-batch when micro-batches are on."""
        return min(self.batch, self.micro_batch) if self.micro_batch else max(1, self.batch // 4)

    @property
    def target_kind(self) -> TargetKind:
        """The target kind in effect (cortiq.heal.kinds): "ce", plain cross-entropy with
        no teacher, when ce = 1; else the one `target` names."""
        return kind_in_effect(self.target, self.ce)

    @property
    def slots(self) -> int:
        """Stored entries per row of the targets (TargetKind.slots)."""
        return self.target_kind.slots(self.topk, self.ce)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def export_codec(self) -> str:
        """The codec the healed model is written in: the QAT codec, else "keep" (the student's)."""
        return "keep" if self.qat_codec == "none" else self.qat_codec


def mem_budget_bytes(gb: float) -> int:
    if gb > 0:
        return int(gb * (1 << 30))
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30
