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

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from ..errors import CortiqError
from ..settings_meta import BATCH, EPOCHS, TOPK, WINDOW, check, setting


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
#: drafts against in real decoding. On raw book text the retrain values kept next to no
#: drafts, and a higher rate with the input side trained learned the book but little of
#: what real decoding accepts (the model writes its own text: bench/MTP.md, "A draft
#: trained on a book's text"). Windows of 320 (a 64-token prompt and 256 generated
#: tokens) cover the 200 tokens a decode's measure walks (`span`) with the chain's
#: look-ahead, and give a data set 1.6x the prompts windows of 512 gave for the same
#: tokens, without training on a long greedy continuation's repetitive tail; 8 of them a
#: step. 8192 generated windows for 2 epochs (bench/DECODE.md, "A draft trained on more
#: of the model's own text" and "The depth policy costs a step by its turn, and a draft
#: of 8192 windows"): the whole pydoc text makes only a few hundred windows of 320, and
#: a draft trained 6 epochs on their continuations kept few drafts on chat questions and
#: standard-library source it never saw; prompts cut at 12 offsets of each window (chat
#: requests the model wrote) multiply the distinct continuations, and 4096 windows for 3
#: epochs, then 8192 for 2, kept more on both, 8192 serving both faster than plain at 1
#: client. At 4096 windows 6 epochs against 3 raised the held-out estimate little: more
#: distinct windows pay, more passes over the same ones little. A held-out evaluation
#: walks the held-out windows, so it runs every 200 steps, and 10 without a new best stop.
#: `tokens` bounds the generated windows too, so the fresh preset's is those 8192 windows' worth.
PRESETS = {
    "retrain": {"lr": 2e-5, "warm": 0.1, "epochs": 1.0, "train_input": False, "patience": 6, "eval_every": 25,
                "window": 2048, "batch": 2, "generate": False, "gen_windows": 0, "tokens": 393216},
    "fresh": {"lr": 1e-3, "warm": 0.05, "epochs": 2.0, "train_input": True, "patience": 10, "eval_every": 200,
              "window": 320, "batch": 8, "generate": True, "gen_windows": 8192, "tokens": 8192 * 320},
}

#: `preset` values: "auto" picks "fresh" for a draft `mtp init` made and no
#: `mtp heal` trained since (the model's provenance says so), else "retrain"
PRESET_CHOICES = ("auto", "fresh", "retrain")


@dataclass
class MtpSettings:
    """Retraining of the MTP draft on the model's own trunk."""

    #: the stages a field feeds unless it names its own (`feeds`): the trunk pass reads the data's
    #: and the generated windows' fields, the draft's training all of what it is not told how to do
    FEEDS: ClassVar[tuple[str, ...]] = ("mtp",)

    # ── preset ──
    preset: str = setting("auto", "the values of every setting left unset: fresh (a draft just made by mtp init), "
                                  "retrain (a working draft), auto (fresh for a draft mtp init made)",
                          choices=PRESET_CHOICES, feeds=("trunk", "mtp"))

    # ── the chain ──
    #: chain steps trained and measured (the runtime drafts 2–7 deep)
    chain: int = setting(3, "chain steps trained and measured", lo=1)
    refresh: int = setting(150, "training steps between rebuilds of the chain's later inputs", lo=0)
    stride: int = setting(0, "0: every row starts a chain; N: a chain starts every N rows, laid out as a "
                                "decode round sees it", lo=0)
    #: new tokens a decode runs after the prompt: the measure (and checkpoint choice) walks
    #: the rounds greedy speculative decoding runs from each window's prompt end over this
    #: many tokens, where an answer starts, not a long continuation's repetitive tail; 0: to
    #: the window's end
    span: int = setting(200, "new tokens the measure walks the decode rounds over, from each prompt's end "
                             "(0: to the window's end)", lo=0)

    # ── data ──
    #: tokens taken from a data set that names no count, and the bound of the windows generated
    #: from it (tokens // window, at least one: a small budget is a small run, whatever gen_windows
    #: asks); preset: retrain 393216, fresh 2621440 (the fresh preset's 8192 windows of 320)
    tokens: int | None = setting(None, "tokens taken from a data set that names no count (PATH@TOKENS), and "
                                       "generated from it at most", show="the preset's", lo=1, feeds=("trunk", "mtp"))
    #: tokens per window (a generated sequence fills one); preset: retrain 2048, fresh 320
    window: int | None = setting(None, "tokens per window (a generated sequence fills one)", show="the preset's", **WINDOW, feeds=("trunk", "mtp"))
    topk: int = setting(64, "trunk top-k entries kept per row (the KL target)", **TOPK, feeds=("trunk", "mtp"))
    hold_all: bool = setting(False, "hold out every window: measure only (needs epochs 0)")

    # ── self-generated data ──
    #: train on the model's own continuations of prompts cut from the data (each window's first
    #: gen_prompt tokens, continued to a full window), not on the data's text; preset: fresh on
    generate: bool | None = setting(None, "train on the model's own continuations of prompts cut from the data", show="the preset's", feeds=("trunk", "mtp"))
    gen_prompt: int | None = setting(None, "prompt tokens cut from the start of each data window", lo=1,
                                     show="a quarter of the window, at most 64", feeds=("trunk", "mtp"))
    #: with generate off, the model's own continuations of this share of the data windows' prompts
    #: (an even spread, held-out windows included) train beside the data's text: a draft then also
    #: learns what the trunk writes, which is what a real decode verifies, on prompts of its held-out
    #: kind. A quarter: enough to be a fixed part of every epoch, not yet measured against others
    gen_share: float = setting(0.25, "with generate off: the model's own continuations of this share of the "
                                     "windows' prompts train beside the data's text", lo=0, hi=1, feeds=("trunk", "mtp"))
    #: generated windows made from each data set; 0: one per data window. More: each window
    #: gives prompts cut at even offsets of its text (inheriting its held-out flag), so a small
    #: data set still trains the draft on many distinct continuations; preset: retrain 0, fresh 8192
    gen_windows: int | None = setting(None, "generated windows made from each data set (0: one per data window; more: "
                                            "prompts cut at even offsets of each window)", lo=0, show="the preset's",
                                      feeds=("trunk", "mtp"))
    #: share of the prompts replaced by a chat request in the model's chat template (the model
    #: answers it; models without a template get none): half, as chat answers are harder to draft
    #: than data continuations (a draft kept far fewer a round on chat prompts than on data:
    #: bench/DECODE.md, "The final run")
    gen_chat: float = setting(0.5, "share of the prompts replaced by a chat request in the model's chat template",
                              lo=0, hi=1, feeds=("trunk", "mtp"))
    #: share of those chat requests the model writes itself (cortiq.data.selfgen.asked_openings:
    #: the template up to a user turn, a request sampled at temperature 1, then the greedy answer),
    #: each used once; the rest come from the fixed list of a few hundred requests, which repeat.
    #: All: with 4096 fresh windows the draft kept more drafts a round with requests the model wrote
    #: than with the fixed list, on chat questions of another source and on standard-library source
    #: (bench/DECODE.md, "A draft trained on more of the model's own text")
    gen_ask: float = setting(1.0, "share of the chat requests the model writes itself (each used once; the rest "
                                  "from a fixed list)", lo=0, hi=1, feeds=("trunk", "mtp"))
    #: 0: greedy continuations (what greedy speculative decoding verifies against); > 0: sampled
    gen_temperature: float = setting(0.0, "0: greedy continuations; > 0: sampled", lo=0, feeds=("trunk", "mtp"))
    gen_batch: int = setting(256, "rows decoded at once while generating", lo=1, how=True)
    gen_cache: str | None = setting(None, "keep the generated windows here", metavar="DIR",
                                    show="the trunk cache, else <cortiq home>/cache/mtp-gen", how=True)

    # ── training ──
    #: passes over the train windows per chain step; 0 = measure only (and re-encode); preset: retrain 1, fresh 3
    epochs: float | None = setting(None, "passes over the train windows per chain step (0: measure only)", show="the preset's",
                                   lo=0, **EPOCHS)
    #: peak learning rate (Adam; warm-up, then cosine down to a tenth of it); preset: retrain 2e-5, fresh 1e-3
    lr: float | None = setting(None, "peak learning rate (Adam; warm-up, then cosine to a tenth)", show="the preset's", gt=0)
    #: share of the steps the rate ramps up over; preset: retrain 0.1, fresh 0.05
    warm: float | None = setting(None, "share of the steps the rate ramps up over", show="the preset's", lo=0, lt=1)
    #: windows per step; preset: retrain 2, fresh 8
    batch: int | None = setting(None, "windows per step", show="the preset's", **BATCH)
    #: held-out KL and hold rates every this many steps (and at the end); preset: retrain 25, fresh 200
    eval_every: int | None = setting(None, "steps between held-out evaluations (and one at the end)", show="the preset's", lo=1)
    #: evaluations without a new best before stopping (0 = never stop early); preset: retrain 6, fresh 10
    patience: int | None = setting(None, "evaluations without a new best before stopping (0: never early)", show="the preset's",
                                   lo=0)
    time_limit: float = setting(0.0, "stop training after this many seconds, keeping the best (0: no limit)", lo=0)
    #: share of a target row's mass put on the trunk's own token (1 = what a greedy verify accepts)
    hard: float = setting(0.0, "share of a target row's mass put on the trunk's own token", lo=0, hi=1)
    #: also train eh_proj, enorm and hnorm (a fresh `mtp init` draft needs it); preset: retrain off, fresh on
    train_input: bool | None = setting(None, "also train eh_proj, enorm and hnorm", show="the preset's")
    clip: float = setting(1.0, "gradient-norm clip", gt=0)
    seed: int = setting(0, "training order and sampling seed", feeds=("trunk", "mtp"))

    # ── outputs ──
    #: directory that keeps the trunk pass per data set (Arrow, keyed on trunk, data, window, k)
    trunk_cache: str | None = setting(None, "keep the trunk pass per data set here", metavar="DIR", how=True)
    codec: str = setting("keep", "codec of the trained draft's tensors: keep (the file's own) or a codec name")
    #: the same result with the draft in other codecs: [(codec, path)] (CLI: CODEC:PATH)
    also: list = setting(factory=list, help="the result with the draft in another codec (repeatable)",
                         metavar="CODEC:PATH", arg_type=str, repeat=True, text=lambda x: f"{x[0]}:{x[1]}", how=True)
    #: directory for the rows a draft built elsewhere reads (the original GPU tool's file set)
    dump: str | None = setting(None, "write the rows and tensors a draft built elsewhere reads here", metavar="DIR", how=True)
    #: (directory, trunk layers): those layers' output rows for the held-out windows (CLI: DIR:L1,L2)
    taps: tuple | None = setting(None, "write these trunk layers' output rows for the held-out windows",
                                 metavar="DIR:LAYERS", arg_type=str,
                                 text=lambda t: f"{t[0]}:{','.join(map(str, t[1]))}", how=True)

    # ── resources ──
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N", how=True)
    head_chunk: int = setting(1024, "rows per chunk of the fused head + loss and of the top-k passes", lo=1, how=True)
    trunk_batch: int = setting(4, "windows per trunk forward", lo=1, how=True)
    gpus: int = setting(1, "GPUs to run on: more than 1 re-runs this command under torchrun, one process per GPU", lo=1, how=True)

    def __post_init__(self):
        def bad(msg):
            raise CortiqError(f"mtp settings: {msg}")

        self.also = parse_also(self.also)
        self.taps = parse_taps(self.taps)
        check(self, "mtp settings")
        if self.stride and self.stride < self.chain:
            bad(f"stride {self.stride} is shorter than the chain ({self.chain}): chains laid out as rounds would overlap")
        if self.window is not None and self.window < self.chain + 2:
            bad(f"window {self.window} is too short for a chain of {self.chain}")
        if self.hold_all and (self.epochs is None or self.epochs > 0):
            bad("hold_all holds out every window: there is nothing to train on (use epochs 0)")
        if self.generate and self.window is not None and self.gen_prompt is not None and self.gen_prompt >= self.window:
            bad(f"gen_prompt {self.gen_prompt} leaves nothing to generate in a window of {self.window}")
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
