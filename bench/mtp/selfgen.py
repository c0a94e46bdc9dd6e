"""Self-generated text on the GPU: the one generator (cortiq.data.selfgen,
continuous batching on the static-cache decode engine) against the two it
replaced, in one call, with a sample of its text.

    python -m bench.mtp.selfgen --gguf PATH/SmolLM2-135M-Instruct.gguf --out DIR   # the H200 run (needs the gguf wheel)
    python -m bench.mtp.selfgen --model MODEL.cmf --out DIR
    python -m bench.mtp.selfgen --cpu --tiny                                  # a CPU smoke test (seconds)

Rows (bf16 on CUDA, f32 on the CPU; tokens/s counts generated tokens over the
whole call, engine construction and CUDA-graph capture included):
- `selfgen S`: SELFGEN's generation as the stage runs it (its default openings
  mix of BOS, chat requests and corpus prefixes, temperature 1, rows of up to
  --max-new tokens ending at EOS, --tokens in all) at S slots, for each S of --slots;
- `old continue_batch` / `new, same prompts (greedy)`: the draft's old generator
  (cortiq.mtp.selfgen.continue_batch until it was replaced: one eager step per
  token for all rows, prompts of one length, no EOS) on --old-rows prompts of
  64 pydoc tokens continued by --max-new tokens, and the new generator on the
  same prompts with the same budgets (greedy, EOS ignored, so both make the same
  number of tokens);
- `old generate_answers` / `new, same requests (batched)`: `data build --generate-with`'s
  old loop (the plain decoder, one prompt at a time, greedy, EOS stops) on
  --answers chat requests, and the new generator on the same requests (one batch).
Then a sample: the start of a few generated rows of each opening kind.
Results: a table on stdout and --out/selfgen.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import finish, parser, print_table, smollm2_cmf, tiny_cmf, write_json

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def old_continue_batch(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """The draft's generator before cortiq.data.selfgen (kept here as the baseline): prompts
    [B, P] of one length, one forward over them, then one eager [B, 1] step per new token."""
    dev = model.model.embed_tokens.weight.device
    B, P = prompts.shape
    out = torch.empty(B, P + new, dtype=torch.int64, device=dev)
    out[:, :P] = prompts.to(dev)
    cache = model.new_cache()
    h, _ = model.forward_hidden(out[:, :P], cache=cache)
    last = h[:, -1]
    for i in range(new):
        tok = model.logits(last).float().argmax(-1)
        out[:, P + i] = tok
        if i + 1 < new:
            h, _ = model.forward_hidden(tok[:, None], cache=cache)
            last = h[:, -1]
    return out.cpu()


def timed(fn, dev):
    sync(dev)
    t = time.perf_counter()
    r = fn()
    sync(dev)
    return r, time.perf_counter() - t


def parse_args(argv=None):
    """The command line, with the sizes that depend on --tiny filled in and the model's path resolved."""
    ap = parser(__doc__.split("\n\n")[0], cpu_help="run on the CPU",
                tiny_help="a tiny random model and few tokens: checks the code paths")
    ap.add_argument("--gguf", default=None, help="SmolLM2's GGUF file (converted once into --work)")
    ap.add_argument("--model", default=None, help="a model file (.cmf) instead of --gguf")
    ap.add_argument("--work", default=str(Path.home() / "cache" / "selfgen"), help="where the converted model is kept")
    ap.add_argument("--slots", default=None, help="slot counts of the selfgen rows (default 64,256,512; tiny 4,16)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per selfgen row (default 131072; tiny 512)")
    ap.add_argument("--max-new", type=int, default=None, help="most tokens per generated row (default 256; tiny 32)")
    ap.add_argument("--old-rows", type=int, default=None, help="prompts of the continue_batch comparison (default 512; tiny 8)")
    ap.add_argument("--answers", type=int, default=None, help="chat requests of the generate_answers comparison "
                                                                "(default 4: the old loop runs ~13 tok/s; tiny 3)")
    ap.add_argument("--answer-tokens", type=int, default=None, help="most tokens per answer in that comparison (default 64; tiny 16)")
    ap.add_argument("--samples", type=int, default=3, help="sample rows shown per opening kind")
    a = ap.parse_args(argv)
    tiny = a.tiny
    a.slots = [int(x) for x in (a.slots or ("4,16" if tiny else "64,256,512")).split(",")]
    a.tokens = a.tokens or (512 if tiny else 131072)
    a.max_new = a.max_new or (32 if tiny else 256)
    a.old_rows = a.old_rows or (8 if tiny else 512)
    a.answers = a.answers or (3 if tiny else 4)
    a.answer_tokens = a.answer_tokens or (16 if tiny else 64)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if tiny:
        a.path = work / "tiny.cmf"
        if not a.path.exists():
            tiny_cmf(a.path)  # no chat template: the chat openings fall back as on such a model
    elif a.model:
        a.path = Path(a.model)
    elif a.gguf:
        a.path = smollm2_cmf(work, a.gguf)
    else:
        ap.error("give --gguf PATH, --model MODEL.cmf, or --cpu --tiny")
    return a


def selfgen_rows(a, c, row, texts: dict) -> None:
    """The stage's own generation at each slot count; a sample of each opening kind from the last."""
    from cortiq.data.selfgen import Openings, SelfGenSettings, generate_rows

    for S in a.slots:
        s = SelfGenSettings(tokens=a.tokens, max_new=a.max_new, slots=S, device=c.dev.type)
        op = Openings(c.f, s)
        drawn = []

        def prompts():
            for ids in op:
                drawn.append(ids)
                yield ids

        new, secs = timed(lambda: generate_rows(c.model, prompts(), s.max_new, temperature=s.temperature,
                                                eos_ids=c.eos, total=s.tokens, slots=S, max_prompt=op.max_len,
                                                seed=s.seed), c.dev)
        n = sum(len(x) for x in new)
        ended = sum(1 for x in new if len(x) and int(x[-1]) in c.eos)
        row(f"selfgen {S}", n, secs, slots=S, rows=len(new), ended_at_eos=ended)
        if S == a.slots[-1]:
            for kind in ("bos", "chat", "corpus"):
                idx = [i for i, k in enumerate(op.kinds[: len(new)]) if k == kind][: a.samples]
                texts[kind] = [{"opening": c.tok.decode(drawn[i], skip_special_tokens=False),
                                "text": c.tok.decode(new[i].tolist(), skip_special_tokens=False)} for i in idx]


def old_generator_rows(a, c, row) -> None:
    """The draft's old generator (one length of prompts, an eager step per token) against the new one on
    the same prompts, greedy."""
    from cortiq.data.selfgen import generate_rows
    from cortiq.data.sources import corpus_documents

    pyd = "\n\n".join(d.text for d in corpus_documents("pydoc")[:400])
    ids = np.asarray(c.tok.encode(pyd, add_special_tokens=False).ids, dtype=np.int64)
    P = 64
    n_win = min(a.old_rows, len(ids) // (2 * P))
    starts = np.linspace(0, len(ids) - P - 1, n_win).astype(np.int64)
    pr = torch.as_tensor(np.stack([ids[s: s + P] for s in starts]))
    _, secs = timed(lambda: old_continue_batch(c.model, pr, a.max_new), c.dev)
    row("old continue_batch", len(pr) * a.max_new, secs, slots=len(pr))
    new, secs = timed(lambda: generate_rows(c.model, pr.tolist(), a.max_new, slots=len(pr)), c.dev)
    row("new, same prompts (greedy)", sum(len(x) for x in new), secs, slots=len(pr))


def answer_rows(a, c, row) -> None:
    """data build --generate-with's old loop (one prompt at a time) against the new generator, one batch."""
    from cortiq.data.selfgen import chat_openings, generate_rows
    from cortiq.model.generate import generate

    reqs = chat_openings(c.f, c.tok, str(a.path))[::37][:a.answers]
    plain, secs = timed(lambda: [generate(c.model, p, max_new=a.answer_tokens, eos_ids=c.eos).tokens for p in reqs],
                        c.dev)
    row("old generate_answers", sum(len(x) for x in plain), secs, slots=1)
    new, secs = timed(lambda: generate_rows(c.model, reqs, a.answer_tokens, eos_ids=c.eos, slots=len(reqs)), c.dev)
    row("new, same requests (batched)", sum(len(x) for x in new), secs, slots=len(reqs))


def main(argv=None) -> int:
    from cortiq.cmf import open_cmf
    from cortiq.devices import resolve_compute
    from cortiq.model import load_model
    from cortiq.tokenizer import from_doc

    a = parse_args(argv)
    path = a.path
    c = argparse.Namespace(dev=torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda"))
    dt = resolve_compute("auto", c.dev)
    c.f = f = open_cmf(path)
    c.model = load_model(f, dtype=dt, device=c.dev)
    doc = f.tokenizer or {}
    c.tok = from_doc(doc, str(path))
    c.eos = list(doc.get("eos_ids") or [f.eos_id])
    say(f"{path.name} on {c.dev} ({str(dt).removeprefix('torch.')})")
    rows, texts = [], {}

    def row(name, n_tok, secs, **extra):
        rows.append({"row": name, "tokens": int(n_tok), "seconds": secs, "tok_s": n_tok / secs if secs > 0 else 0.0, **extra})
        say(f"{name}: {n_tok} tokens in {secs:.2f} s, {n_tok / max(secs, 1e-9):,.0f} tok/s")

    selfgen_rows(a, c, row, texts)
    old_generator_rows(a, c, row)
    answer_rows(a, c, row)
    print(f"\nself-generated text, {path.name} on {c.dev} ({str(dt).removeprefix('torch.')}), max_new {a.max_new}\n")
    print_table(["row", "slots", "tokens", "seconds", "tok/s"],
                [[r["row"], r["slots"], r["tokens"], f"{r['seconds']:.2f}", f"{r['tok_s']:,.0f}"] for r in rows])
    for kind, xs in texts.items():
        print(f"\n── {kind} openings ──")
        for x in xs:
            print(f"[{x['opening'][-60:]!r}] {x['text'][:300]!r}")
    write_json(a.out, "selfgen.json", {"model": str(path), "device": str(c.dev), "dtype": str(dt),
                                       "max_new": a.max_new, "rows": rows, "samples": texts})
    return 0


if __name__ == "__main__":
    finish(main())
