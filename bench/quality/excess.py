"""Where a model's excess NLL over its source goes on one text: by how sure the source was of
each token, and by the token's shape.

    python -m bench.quality.excess --source SRC.cmf --model PRUNED.cmf [--model HEALED.cmf] --data TDATA --out DIR
    python -m bench.quality.excess --cpu --tiny --out DIR   # a tiny random source and a fold of it: the code paths

The text's records, end to end, are cut into windows of --window tokens (the first --tokens of it);
every token but a window's first is scored by the source and by each model, teacher-forced. The excess (model NLL minus source NLL, nats) is then
summed by
- the source's own NLL of the token, in quartiles over the text: a loss on the tokens the source
  predicts almost surely is lost recall of text the source knows by heart (licence boilerplate,
  idioms), a loss on the last quartile is lost guessing;
- the token's shape: CAPS (two or more capitals), Capitalised, lower case, digits, punctuation and
  the rest, whitespace alone.
Each row gives the tokens' share of the text, their mean excess and their share of the whole excess.
Why: the panel of bench/QUALITY.md keeps one text (licence files) far above the others after every
heal tried, and this says what of it is lost.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import finish, log, parser, print_table, tiny_cmf, write_json

SHAPES = ("CAPS", "Capitalised", "lower", "digits", "punctuation/other", "space")


def shape_of(piece: str) -> str:
    w = piece.strip()
    if not w:
        return "space"
    if re.fullmatch(r"[A-Z]{2,}", w):
        return "CAPS"
    if re.fullmatch(r"[A-Z][a-z]*", w):
        return "Capitalised"
    if re.fullmatch(r"[a-z]+", w):
        return "lower"
    if re.fullmatch(r"[0-9]+", w):
        return "digits"
    return "punctuation/other"


@torch.no_grad()
def token_nll(model_path, windows: torch.Tensor, device: str, batch: int = 2) -> torch.Tensor:
    """NLL of each next token of windows [N, T] under the model -> [N, T-1] (f32 weights; `batch`
    windows a pass: their [batch, T, V] f32 logits are the pass's largest tensor, 200 MB for SmolLM2)."""
    from cortiq.model import load_model

    m = load_model(model_path, dtype=torch.float32, device=device)
    out = []
    for b in range(0, len(windows), batch):
        ids = windows[b : b + batch].to(device)
        h, _ = m.forward_hidden(ids)
        lg = m.logits(h[:, :-1]).float()  # [B, T-1, V]
        out.append(F.cross_entropy(lg.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(len(ids), -1).cpu())
    del m
    return torch.cat(out)


def breakdown(src_nll: torch.Tensor, nll: torch.Tensor, shapes: np.ndarray) -> list[dict]:
    """Rows of the excess by the source's NLL quartile and by token shape (flat tensors of one length)."""
    ex = nll - src_nll
    total = float(ex.sum())
    rows = []
    q = torch.quantile(src_nll, torch.tensor([0.25, 0.5, 0.75])).tolist()
    edges = [float("-inf"), *q, float("inf")]
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        m = (src_nll > lo) & (src_nll <= hi)
        rows.append(_row(f"source NLL quartile {i + 1} ({max(lo, 0):.2f}..{hi:.2f})", m, ex, src_nll, total))
    for s in SHAPES:
        m = torch.from_numpy(shapes == s)
        if m.any():
            rows.append(_row(f"shape {s}", m, ex, src_nll, total))
    return rows


def _row(name, m, ex, src, total) -> dict:
    return {"part": name, "tokens": int(m.sum()), "share_tokens": float(m.float().mean()),
            "source_nll": float(src[m].mean()), "excess": float(ex[m].mean()),
            "share_excess": float(ex[m].sum()) / total if total else 0.0}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--source", default=None, help="the source model (CMF)")
    ap.add_argument("--model", action="append", default=[], help="a model to compare with the source (repeatable)")
    ap.add_argument("--data", default=None, help="the text: a tdata directory (every split)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the text scored (windows of --window)")
    ap.add_argument("--window", type=int, default=512, help="tokens a window")
    a = ap.parse_args(argv)
    from cortiq import load_tokenizer
    from cortiq.data import Tdata

    device = "cpu" if a.cpu else "cuda"
    t0 = time.time()
    if a.tiny:
        from bench.common import pydoc_tdata
        from cortiq.cmf import open_cmf
        from cortiq.compress.folding import fold_cmf

        work = Path(a.out) / "excess-tiny"
        work.mkdir(parents=True, exist_ok=True)
        a.source = str(tiny_cmf(work / "source.cmf"))
        f = open_cmf(a.source)
        g = torch.Generator().manual_seed(0)
        kept = [torch.randperm(n, generator=g)[: n * 3 // 4].sort().values for n in f.arch.intermediate_sizes]
        a.model = [str(fold_cmf(f, kept, work / "pruned.cmf"))]
        a.data = str(pydoc_tdata(a.source, work / "text", 3000, record_tokens=128))
        a.window, a.tokens = 64, 1024
    if not (a.source and a.model and a.data):
        raise SystemExit("bench.quality.excess: give --source, --model and --data (or --cpu --tiny)")
    td = Tdata.open(a.data)
    # the records end to end, cut into windows: every token scored in the context of the ones before it
    ids = np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in td.records(None)])
    n = min(len(ids) // a.window, max(1, a.tokens // a.window))
    win = torch.from_numpy(ids[: n * a.window].reshape(n, a.window))
    tok = load_tokenizer(a.source)
    vocab = np.array([shape_of(tok.decode([i])) for i in range(tok.get_vocab_size())])
    shapes = vocab[win[:, 1:].flatten().numpy()]
    src = token_nll(a.source, win, device).flatten()
    res = {"source": a.source, "data": a.data, "tokens": int(src.numel()), "source_nll": float(src.mean()), "models": []}
    for m in a.model:
        nll = token_nll(m, win, device).flatten()
        res["models"].append({"model": m, "excess": float((nll - src).mean()), "rows": breakdown(src, nll, shapes)})
    res["seconds"] = time.time() - t0
    write_json(a.out, "excess.json", res)
    for r in res["models"]:
        print(f"\n{r['model']}: excess NLL over the source {r['excess']:+.3f} on {res['tokens']} tokens of {a.data} "
              f"(source {res['source_nll']:.3f})")
        print_table(["part", "tokens", "share of the text", "source NLL", "excess", "share of the excess"],
                    [[x["part"], x["tokens"], f"{x['share_tokens']:.2f}", f"{x['source_nll']:.2f}",
                      f"{x['excess']:+.3f}", f"{x['share_excess']:.2f}"] for x in r["rows"]])
    log(f"bench.quality.excess: {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    finish(main())
