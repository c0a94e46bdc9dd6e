"""What a narrower draft head keeps: tokens a round with the draft picking among the first N tokens
of its ranking (cortiq.mtp.vocab), on prompts of other sources than the draft's training text.

    python -m bench.mtp.draft_vocab --model DRAFTED.cmf [--data SPEC] --out DIR   # a drafted model
    python -m bench.mtp.draft_vocab --cpu --tiny --out DIR                          # the code paths

The ranking is the model's own (`cortiq mtp heal` writes it), or with --data the one mtp heal would
write from that data's windows (the held-out tenth left out; not the continuations it may generate). The prompts are the
serving bench's (bench.serve.serve): its chat questions in the model's chat template, and windows of
Python standard-library source; neither is the draft's training text. Each prompt's greedy
continuation of --span tokens is walked by mtp heal's offline measure (cortiq.mtp.measure_text,
the rounds a greedy speculative decode runs: in f32 exactly what the server accepts) at depth
--draft, on the chain and on a tree of --branches first guesses, once for every N of --sizes (0:
the whole head). Columns: tokens a round; the share of the continuations' tokens inside the first N
(a draft can be right only there); the head's rows. DIR/draft_vocab.json.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import CACHE, finish, log, parser, print_table, tiny_cmf, write_json


def prompts(model: Path, n_text: int, T: int) -> dict:
    from bench.serve.serve import QUESTIONS, chat_ids, text_prompts
    from cortiq.cmf import open_cmf
    from cortiq.tokenizer import from_doc

    f = open_cmf(model)
    tok = from_doc(f.tokenizer or {}, str(model))
    return {"chat": chat_ids(model, QUESTIONS), "text": text_prompts(tok, n_text, T)}


def ranked(model: Path, data: str | None, cache: str | None, **settings):
    """The model's stored ranking, or (data) the one mtp heal would store from that data's own
    windows (not the continuations it may generate beside them; `settings`: MtpSettings fields)."""
    from cortiq.cmf import open_cmf
    from cortiq.mtp import vocab as V
    from cortiq.mtp.heal import _chain, _load, draft_ranking, resolve
    from cortiq.mtp.settings import MtpSettings

    f = open_cmf(model)
    if data is None:
        r = V.stored(f)
        if r is None:
            raise SystemExit(f"{model}: no draft_vocab ranking stored; give --data (the draft's training data)")
        return r, f.doc[V.KEY]["counted"]
    s = resolve(f, MtpSettings(epochs=0, generate=False, gen_share=0.0, **settings))
    ch, _ = _chain(_load(f, s), f, data, s, cache)
    e = draft_ranking(ch, f.arch.vocab_size, data)
    return V.parse(e, f.arch.vocab_size, data), e["counted"]


def run(args) -> dict:
    import numpy as np
    import torch

    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.model.generate import decode
    from cortiq.mtp.heal import measure_text

    model = Path(args.model)
    f = open_cmf(model)
    rank, counted = ranked(model, args.data, args.cache,
                           **({"window": 64, "topk": 8} if args.tiny else {"window": args.window} if args.window else {}))
    V = f.arch.vocab_size
    sizes = [int(x) for x in args.sizes.split(",")]
    eos = [int(i) for i in (f.tokenizer or {}).get("eos_ids") or [f.eos_id]]
    dev = "cpu" if args.cpu else "cuda"
    m = load_model(f, dtype=torch.float32, device=dev)
    rows = []
    for kind, ps in prompts(model, args.text_prompts, args.prompt_tokens).items():
        with torch.no_grad():
            cont = decode(m, ps, max_new=args.span + args.draft + 1, eos_ids=eos)
        seqs = [p + r.tokens for p, r in zip(ps, cont)]
        plens = [len(p) for p in ps]
        new = np.concatenate([np.asarray(r.tokens[: args.span], dtype=np.int64) for r in cont])
        for n in sizes:
            keep = None if n == 0 or n >= V else torch.from_numpy(rank[:n].astype(np.int64))
            row = {"kind": kind, "head_rows": V if keep is None else n, "prompts": len(ps),
                   "covered": 1.0 if keep is None else float(np.isin(new, rank[:n]).mean())}
            for name, nb in (("chain", 1), ("tree", args.branches)):
                r = measure_text(m, seqs, plens, args.draft, args.span, pad=eos[0], branches=nb, vocab=keep)
                row[name] = 1 + float(r["walk"]["drafts_per_round"])
            log(f"[draft_vocab] {row}")
            rows.append(row)
    return {"model": str(model), "ranking": counted, "vocab": V, "draft": args.draft, "branches": args.branches,
            "span": args.span, "rows": rows}


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model with a trained draft (model.mtp.*)")
    ap.add_argument("--data", default=None, help="the draft's training data: rank from it as mtp heal would "
                                                 "(default: the ranking the model stores)")
    ap.add_argument("--cache", default=None, help="where the trunk pass of --data is cached")
    ap.add_argument("--window", type=int, default=0, help="--data's windows in tokens (0: mtp heal's preset's)")
    ap.add_argument("--sizes", default="0,32768,16384,8192,4096,2048", help="head rows N to measure (0: all)")
    ap.add_argument("--draft", type=int, default=3, help="drafts a round")
    ap.add_argument("--branches", type=int, default=4, help="first guesses of the tree row")
    ap.add_argument("--span", type=int, default=64, help="new tokens a prompt's walk covers")
    ap.add_argument("--text-prompts", type=int, default=16, help="windows of standard-library source")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens a source window")
    args = ap.parse_args()
    if args.tiny:  # a tiny random model with a draft block, ranked on a little random text
        from bench.mtp.draft_data import _tiny_data

        work = CACHE / "draft-vocab-tiny"
        work.mkdir(parents=True, exist_ok=True)
        args.model = str(tiny_cmf(work / "tiny.cmf", mtp=True, chat=True))
        args.data = args.data or str(_tiny_data(Path(args.model), work))
        args.cache = str(work / "trunk")
        args.sizes, args.span, args.text_prompts, args.prompt_tokens = "0,200,64", 12, 3, 24
    elif args.model is None:
        raise SystemExit("bench.mtp.draft_vocab: give --model (a model with a trained draft) or --tiny")
    res = run(args)
    print(f"\nTokens a round at depth {res['draft']} with the draft picking among the first N of its ranking "
          f"({res['ranking']}); {res['span']} new tokens a prompt, f32")
    print_table(["prompts", "head rows", "covered", "chain", f"tree of {res['branches']}"],
                [[r["kind"], r["head_rows"], f"{r['covered']:.4f}", f"{r['chain']:.3f}", f"{r['tree']:.3f}"]
                 for r in res["rows"]])
    log(f"bench.mtp.draft_vocab: figures in {write_json(args.out, 'draft_vocab.json', res)}")
    return 0


if __name__ == "__main__":
    finish(main())
