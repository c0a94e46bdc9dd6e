"""How fast tdata builds: N tokens of text and JSONL through `cortiq.data.builder`, then `cortiq.data.windowing`.

    python -m bench.pipeline.data_build [--tokens 1000000] [--tokenizer MODEL.cmf] [--T 2048] [--out DIR]
    python -m bench.pipeline.data_build --cpu --tiny   # 20k tokens, windows of 256: the same code in seconds

It runs on the CPU whatever the machine (`--cpu` is accepted for the smoke
tests' one command line).

Without --tokenizer a byte-level tokenizer (one token per byte, the slowest case
per character) is used. The text is the standard library's pydoc topics,
repeated as files until the token target is reached; a third goes in as JSONL
prompt/answer pairs. Prints tokens/s for the build and for cutting windows.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench.common import finish, parser, print_table, pydoc_text, write_json


def byte_tokenizer_cmf(path: Path) -> Path:
    import torch

    from cortiq.arch import Arch
    from cortiq.cmf import Spec, new_doc, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    arch = Arch(arch_name="llama", vocab_size=259, hidden_size=8, num_layers=1, intermediate_sizes=[16],
                num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    emb = torch.zeros(259, 8)
    return write_cmf(path, new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [256])),
                     [Spec("model.embed_tokens.weight", "f32", (259, 8), lambda: emb)])


def main() -> int:
    ap = parser(__doc__, cpu_help="accepted, no effect: the build runs on the CPU")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--T", type=int, default=2048)
    a = ap.parse_args()
    if a.tiny:
        a.tokens, a.T = min(a.tokens, 20_000), min(a.T, 256)

    from cortiq.data import BuildSettings, build, windows
    from cortiq.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok_path = Path(a.tokenizer) if a.tokenizer else byte_tokenizer_cmf(d / "tok.cmf")
        tok = load_tokenizer(tok_path)
        body = pydoc_text()
        per_copy = len(tok.encode(body, add_special_tokens=False).ids)
        if per_copy > a.tokens:  # less than one copy: its leading share
            body, per_copy = body[:len(body) * a.tokens // per_copy], a.tokens
        copies = max(1, -(-a.tokens // per_copy))
        paras = body.split("\n\n")
        for c in range(copies):
            if c % 3 == 2:  # a third as prompt/answer pairs
                rows = [{"id": f"c{c}:{i}", "prompt": paras[i], "answer": paras[i + 1]} for i in range(0, len(paras) - 1, 2)]
                (d / f"pairs{c}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            else:
                (d / f"text{c}.txt").write_text(body)
        srcs = sorted(str(p) for p in d.iterdir() if p.suffix in (".txt", ".jsonl"))
        t0 = time.perf_counter()
        td = build(srcs, tok_path, d / "td", BuildSettings(record_tokens=512, max_tokens=1 << 16))
        t1 = time.perf_counter()
        c = td.meta["counts"]
        w = windows(td, "train", a.T, None, "answer")
        t2 = time.perf_counter()
        n = c["splits"]["train"]["tokens"]
    rows = [{"part": "build", "records": c["records"], "tokens": c["tokens"], "secs": t1 - t0,
             "tok_s": c["tokens"] / (t1 - t0)},
            {"part": f"windows (T={a.T})", "records": len(w), "tokens": n, "secs": t2 - t1, "tok_s": n / (t2 - t1)}]
    write_json(a.out, "data_build.json", {"tokenizer": a.tokenizer or "bytes", "rows": rows})
    print_table(["part", "records / windows", "tokens", "s", "tokens/s"],
                [[r["part"], r["records"], r["tokens"], f"{r['secs']:.3f}", f"{r['tok_s']:,.0f}"] for r in rows])
    return 0


if __name__ == "__main__":
    finish(main())
