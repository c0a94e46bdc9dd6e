"""q4 in llama.cpp: a model's GGUF export scores in llama.cpp as the model scores in cortiq.

    python -m bench.quality.llamacpp --llama-bin DIR --model Q4.cmf --gguf Q4.gguf [--model B.cmf --gguf B.gguf ...]
                             --text FILE [--ctx 512 --chunks 8] [--prompt TEXT --n-predict 24] [--cpu]

DIR holds llama.cpp's `llama-perplexity`, `llama-tokenize` and `llama-completion` (built from source with
cmake, e.g. the `vendor/llama.cpp` of the llama-cpp-python sdist: bench/QUALITY.md, "q4 in llama.cpp").
For each (model, GGUF) pair:

- tokens: the text as llama-perplexity tokenizes it (llama-tokenize, given exactly what llama-perplexity's
  `-f` reads: one trailing newline dropped, no escapes, special-token text as plain text, BOS when the GGUF
  asks for one), and whether cortiq's tokenizer gives the same ids;
- llama.cpp's NLL: `llama-perplexity -f TEXT -c CTX -b CTX --chunks N+1 --ppl-output-type 1` (its first N
  chunks read: `llama_nll` says why one more), which cuts the tokens
  into N chunks of CTX, puts BOS first in each chunk when the GGUF adds one, and scores only the second half
  of each (the tokens after position CTX/2); its per-chunk running means carry six decimals;
- cortiq's NLL of the SAME tokens at the SAME positions: llama.cpp's chunks (its token ids, BOS included),
  each scored from token CTX/2 + 1 on by `cortiq.model.nll.score_records` (what `cortiq nll` runs), in f32;
- Δ = llama.cpp − cortiq over all scored tokens, and the worst chunk's;
- greedy: `llama-completion --temp 0 -n N` on the prompt against cortiq's greedy decoding
  (`cortiq.model.generate.generate_fast`, what `cortiq generate` runs), with the first token where they part.

The two tools compute differently (llama.cpp multiplies Q4_1 weights by activations rounded to 8 bits per
block of 32 and keeps K/V in f16; cortiq decodes the weights to f32), so Δ is small but not zero; a wrong
block layout, tokenizer or rope shows as nats, not hundredths.

`--cpu --tiny`: the tiny random Llama of the smoke modes (with a small BPE trained on pydoc: llama.cpp loads
no BPE without merges) re-encoded to q4 and exported to GGUF here, scored on the pydoc text with CTX 64. The llama.cpp rows run when `--llama-bin` (or
$LLAMA_BIN) names a built llama.cpp and are reported as skipped otherwise: building llama.cpp takes ~10
minutes on two cores, more than a smoke test may, so the smoke test checks the cortiq side (export,
tokens, chunks, scoring) and the llama.cpp side runs where it is built.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import finish, log, parser, print_table, pydoc_text, tiny_cmf, write_json

#: llama-perplexity's `--ppl-output-type 1` line per chunk: offset, running PPL, running mean NLL, its error
_PPL_LINE = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$", re.M)


@dataclass
class Llama:
    """A built llama.cpp: the folder of its tool binaries and the threads they use."""

    bin: Path
    threads: int

    def tool(self, name: str) -> Path:
        p = self.bin / name
        if not p.is_file():
            raise SystemExit(f"{p}: missing (build the llama.cpp target {name})")
        return p

    def run(self, name: str, args: list[str], stdin: str | None = None, timeout: int = 1800) -> str:
        """The tool's stdout; its stderr too in the error when it fails."""
        cmd = [str(self.tool(name)), *args]
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        return p.stdout + ("\n" + p.stderr if name == "llama-perplexity" else "")


def perplexity_text(path: Path) -> str:
    """What llama-perplexity's `-f` scores: the file's text less one trailing newline."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def llama_tokens(llama: Llama, gguf: Path, text: str) -> list[int]:
    """llama.cpp's token ids of `text` as llama-perplexity makes them (BOS first when the GGUF adds one)."""
    out = llama.run("llama-tokenize", ["-m", str(gguf), "--stdin", "--ids", "--no-escape", "--no-parse-special",
                                       "--log-disable"], stdin=text)
    line = out.strip().splitlines()[-1]
    return [int(t) for t in line.strip("[]").split(",") if t.strip()]


def gguf_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts first in every chunk, or None when the GGUF adds none."""
    from gguf import GGUFReader

    f = GGUFReader(gguf).fields
    add = f.get("tokenizer.ggml.add_bos_token")
    if add is None or not add.contents() or "tokenizer.ggml.bos_token_id" not in f:
        return None
    return int(f["tokenizer.ggml.bos_token_id"].contents())


def chunks(tokens: list[int], ctx: int, n: int, bos: int | None) -> list:
    """llama-perplexity's chunks as cortiq records: chunk k is tokens[k·ctx : (k+1)·ctx] with BOS first when
    the model adds one, scored on its tokens after position ctx/2 (logits of positions ctx/2 .. ctx−2)."""
    import numpy as np

    from cortiq.model.nll import TextRecord

    n = min(n, len(tokens) // ctx - 1)  # one chunk to spare: llama_nll scores one more
    if n < 1:
        raise SystemExit(f"the text has {len(tokens)} tokens; this needs at least {2 * ctx} for -c {ctx}")
    a = np.asarray(tokens[: n * ctx], dtype=np.int64).reshape(n, ctx).copy()
    if bos is not None:
        a[:, 0] = bos
    return [TextRecord(row, first=ctx // 2 + 1) for row in a]


def cortiq_nll(model, records) -> list[float]:
    """Mean NLL per chunk, scored as `cortiq nll` scores (score_records on the scored positions)."""
    from cortiq.model.nll import score_records

    out = []
    for r in records:
        total, count = score_records(model, [r], loss_on="answer")
        out.append(total / count)
    return out


def llama_nll(llama: Llama, gguf: Path, text_file: Path, ctx: int, n: int) -> list[float]:
    """Mean NLL per chunk of the first `n` chunks, from llama-perplexity's running means.

    Its log lines go through an asynchronous logger that the tool does not flush before it exits, so the
    lines written last can be lost (on a busy machine they are; its final estimate is among them). So it
    scores one chunk more than asked, one chunk per batch (-b CTX): the n lines wanted are then each
    written a whole chunk's compute before the exit, and only the extra chunk's line is at risk."""
    out = llama.run("llama-perplexity", ["-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx),
                                         "--chunks", str(n + 1), "--ppl-output-type", "1", "-t", str(llama.threads)])
    run = [float(m.group(3)) for m in _PPL_LINE.finditer(out)][:n]
    if len(run) != n:
        raise RuntimeError(f"llama-perplexity printed {len(run)} chunk lines for {n} chunks:\n{out[-3000:]}")
    per = ctx - 1 - ctx // 2  # tokens scored per chunk
    sums = [m * per * (k + 1) for k, m in enumerate(run)]
    return [(s - (sums[k - 1] if k else 0.0)) / per for k, s in enumerate(sums)]


def llama_greedy(llama: Llama, gguf: Path, prompt: str, n: int) -> str:
    """llama-completion's greedy continuation of `prompt`: its stdout (the prompt not echoed; the logs go to
    stderr, and --log-disable would silence the continuation too). It writes the text through the same
    unflushed asynchronous logger as llama-perplexity, so the last tokens before its exit can be lost: it
    decodes 8 tokens more than asked, past an EOS too (what follows cortiq's tokens is never compared)."""
    return llama.run("llama-completion", ["-m", str(gguf), "-p", prompt, "-n", str(n + 8), "--temp", "0", "-no-cnv",
                                          "--ignore-eos", "--no-display-prompt", "--no-warmup",
                                          "-t", str(llama.threads)])


def cortiq_greedy(model, tok, prompt: str, n: int, eos) -> list[int]:
    from cortiq.model.generate import generate_fast

    return generate_fast(model, tok.encode(prompt).ids, n, eos_ids=eos).tokens


def agreed(tok, prompt: str, ids: list[int], text: str) -> int:
    """How many of cortiq's greedy tokens llama.cpp's continuation `text` starts with: `text` re-tokenized
    after the prompt (llama-completion prints text, not ids), compared id by id."""
    head = tok.encode(prompt).ids
    full = tok.encode(prompt + text).ids
    theirs = full[len(head):] if full[: len(head)] == head else []
    return next((k for k, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))


def compare(model_path: Path, gguf: Path, text_file: Path, llama: Llama | None, args, device: str) -> dict:
    import torch

    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.tokenizer import from_doc

    f = open_cmf(model_path)
    tok = from_doc(f.tokenizer, str(model_path))
    text = perplexity_text(text_file)
    ours = tok.encode(text).ids
    row = {"model": str(model_path), "gguf": str(gguf), "text": str(text_file), "ctx": args.ctx,
           "codecs": sorted({f.info(n).codec for n in f.names})}
    if llama is not None:
        theirs = llama_tokens(llama, gguf, text)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                     None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
        row.update(tokens=len(theirs), tokens_equal=first is None, first_token_diff=first)
    else:
        theirs = ours
        row.update(tokens=len(ours), tokens_equal=None, first_token_diff=None)
    bos = gguf_bos(gguf)
    recs = chunks(theirs, args.ctx, args.chunks, bos)
    row.update(chunks=len(recs), scored=len(recs) * (args.ctx - 1 - args.ctx // 2), bos=bos)
    model = load_model(f, dtype=torch.float32, device=device)
    t0 = time.perf_counter()
    ours_nll = cortiq_nll(model, recs)
    row["cortiq_s"] = round(time.perf_counter() - t0, 2)
    row["cortiq_nll"] = sum(ours_nll) / len(ours_nll)
    row["cortiq_chunks"] = ours_nll
    gen = cortiq_greedy(model, tok, args.prompt, args.n_predict, (f.tokenizer or {}).get("eos_ids") or [])
    row["cortiq_greedy"] = tok.decode(gen)
    if llama is None:
        row["llama"] = "skipped: no llama.cpp binaries (--llama-bin or $LLAMA_BIN)"
        return row
    t0 = time.perf_counter()
    theirs_nll = llama_nll(llama, gguf, text_file, args.ctx, len(recs))
    row["llama_s"] = round(time.perf_counter() - t0, 2)
    row["llama_nll"] = sum(theirs_nll) / len(theirs_nll)
    row["llama_chunks"] = theirs_nll
    row["delta"] = row["llama_nll"] - row["cortiq_nll"]
    row["worst_chunk_delta"] = max((b - a for a, b in zip(ours_nll, theirs_nll)), key=abs)
    said = llama_greedy(llama, gguf, args.prompt, args.n_predict)
    row["llama_greedy"] = said
    row["greedy_agree"] = agreed(tok, args.prompt, gen, said)
    row["greedy_tokens"] = len(gen)
    row["greedy_equal"] = row["greedy_agree"] == len(gen)
    return row


def tiny_bpe(text: str, vocab: int = 384) -> str:
    """A byte-level BPE with merges trained on `text` (EOS `<|endoftext|>` = id 0). llama.cpp refuses a BPE
    vocabulary without merges (and GGUF cannot hold an empty array), so the byte tokenizer cannot stand in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok.to_str()


def tiny_inputs(work: Path, ctx: int) -> tuple[list[tuple[Path, Path]], Path]:
    """The smoke mode's q4 model (its tokenizer trained on the pydoc text), its GGUF export and a text of
    ~12 chunks of `ctx` tokens."""
    from cortiq.export.gguf import export_gguf
    from cortiq.measure import recode

    work.mkdir(parents=True, exist_ok=True)
    pydoc = pydoc_text()
    src = tiny_cmf(work / "tiny.cmf", inter=96, tokenizer=(tiny_bpe(pydoc[:200_000]), 0))
    q4 = recode(src, work / "tiny-q4.cmf", "q4")
    gguf, _ = export_gguf(q4, work / "tiny-q4.gguf")
    text = work / "pydoc.txt"
    text.write_text(pydoc[200_000 : 200_000 + 40 * ctx], encoding="utf-8")
    return [(q4, gguf)], text


def main(argv=None) -> int:
    ap = parser(__doc__, cpu_help="score cortiq's side on the CPU (f32 either way)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN"),
                    help="the folder of llama-perplexity, llama-tokenize, llama-completion (default $LLAMA_BIN)")
    ap.add_argument("--model", action="append", default=[], help="a CMF model (repeat: one per --gguf)")
    ap.add_argument("--gguf", action="append", default=[], help="its GGUF export (cortiq export --to gguf)")
    ap.add_argument("--text", default=None, help="the text both score (a UTF-8 file)")
    ap.add_argument("--ctx", type=int, default=None, help="tokens per chunk (llama-perplexity -c; default 512, tiny 64)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks scored (llama-perplexity --chunks)")
    ap.add_argument("--prompt", default="The capital of France is", help="the greedy-decoding prompt")
    ap.add_argument("--n-predict", type=int, default=24, help="greedy tokens")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    args = ap.parse_args(argv)
    args.ctx = args.ctx or (64 if args.tiny else 512)
    if args.ctx < 4 or args.ctx % 2:
        raise SystemExit(f"--ctx {args.ctx}: an even number of at least 4 tokens")
    out = Path(args.out)
    if args.tiny:
        pairs, text = tiny_inputs(out / "llamacpp-tiny", args.ctx)
        args.chunks = min(args.chunks, 4)
    else:
        if not args.model or len(args.model) != len(args.gguf) or not args.text:
            raise SystemExit("give --text and one --gguf per --model")
        pairs, text = [(Path(m), Path(g)) for m, g in zip(args.model, args.gguf)], Path(args.text)
    device = "cpu"
    if not args.cpu:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    llama = Llama(Path(args.llama_bin), args.threads) if args.llama_bin else None
    rows = []
    for m, g in pairs:
        log(f"{m.name} / {g.name} on {text.name}")
        rows.append(compare(m, g, text, llama, args, device))
    write_json(out, "llamacpp.json", {"rows": rows, "ctx": args.ctx, "chunks": args.chunks, "prompt": args.prompt,
                                      "device": device, "llama_bin": args.llama_bin})

    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    print_table(["model", "tokens equal", "chunks × scored", "cortiq NLL", "llama.cpp NLL", "Δ", "worst chunk Δ",
                 "greedy agree"],
                [[Path(r["model"]).name, r["tokens_equal"], f"{r['chunks']} × {r['scored'] // r['chunks']}",
                  f"{r['cortiq_nll']:.4f}", num(r.get("llama_nll"), ".4f"), num(r.get("delta"), "+.4f"),
                  num(r.get("worst_chunk_delta"), "+.4f"),
                  f"{r['greedy_agree']}/{r['greedy_tokens']}" if "greedy_agree" in r else r.get("llama")]
                 for r in rows])
    for r in rows:
        print(f"\n{Path(r['model']).name} greedy, {args.prompt!r}:\n  cortiq:    {r['cortiq_greedy']!r}"
              + (f"\n  llama.cpp: {r['llama_greedy'].rstrip()!r} (8 tokens more asked)" if "llama_greedy" in r else ""))
    bad = [r for r in rows if "delta" in r and not (math.isfinite(r["delta"]))]
    return 1 if bad else 0


if __name__ == "__main__":
    finish(main())
