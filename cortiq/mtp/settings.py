"""Settings of MTP heal: the seed's `Cfg` (mtp_heal.rs, `Cfg::stage`) with its
defaults, plus what a torch run needs (device, head chunk, seed).

The defaults are the seed's, tuned for a GPU and a 0.8B–27B model. A CPU demo
passes smaller values as parameters (e.g. window 128, tokens 16384, topk 16,
refresh 20, eval_every 5) rather than changing these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import CortiqError


def parse_also(items) -> list[tuple[str, str]]:
    """`CODEC:PATH` strings (or pairs) -> [(codec, path)]."""
    out = []
    for it in items or []:
        if isinstance(it, (list, tuple)):
            codec, path = it
        else:
            codec, sep, path = str(it).partition(":")
            if not sep or not codec or not path:
                raise CortiqError(f"mtp settings: --also {it!r} is not CODEC:PATH")
        out.append((str(codec), str(path)))
    return out


def parse_taps(spec) -> tuple[str, list[int]] | None:
    """`DIR:L1,L2,...` -> (dir, [layers])."""
    if spec is None or isinstance(spec, (list, tuple)):
        return None if spec is None else (str(spec[0]), [int(x) for x in spec[1]])
    d, sep, layers = str(spec).rpartition(":")
    try:
        ls = [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        ls = []
    if not sep or not d or not ls:
        raise CortiqError(f"mtp settings: --taps {spec!r} is not DIR:LAYER[,LAYER...]")
    return d, ls


@dataclass
class MtpSettings:
    # ── the chain ──
    #: chain steps trained and measured (the runtime drafts 2–7 deep)
    chain: int = 3
    #: training steps between rebuilds of the chain's later inputs from the current weights
    refresh: int = 150
    #: 0: every row starts a chain. N: a chain starts every N rows, laid out as a
    #: decode round sees it (the trunk's rows up to its start, its own after); N >= chain
    stride: int = 0

    # ── data ──
    #: tokens taken from a data set that names no count of its own (PATH@TOKENS)
    tokens: int = 393216
    #: tokens per window
    window: int = 2048
    #: trunk top-k entries kept per row (the KL target)
    topk: int = 64
    #: hold out every window (a measure of text no training reads; needs epochs 0)
    hold_all: bool = False

    # ── training ──
    #: passes over the train windows per chain step; 0 = measure only (and re-encode)
    epochs: float = 1.0
    #: peak learning rate (Adam; warm-up over a tenth, cosine down to a tenth of it)
    lr: float = 2e-5
    #: windows per step
    batch: int = 2
    #: held-out KL and hold rates every this many steps (and at the end)
    eval_every: int = 25
    #: evaluations without a new best before stopping (0 = never stop early)
    patience: int = 6
    #: share of a target row's mass put on the trunk's own token (1 = what a greedy verify accepts)
    hard: float = 0.0
    #: also train eh_proj, enorm and hnorm (the seed keeps them; a fresh `mtp init` draft gains from it)
    train_input: bool = False
    #: gradient-norm clip
    clip: float = 1.0
    seed: int = 0

    # ── outputs ──
    #: directory that keeps the trunk pass per data set (Arrow, keyed on trunk, data, window, k)
    trunk_cache: str | None = None
    #: codec of the trained draft's tensors in the output: "keep" (the file's own) or a codec name
    codec: str = "keep"
    #: the same result with the draft in other codecs: [(codec, path)] (CLI: CODEC:PATH)
    also: list = field(default_factory=list)
    #: directory for the rows a draft built elsewhere reads (the seed's file set)
    dump: str | None = None
    #: (directory, trunk layers): those layers' output rows for the held-out windows (CLI: DIR:L1,L2)
    taps: tuple | None = None

    # ── resources ──
    #: "auto" (cuda when available), "cpu", "cuda", ...
    device: str = "auto"
    #: rows per chunk of the fused head + loss, and of the top-k passes
    head_chunk: int = 1024
    #: windows per trunk forward
    trunk_batch: int = 4

    def __post_init__(self):
        def bad(msg):
            raise CortiqError(f"mtp settings: {msg}")

        self.also = parse_also(self.also)
        self.taps = parse_taps(self.taps)
        if self.chain < 1:
            bad(f"chain {self.chain} must be at least 1")
        if self.stride < 0:
            bad(f"stride {self.stride} is negative")
        if self.stride and self.stride < self.chain:
            bad(f"stride {self.stride} is shorter than the chain ({self.chain}): chains laid out as rounds would overlap")
        if self.refresh < 0:
            bad(f"refresh {self.refresh} is negative")
        if self.window < self.chain + 2:
            bad(f"window {self.window} is too short for a chain of {self.chain}")
        if self.tokens < 1:
            bad(f"tokens {self.tokens} must be positive")
        if self.topk < 1:
            bad(f"topk {self.topk} must be at least 1")
        if self.epochs < 0:
            bad(f"epochs {self.epochs} is negative")
        if self.hold_all and self.epochs > 0:
            bad("hold_all holds out every window: there is nothing to train on (use epochs 0)")
        if not self.lr > 0:
            bad(f"lr {self.lr} must be positive")
        if self.batch < 1:
            bad(f"batch {self.batch} must be at least 1")
        if self.eval_every < 1:
            bad(f"eval_every {self.eval_every} must be at least 1")
        if self.patience < 0:
            bad(f"patience {self.patience} is negative")
        if not 0.0 <= self.hard <= 1.0:
            bad(f"hard {self.hard} is not between 0 and 1")
        if self.head_chunk < 1 or self.trunk_batch < 1:
            bad("head_chunk and trunk_batch must be at least 1")
        from ..codecs import get as get_codec

        for c in [self.codec] + [c for c, _ in self.also]:
            if c != "keep":
                try:
                    get_codec(c)
                except Exception as e:
                    bad(f"codec {c!r}: {e}")

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self) -> dict:
        """What the result depends on (the outputs' paths and resources left out)."""
        d = self.to_dict()
        for k in ("trunk_cache", "dump", "taps", "also", "device", "head_chunk", "trunk_batch"):
            d.pop(k)
        return d
