"""Settings of MTP heal: the original GPU tool's settings with
their defaults, plus what a torch run needs (device, head chunk, seed).

The fields a preset controls (PRESETS: learning rate, warm-up, epochs, window,
batch, input side, self-generated data) default to None and take the values of
the preset `mtp heal` picks: "fresh" for a draft just made by `mtp init`,
"retrain" (values tuned for retraining a working draft of a 0.8B–27B model on
a GPU) for any other. The other defaults are those of the original tool. A CPU demo
passes smaller values as parameters (e.g. window 128, tokens 16384, topk 16,
refresh 20, eval_every 5) rather than changing these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

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


#: The two presets (`preset`): the values of the fields left unset (None).
#: "retrain" keeps the values tuned for retraining a draft that already works
#: (a native MTP head of a 0.8B–27B model). "fresh" takes a block just made by `mtp init` to useful
#: acceptance: such a block starts far from a draft (its eh_proj passes the
#: hidden row through and ignores the next token), so it needs a learning rate
#: fifty times higher, its input side trained, and many more steps; and it is
#: trained on the model's own continuations of the data's prompts, what it
#: drafts against in real decoding. Measured on an H200 with SmolLM2-135M on
#: raw book text: the retrain values kept 0.001 drafts a round; lr 1e-3, the
#: input side trained and 4 epochs 0.861 offline, but only 0.30 a round at
#: depth 1 in real decoding (the draft learned the book, the model writes its
#: own text). Windows of 512 keep the generation short; 8 of them a step keep
#: 4096 rows a step, as the retrain values do. 12 epochs: on the H200 with
#: SmolLM2 and 334 generated windows, 6 epochs (666 steps, 32 s) reached 0.90
#: drafts a round and were still climbing; a data set of 393216 tokens takes
#: about 3100 steps (~3 minutes there), inside the 10 minutes a stage may take.
PRESETS = {
    "retrain": {"lr": 2e-5, "warm": 0.1, "epochs": 1.0, "train_input": False, "patience": 6, "eval_every": 25,
                "window": 2048, "batch": 2, "generate": False},
    "fresh": {"lr": 1e-3, "warm": 0.05, "epochs": 12.0, "train_input": True, "patience": 8, "eval_every": 50,
              "window": 512, "batch": 8, "generate": True},
}

#: `preset` values: "auto" picks "fresh" for a draft `mtp init` made and no
#: `mtp heal` trained since (the model's provenance says so), else "retrain"
PRESET_CHOICES = ("auto", "fresh", "retrain")


@dataclass
class MtpSettings:
    # ── preset ──
    #: auto | fresh | retrain: the values of every field left unset (None); auto reads the model's
    #: provenance: a draft fresh from `mtp init` gets "fresh", any other "retrain"
    preset: str = "auto"

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
    #: tokens per window (a generated sequence fills one); preset: retrain 2048, fresh 512
    window: int | None = None
    #: trunk top-k entries kept per row (the KL target)
    topk: int = 64
    #: hold out every window (a measure of text no training reads; needs epochs 0)
    hold_all: bool = False

    # ── self-generated data ──
    #: train on the model's own continuations of prompts cut from the data (each window's first
    #: gen_prompt tokens, continued to a full window), not on the data's text; preset: fresh on
    generate: bool | None = None
    #: prompt tokens cut from the start of each data window (default: a quarter of the window, at most 64)
    gen_prompt: int | None = None
    #: share of the prompts put in the model's chat template as a user turn (the model answers them)
    gen_chat: float = 0.25
    #: 0: greedy continuations (what greedy speculative decoding verifies against); > 0: sampled
    gen_temperature: float = 0.0
    #: rows decoded at once
    gen_batch: int = 256
    #: directory that keeps the generated windows (default: the trunk cache, else <cortiq home>/cache/mtp-gen)
    gen_cache: str | None = None

    # ── training ──
    #: passes over the train windows per chain step; 0 = measure only (and re-encode); preset: retrain 1, fresh 12
    epochs: float | None = None
    #: peak learning rate (Adam; warm-up, then cosine down to a tenth of it); preset: retrain 2e-5, fresh 1e-3
    lr: float | None = None
    #: share of the steps the rate ramps up over; preset: retrain 0.1, fresh 0.05
    warm: float | None = None
    #: windows per step; preset: retrain 2, fresh 8
    batch: int | None = None
    #: held-out KL and hold rates every this many steps (and at the end); preset: retrain 25, fresh 50
    eval_every: int | None = None
    #: evaluations without a new best before stopping (0 = never stop early); preset: retrain 6, fresh 8
    patience: int | None = None
    #: stop training after this many seconds (the best checkpoint so far is kept); 0 = no limit
    time_limit: float = 0.0
    #: share of a target row's mass put on the trunk's own token (1 = what a greedy verify accepts)
    hard: float = 0.0
    #: also train eh_proj, enorm and hnorm (a fresh `mtp init` draft needs it); preset: retrain off, fresh on
    train_input: bool | None = None
    #: gradient-norm clip
    clip: float = 1.0
    #: training order and sampling seed
    seed: int = 0

    # ── outputs ──
    #: directory that keeps the trunk pass per data set (Arrow, keyed on trunk, data, window, k)
    trunk_cache: str | None = None
    #: codec of the trained draft's tensors in the output: "keep" (the file's own) or a codec name
    codec: str = "keep"
    #: the same result with the draft in other codecs: [(codec, path)] (CLI: CODEC:PATH)
    also: list = field(default_factory=list)
    #: directory for the rows a draft built elsewhere reads (the original GPU tool's file set)
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
    #: processes (GPUs) to run on: more than 1 re-runs the command under torchrun, one per GPU
    #: (the trunk pass splits the windows, training splits each batch)
    gpus: int = 1

    def __post_init__(self):
        def bad(msg):
            raise CortiqError(f"mtp settings: {msg}")

        self.also = parse_also(self.also)
        self.taps = parse_taps(self.taps)
        if self.preset not in PRESET_CHOICES:
            bad(f"preset {self.preset!r} is not one of {', '.join(PRESET_CHOICES)}")
        if self.chain < 1:
            bad(f"chain {self.chain} must be at least 1")
        if self.stride < 0:
            bad(f"stride {self.stride} is negative")
        if self.stride and self.stride < self.chain:
            bad(f"stride {self.stride} is shorter than the chain ({self.chain}): chains laid out as rounds would overlap")
        if self.refresh < 0:
            bad(f"refresh {self.refresh} is negative")
        if self.window is not None and self.window < self.chain + 2:
            bad(f"window {self.window} is too short for a chain of {self.chain}")
        if self.tokens < 1:
            bad(f"tokens {self.tokens} must be positive")
        if self.topk < 1:
            bad(f"topk {self.topk} must be at least 1")
        if self.epochs is not None and self.epochs < 0:
            bad(f"epochs {self.epochs} is negative")
        if self.hold_all and (self.epochs is None or self.epochs > 0):
            bad("hold_all holds out every window: there is nothing to train on (use epochs 0)")
        if self.lr is not None and not self.lr > 0:
            bad(f"lr {self.lr} must be positive")
        if self.warm is not None and not 0.0 <= self.warm < 1.0:
            bad(f"warm {self.warm} is not in [0, 1)")
        if self.batch is not None and self.batch < 1:
            bad(f"batch {self.batch} must be at least 1")
        if self.eval_every is not None and self.eval_every < 1:
            bad(f"eval_every {self.eval_every} must be at least 1")
        if self.patience is not None and self.patience < 0:
            bad(f"patience {self.patience} is negative")
        if self.time_limit < 0:
            bad(f"time_limit {self.time_limit} is negative")
        if not 0.0 <= self.hard <= 1.0:
            bad(f"hard {self.hard} is not between 0 and 1")
        if self.gen_prompt is not None and self.gen_prompt < 1:
            bad(f"gen_prompt {self.gen_prompt} must be at least 1")
        if self.generate and self.window is not None and self.gen_prompt is not None and self.gen_prompt >= self.window:
            bad(f"gen_prompt {self.gen_prompt} leaves nothing to generate in a window of {self.window}")
        if not 0.0 <= self.gen_chat <= 1.0:
            bad(f"gen_chat {self.gen_chat} is not between 0 and 1")
        if self.gen_temperature < 0:
            bad(f"gen_temperature {self.gen_temperature} is negative")
        if self.gpus < 1:
            bad(f"gpus {self.gpus} must be at least 1")
        if self.head_chunk < 1 or self.trunk_batch < 1 or self.gen_batch < 1:
            bad("head_chunk, trunk_batch and gen_batch must be at least 1")
        from ..codecs import get as get_codec

        for c in [self.codec] + [c for c, _ in self.also]:
            if c != "keep":
                try:
                    get_codec(c)
                except Exception as e:
                    bad(f"codec {c!r}: {e}")

    def unset(self) -> list[str]:
        """The preset-controlled fields left unset (None)."""
        return [k for k in PRESETS["fresh"] if getattr(self, k) is None]

    def resolved(self, preset: str) -> "MtpSettings":
        """A copy with `preset` ("fresh" or "retrain") recorded and its values in every unset field."""
        if preset not in PRESETS:
            raise CortiqError(f"mtp settings: no preset {preset!r} (fresh, retrain)")
        vals = {k: v for k, v in PRESETS[preset].items() if getattr(self, k) is None}
        if self.gen_prompt is None:
            vals["gen_prompt"] = min(64, max(1, vals.get("window", self.window) // 4))
        return replace(self, preset=preset, **vals)

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self) -> dict:
        """What the result depends on (the outputs' paths and resources left out)."""
        d = self.to_dict()
        for k in ("trunk_cache", "gen_cache", "dump", "taps", "also", "device", "head_chunk", "trunk_batch", "gen_batch",
                  "gpus"):
            d.pop(k)
        return d


def field_help() -> dict[str, str]:
    """Each MtpSettings field's `#:` comment (the CLI's option help: the text is written once, above the field)."""
    import inspect
    import re

    out, buf = {}, []
    for line in inspect.getsource(MtpSettings).splitlines():
        t = line.strip()
        if t.startswith("#:"):
            buf.append(t[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", t)
        if m and buf:
            out[m.group(1)] = " ".join(buf)
        buf = []
    return out


def field_type(name: str):
    """The scalar type of a field (a preset-controlled one: its presets' values' type)."""
    from dataclasses import fields

    if name in PRESETS["fresh"]:
        return type(PRESETS["fresh"][name])
    if name == "gen_prompt":
        return int
    default = {fl.name: fl.default for fl in fields(MtpSettings)}[name]
    return str if default is None else type(default)
