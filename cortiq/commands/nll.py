"""`cortiq nll MODEL DATA`: teacher-forced NLL per token and perplexity."""

from __future__ import annotations

from dataclasses import dataclass

from ..devices import COMPUTE
from ..settings_meta import add_arguments as add_arguments_of
from ..settings_meta import check, setting

HELP = "score a model: NLL per token and perplexity on a tdata split or a text file"
DESCRIPTION = (
    "Teacher-forced NLL of the scored tokens. DATA is a tdata directory (`cortiq data`), scored on --split "
    "with --loss-on, or a plain text file, tokenized with the model's tokenizer and cut into --window-token "
    "windows (every token but each window's first is scored)."
)
ORDER = 40


@dataclass
class NllSettings:
    """What is scored, and how."""

    #: the test split is the one no stage trains or selects checkpoints on
    split: str = setting("test", "tdata: the split scored", choices=("train", "val", "test"))
    #: "answer" scores what a heal trains on (a prompt's tokens are given, not predicted)
    loss_on: str = setting("answer", "tdata: the tokens scored (answer: each record's scored span)",
                           choices=("answer", "all"))
    #: a text file is cut into windows; every token but a window's first is scored
    window: int = setting(512, "text: tokens per window", lo=2, why="a window's first token is never scored")
    #: bounds the memory of one forward, not the result
    batch_tokens: int = setting(8192, "tokens per forward", lo=1)
    # ── resources ──
    #: "auto": CUDA when present
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N")
    #: f32 on the CPU scores exactly what the reference computes; bf16 on CUDA is the fast estimate
    dtype: str = setting("auto", "compute dtype (auto: bf16 on CUDA, f32 else)", choices=COMPUTE)
    #: checking costs a pass over the bytes; a damaged file otherwise scores as if it were whole
    verify: bool = setting(True, "check each tensor's sha256 as it is read (--no-verify: faster, a damaged "
                                 "file goes unnoticed)")
    #: a NaN weight makes every score NaN: refused unless asked for, to inspect a damaged model
    allow_nonfinite: bool = setting(False, "load weights that hold NaN or Inf values")

    def __post_init__(self):
        check(self, "nll settings")


def add_arguments(p):
    p.add_argument("model", metavar="MODEL.cmf", help="the model to score")
    p.add_argument("data", metavar="DATA", help="a tdata directory or a text file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_arguments_of(p, NllSettings, title="nll settings")


def run(args) -> int:
    import json
    import math
    import sys
    from pathlib import Path

    from tqdm import tqdm

    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..errors import CortiqError
    from ..model import load_model
    from ..model.nll import score_records, text_windows
    from ..settings_meta import from_args
    from ..tokenizer import from_doc

    s = from_args(NllSettings, args)
    f = open_cmf(args.model)
    data = Path(args.data)
    if data.is_dir():
        from ..data import Tdata

        td = Tdata.open(data)
        td.check_tokenizer(f)
        records = td.records(s.split)
        if not records:
            raise CortiqError(f"{data}: the {s.split} split is empty")
        loss_on, pad = s.loss_on, td.eos_id
    elif data.is_file():
        try:
            text = data.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CortiqError(f"{data}: not UTF-8 text") from None
        tok = from_doc(f.tokenizer, str(args.model))
        records = text_windows(tok.encode(text).ids, s.window)
        if not records:
            raise CortiqError(f"{data}: too short to score (fewer than 2 tokens)")
        loss_on, pad = "all", f.eos_id
    elif data.exists():
        raise CortiqError(f"{data}: not a regular file or a directory (a pipe or device cannot be scored)")
    else:
        raise CortiqError(f"{data}: no such file or directory")
    top = max(int(r.ids.max()) for r in records if len(r.ids))
    if top >= f.arch.vocab_size:
        raise CortiqError(f"{data}: token id {top} is outside the model's vocabulary ({f.arch.vocab_size})")
    dev = resolve_device(s.device, "nll")
    dt = resolve_compute(s.dtype, dev)
    model = load_model(f, dtype=dt, device=dev, verify=s.verify, allow_nonfinite=s.allow_nonfinite)
    with tqdm(total=len(records), desc="nll", unit=" rec", file=sys.stderr, leave=False, disable=None) as bar:
        total, n = score_records(model, records, loss_on=loss_on, batch_tokens=s.batch_tokens, pad_id=pad, progress=bar.update)
    if n == 0:
        raise CortiqError(f"{data}: no scored tokens")
    nll = total / n
    if not math.isfinite(nll):
        raise CortiqError(f"{args.model}: the NLL is {nll} (the model computes NaN or Inf on {data}): the model is damaged")
    if args.json:
        print(json.dumps({"model": str(args.model), "data": str(data), "nll": nll, "ppl": math.exp(nll), "tokens": n,
                          "records": len(records)}))
    else:
        print(f"nll/token {nll:.4f}  perplexity {math.exp(nll):.3f}  tokens {n}  ({len(records)} records)")
    return 0
