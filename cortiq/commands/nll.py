"""`cortiq nll MODEL DATA`: teacher-forced NLL per token and perplexity."""

from __future__ import annotations

HELP = "score a model: NLL per token and perplexity on a tdata split or a text file"
DESCRIPTION = (
    "Teacher-forced NLL of the scored tokens. DATA is a tdata directory (`cortiq data`), scored on --split "
    "with --loss-on, or a plain text file, tokenized with the model's tokenizer and cut into --window-token "
    "windows (every token but each window's first is scored)."
)
ORDER = 40


def add_arguments(p):
    p.add_argument("model", metavar="MODEL.cmf")
    p.add_argument("data", metavar="DATA", help="a tdata directory or a text file")
    p.add_argument("--split", default="test", choices=["train", "val", "test"], help="tdata split")
    p.add_argument("--loss-on", default="answer", choices=["answer", "all"], help="tdata: which tokens are scored")
    p.add_argument("--window", type=int, default=512, help="text: tokens per window")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "f32", "bf16", "f16"], help="compute dtype (auto: bf16 on CUDA, f32 else)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking each tensor's sha256 as it is read (faster; a damaged file goes unnoticed)")
    p.add_argument("--allow-nonfinite", action="store_true", help="load weights that hold NaN or Inf values")


def _device_dtype(args):
    import torch

    from ..errors import CortiqError

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(dev).type
    except (RuntimeError, ValueError, TypeError):
        raise CortiqError(f"--device {dev!r}: not a device (cpu, cuda, cuda:1, ...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise CortiqError(f"--device {dev}: no CUDA device here (use --device cpu)")
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}.get(args.dtype)
    if dt is None:
        dt = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    return dev, dt


def run(args) -> int:
    import json
    import math
    import sys
    from pathlib import Path

    from tqdm import tqdm

    from ..cmf import open_cmf
    from ..errors import CortiqError
    from ..model import load_model
    from ..model.nll import score_records, text_windows
    from ..tokenizer import from_doc

    f = open_cmf(args.model)
    data = Path(args.data)
    if data.is_dir():
        from ..data import Tdata

        td = Tdata.open(data)
        td.check_tokenizer(f)
        records = td.records(args.split)
        if not records:
            raise CortiqError(f"{data}: the {args.split} split is empty")
        loss_on, pad = args.loss_on, td.eos_id
    elif data.is_file():
        try:
            text = data.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CortiqError(f"{data}: not UTF-8 text") from None
        tok = from_doc(f.tokenizer, str(args.model))
        records = text_windows(tok.encode(text).ids, args.window)
        if not records:
            raise CortiqError(f"{data}: too short to score (fewer than 2 tokens)")
        loss_on, pad = "all", f.eos_id
    elif data.exists():
        raise CortiqError(f"{data}: not a regular file or a directory (a pipe or device cannot be scored)")
    else:
        raise CortiqError(f"{data}: no such file or directory")
    if args.batch_tokens < 1:
        raise CortiqError(f"--batch-tokens {args.batch_tokens}: score at least 1 token per forward")
    top = max(int(r.ids.max()) for r in records if len(r.ids))
    if top >= f.arch.vocab_size:
        raise CortiqError(f"{data}: token id {top} is outside the model's vocabulary ({f.arch.vocab_size})")
    dev, dt = _device_dtype(args)
    model = load_model(f, dtype=dt, device=dev, verify=not args.no_verify, allow_nonfinite=args.allow_nonfinite)
    with tqdm(total=len(records), desc="nll", unit=" rec", file=sys.stderr, leave=False, disable=None) as bar:
        s, n = score_records(model, records, loss_on=loss_on, batch_tokens=args.batch_tokens, pad_id=pad, progress=bar.update)
    if n == 0:
        raise CortiqError(f"{data}: no scored tokens")
    nll = s / n
    if not math.isfinite(nll):
        raise CortiqError(f"{args.model}: the NLL is {nll} (the model computes NaN or Inf on {data}): the model is damaged")
    if args.json:
        print(json.dumps({"model": str(args.model), "data": str(data), "nll": nll, "ppl": math.exp(nll), "tokens": n,
                          "records": len(records)}))
    else:
        print(f"nll/token {nll:.4f}  perplexity {math.exp(nll):.3f}  tokens {n}  ({len(records)} records)")
    return 0
