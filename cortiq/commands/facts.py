"""`cortiq facts MODEL [--against SOURCE]`: the fact-recall probe."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings_meta import add_arguments as add_arguments_of
from ..settings_meta import check, setting

HELP = "fact recall: which bundled cloze facts a model knows, and how many of its source's it kept"
DESCRIPTION = (
    "Scores the bundled cloze facts ('The capital of France is' -> 'Paris'): a fact is known when greedy "
    "decoding after its prompt writes the whole answer. With --against SOURCE it reports the facts the "
    "source knows, how many of those MODEL keeps, and the mean change of the answer's log-prob over them; "
    "--lost lists the kept-by-the-source facts MODEL lost. The probe is for evaluation only: no stage trains "
    "or ranks on it. Its 'held' part gives the figures a method is judged by, 'dev' may be looked at while "
    "choosing one."
)
ORDER = 41


@dataclass
class FactsSettings:
    """What is probed, and where."""

    part: str = setting("held", "the probe's part scored (held: the figures methods are judged by; dev: the part "
                                "looked at while choosing them; all)", choices=("held", "dev", "all"))
    facts: str = setting("", "a TSV file of facts (kind, prompt, answer a line) scored instead of the bundled set")
    lost: int = setting(0, "list up to N of the facts the source knows that MODEL lost (with --against)", lo=0,
                        metavar="N")
    batch_tokens: int = setting(8192, "padded tokens per forward", lo=16)
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N")

    def __post_init__(self):
        check(self, "facts settings")


def add_arguments(p):
    p.add_argument("model", metavar="MODEL.cmf", help="the model probed")
    p.add_argument("--against", metavar="SOURCE.cmf", help="the model's source: report the facts it keeps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_arguments_of(p, FactsSettings, title="facts settings")


def run(args) -> int:
    import json
    from collections import Counter

    from ..cmf import open_cmf
    from ..errors import CortiqError
    from ..facts import kept_line, load_facts, probe_models
    from ..facts.probe import first_tokens, lost_facts, read_facts
    from ..settings_meta import from_args
    from ..tokenizer import from_doc

    s = from_args(FactsSettings, args)
    facts = load_facts(s.part) if not s.facts else [f for f in read_facts(s.facts) if s.part in ("all", f.part)]
    if not facts:
        raise CortiqError(f"{s.facts}: no facts in the {s.part} part")
    model = open_cmf(args.model)
    models = {"model": model}
    if args.against:
        src = open_cmf(args.against)
        if src.tokenizer.get("json") != model.tokenizer.get("json"):
            raise CortiqError(f"{args.against}: its tokenizer is not {args.model}'s: not its source")
        models = {"source": src, "model": model}
    r = probe_models(models, source="source" if args.against else None, part=s.part, facts=facts, device=s.device,
              batch_tokens=s.batch_tokens)
    c = r["models"]["model"]
    lost = []
    if args.against:
        sc, mc = r["scores"]["source"], r["scores"]["model"]
        tok = from_doc(model.tokenizer, str(args.model))
        lost = lost_facts(facts, sc, mc, first_tokens(mc, tok), s.lost)
    kinds = Counter(f.kind for f in facts)
    known = Counter(f.kind for f, k in zip(facts, r["scores"]["model"].known) if k)
    if args.json:
        print(json.dumps({"model": str(args.model), "against": args.against, "part": s.part, **c,
                          "by_kind": {k: {"facts": n, "known": known[k]} for k, n in kinds.items()}, "lost": lost}))
        return 0
    print(f"fact probe, {s.part} part: {len(facts)} facts")
    if args.against:
        print(kept_line("source", r["models"]["source"]))
    print(kept_line("model", c))
    print("known by kind: " + ", ".join(f"{k} {known[k]}/{n}" for k, n in sorted(kinds.items())))
    for x in lost:
        print(f"  lost: {x['prompt']} -> {x['answer']} (now begins {x['now']!r})")
    return 0
