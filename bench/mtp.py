"""A fresh MTP draft, trained with `mtp heal`'s defaults, judged where it is used.

    python bench/mtp.py [--model smollm2|MODEL.cmf] [--data SPEC] [--work DIR] [--out DIR]

What it runs (as a user would): SmolLM2-135M converted, `mtp init` (a fresh
draft), `mtp heal` with its default settings (the fresh preset, chosen from
the init's provenance) writing the draft in f16 with q8 and q4 copies. Then:

- offline: hold rates per chain step and drafts kept per round (chain 3) on
  held-out windows, per codec; q4 with and without its sensitive tensors kept
  at q8 (cortiq.mtp.SENSITIVE);
- real decoding: `generate_speculative` at draft depth 1–3 on prompts from the
  data (held-out windows' first tokens) and on chat questions in the model's
  chat template; accepted drafts per round next to what the offline hold rates
  predict for that depth (Σ_{j≤d} Π_{i≤j} hold_i);
- (time allowing) the same training on the data's own text instead of the
  model's continuations, for comparison.

Everything heavy is cached under --work (conversion, data, init, trunk pass,
generated windows). A deadline (--budget seconds) trims the real-decoding
prompts and skips the comparison when time runs short. Results: --out/mtp.json
and a table on stdout (bench/MTP.md records the H200's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cortiq.cmf import open_cmf  # noqa: E402
from cortiq.model import load_model  # noqa: E402
from cortiq.model.generate import generate_speculative  # noqa: E402

#: chat questions for the real-decoding measure (the model's chat template wraps them)
CHAT = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
    "What is the difference between a process and a thread?",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright?",
    "What are prime numbers? Give examples.",
]

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def prepare(args, work: Path) -> tuple[Path, str]:
    """(the model with a fresh draft, the data spec)."""
    from cortiq.cli import main as cli
    from cortiq.mtp import mtp_init

    if args.model == "smollm2":
        src = work / "smollm2.cmf"
        if not src.exists():
            say("converting SmolLM2-135M-Instruct")
            assert cli(["convert", "smollm2", str(src)]) == 0
    else:
        src = Path(args.model)
    spec = args.data
    if spec is None:
        parts = []
        for corpus, cap in (("pydoc", args.pydoc_tokens), ("shakespeare", args.shakespeare_tokens)):
            if cap <= 0:
                continue
            d = work / f"{corpus}.tdata"
            if not (d / "meta.json").exists():
                say(f"building the {corpus} data")
                assert cli(["data", "build", "--corpus", corpus, "--tokenizer", str(src), "--out", str(d)]) == 0
            parts.append(f"{d}@{cap}")
        spec = ",".join(parts)
    init = work / f"{src.stem}.init.cmf"
    if not init.exists():
        say("mtp init")
        mtp_init(src, init)
    return init, spec


WORK = Path.home() / "cache" / "mtp-bench"


def healed_draft(work: str | os.PathLike = WORK, model: str = "smollm2", pydoc_tokens: int = 120000,
                 shakespeare_tokens: int = 60000, device: str = "auto") -> Path:
    """SmolLM2 with a draft from `mtp init` + `mtp heal` at the defaults (f16 draft), built once under
    `work` and reused: what a decode benchmark measures speculative decoding with.
    From another script: importlib.util.spec_from_file_location("mtp_bench", "bench/mtp.py")."""
    from cortiq.mtp import MtpSettings, mtp_heal

    work = Path(work)
    out = work / "run" / "healed.f16.cmf"
    if out.exists():
        return out
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(model=model, data=None, pydoc_tokens=pydoc_tokens, shakespeare_tokens=shakespeare_tokens)
    init, spec = prepare(args, work)
    mtp_heal(init, spec, MtpSettings(codec="f16", trunk_cache=str(work / "trunk"), device=device), out)
    return out


def predicted(hold: list[float], depth: int) -> float:
    """Drafts a round of depth d by the offline hold rates: Σ_{j≤d} Π_{i≤j} hold_i."""
    return float(np.cumprod(hold[:depth]).sum())


def span_counts(ch, P: int, N: int) -> torch.Tensor:
    """Hold counts on the held-out windows over only the rows a real decode of N tokens after a
    P-token prompt drafts from (rows P-1 .. P+N-2), not the whole window."""
    from cortiq.mtp import measures as M

    idx = ch.held.nonzero().flatten()
    tops = []
    for b in ch._batches(idx):
        tops.append(torch.stack([ch._top1(o)[0][..., 0] for o in ch.steps(b, ch.chain)]))
    d = torch.cat(tops, 1)  # [chain, n, T]
    a = P - 1
    e = min(a + N + ch.chain + 1, ch.ids.shape[1])
    lens = (ch.lens[idx] - a).clamp(min=0, max=N + 1)
    return M.chain_counts(ch.ids[idx, a:e], lens, ch.t1[idx, a:e], d[:, :, a:e])


def data_prompts(spec: str, s, n: int, P: int) -> list[list[int]]:
    """n prompts of P tokens: the first tokens of held-out windows (global index % 10 == 9), spread over the sets."""
    from cortiq.data.windows import packed_windows

    f_windows = packed_windows(spec, s.window, s.tokens, min_len=16 + s.chain)
    ids = np.concatenate([p.ids for p in f_windows])
    lens = np.concatenate([p.lengths for p in f_windows])
    held = np.nonzero((np.arange(len(ids)) % 10 == 9) & (lens > P))[0]
    pick = held[np.linspace(0, len(held) - 1, min(n, len(held))).round().astype(int)]
    return [ids[i, :P].tolist() for i in pick]


def chat_prompts(f, n: int) -> list[list[int]]:
    from cortiq.data.chats import render_chat
    from cortiq.tokenizer import from_doc

    doc = f.tokenizer or {}
    tok = from_doc(doc, str(f.path))
    out = []
    for q in CHAT[:n]:
        text = render_chat(doc.get("chat_template"), [{"role": "user", "content": q}], True, "", "", str(f.path))
        out.append(tok.encode(text, add_special_tokens=False).ids)
    return out


_MODELS: dict = {}


def real(path, prompts: list[list[int]], depth: int, max_new: int, device, stop_at: float) -> dict:
    """Speculative greedy decoding of every prompt (until `stop_at` on the bench clock), f32."""
    key = str(path)
    if key not in _MODELS:
        _MODELS.clear()
        f = open_cmf(path)
        _MODELS[key] = (load_model(f, device=device), (f.tokenizer or {}).get("eos_ids") or [])
    m, eos = _MODELS[key]
    acc = rounds = toks = done = 0
    t = time.perf_counter()
    for p in prompts:
        if done and time.perf_counter() - T0 > stop_at:
            break
        r = generate_speculative(m, p, max_new=max_new, draft=depth, eos_ids=eos)
        acc, rounds, toks, done = acc + r.accepted, rounds + r.rounds, toks + len(r.tokens), done + 1
    return {"accepted_per_round": acc / max(rounds, 1), "rounds": rounds, "tokens": toks, "prompts": done,
            "seconds": time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a model without a draft (.cmf)")
    ap.add_argument("--data", default=None, help="a data spec PATH.tdata[@TOKENS],...; default: pydoc and shakespeare")
    ap.add_argument("--pydoc-tokens", type=int, default=120000, help="tokens of the pydoc text (all of it: ~113k)")
    ap.add_argument("--shakespeare-tokens", type=int, default=60000, help="tokens of the shakespeare text")
    ap.add_argument("--work", default=str(WORK), help="cached inputs and outputs")
    ap.add_argument("--only-draft", action="store_true",
                    help="only build (or find) the healed draft under --work and print its path")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where mtp.json goes")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole bench (prompts trimmed to fit)")
    ap.add_argument("--time-limit", type=float, default=0.0, help="mtp heal's time_limit (0: the defaults' own steps)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per real-decoding measure (data and chat each)")
    ap.add_argument("--max-new", type=int, default=96, help="tokens decoded per prompt")
    ap.add_argument("--compare-raw", action=argparse.BooleanOptionalAction, default=True,
                    help="also train on the data's own text (time allowing)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--extra", default="", help="extra MtpSettings as JSON (e.g. a CPU check's small sizes)")
    args = ap.parse_args()

    from cortiq.mtp import MtpSettings, _chain, _remeasure, mtp_heal, resolve, write_draft, _draft_tensors
    from cortiq.mtp.trunk import resolve_device

    if args.only_draft:
        print(healed_draft(args.work, args.model, args.pydoc_tokens, args.shakespeare_tokens, args.device))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    def save():
        (out_dir / "mtp.json").write_text(json.dumps(res, indent=2, default=str))

    init, spec = prepare(args, work)
    res["prep_s"] = time.perf_counter() - T0
    extra = json.loads(args.extra) if args.extra else {}
    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)
    paths = {c: run_dir / f"healed.{c}.cmf" for c in ("f16", "q8", "q4")}
    s = MtpSettings(codec="f16", also=[("q8", str(paths["q8"])), ("q4", str(paths["q4"]))], trunk_cache=str(work / "trunk"),
                    time_limit=args.time_limit, device=args.device, **extra)
    say(f"mtp heal with the defaults on {spec}")
    t = time.perf_counter()
    rep = mtp_heal(init, spec, s, paths["f16"])
    res["heal"] = {"seconds": time.perf_counter() - t, "preset": rep["preset"], "settings": rep["settings"],
                   "metrics": rep["metrics"], "before": rep["before"]["hold"]}
    res["offline"] = {("f16" if k == "out:f16" else k): {"hold": v["hold"], "drafts_per_round": v["drafts_per_round"],
                                                         "bytes": v["bytes"]} for k, v in rep["codecs"].items()}
    save()

    # ── q4: which tensors are sensitive ──
    f = open_cmf(paths["f16"])
    sr = resolve(open_cmf(init), s)
    dev = resolve_device(sr.device)
    m = load_model(f, device=dev)
    ch, _ = _chain(m, f, spec, sr)
    tensors = _draft_tensors(m)
    from cortiq.mtp import measures as M

    c = span_counts(ch, sr.gen_prompt, args.max_new)
    res["offline_span"] = {"rows": f"{sr.gen_prompt - 1}..{sr.gen_prompt + args.max_new - 2}", "hold": M.rates(c),
                           "drafts_per_round": M.drafts_per_round(c), "counted": c[:, 0].tolist()}
    say(f"offline over the first {args.max_new} generated rows only: hold {' / '.join(f'{x:.3f}' for x in M.rates(c))}, "
        f"{M.drafts_per_round(c):.3f} drafts a round")
    save()
    for tag, sens, keep in (("q4 all", (), "q8"), ("q4 eh_proj f16", None, "f16")):
        pth = run_dir / f"healed.{tag.replace(' ', '_')}.cmf"
        if sens is None:
            write_draft(f, tensors, "q4", pth, None, sensitive_codec=keep)
        else:
            write_draft(f, tensors, "q4", pth, None, sensitive=sens)
        r = _remeasure(ch, pth, sr, tag)
        res["offline"][tag] = {"hold": r["hold"], "drafts_per_round": r["drafts_per_round"], "bytes": r["bytes"]}
        save()
    del m, ch

    # ── real decoding ──
    P = sr.gen_prompt
    dp = data_prompts(spec, sr, args.prompts, P)
    cp = chat_prompts(f, args.prompts)
    res["real"] = []
    plan = [("f16", d, kind) for d in (1, 2, 3) for kind in ("data", "chat")] + [("f16", 3, "data-long")] + \
           [(c, 3, kind) for c in ("q8", "q4") for kind in ("data", "chat")]
    reserve = 35.0 if args.compare_raw else 5.0
    for i, (codec, depth, kind) in enumerate(plan):
        share = max(left(args.budget) - reserve, 0.0) / (len(plan) - i)
        # data-long: a whole window's worth of tokens (what the offline measure's rows span)
        new = sr.window - P if kind == "data-long" else args.max_new
        r = real(paths[codec], cp if kind == "chat" else dp, depth, new, dev, time.perf_counter() - T0 + share)
        r.update({"codec": codec, "depth": depth, "prompts_from": kind, "max_new": new,
                  "offline_predicted": predicted(res["offline"][codec]["hold"], depth),
                  "span_predicted": predicted(res["offline_span"]["hold"], depth)})
        r["ratio"] = r["accepted_per_round"] / max(r["offline_predicted"], 1e-9)
        res["real"].append(r)
        say(f"real {codec} depth {depth} {kind}: {r['accepted_per_round']:.3f} a round "
            f"(offline {r['offline_predicted']:.3f}; {r['prompts']} prompts, {r['seconds']:.1f} s)")
        save()

    # ── the same on the data's own text ──
    if args.compare_raw and left(args.budget) > 30:
        tl = max(min(res["heal"]["metrics"]["train_seconds"], left(args.budget) - 25), 5.0)
        raw = run_dir / "raw.f16.cmf"
        s2 = MtpSettings(codec="f16", generate=False, trunk_cache=str(work / "trunk"), time_limit=tl, device=args.device,
                         **extra)
        say(f"mtp heal on the data's own text (time limit {tl:.0f} s)")
        t = time.perf_counter()
        rep2 = mtp_heal(init, spec, s2, raw)
        off = rep2["codecs"]["out:f16"]
        res["raw"] = {"seconds": time.perf_counter() - t, "metrics": rep2["metrics"], "hold": off["hold"],
                      "drafts_per_round": off["drafts_per_round"], "real": []}
        save()
        for kind in ("data", "chat"):
            r = real(raw, dp if kind == "data" else cp, 3, args.max_new, dev,
                     time.perf_counter() - T0 + max(left(args.budget) / 2, 5))
            r.update({"depth": 3, "prompts_from": kind, "offline_predicted": predicted(off["hold"], 3)})
            res["raw"]["real"].append(r)
            save()
    res["total_s"] = time.perf_counter() - T0
    save()

    # ── table ──
    print(f"\ndevice: {res['device']}; heal {res['heal']['seconds']:.0f} s ({res['heal']['metrics']['steps']:.0f} steps, "
          f"training {res['heal']['metrics']['train_seconds']:.0f} s, preset {res['heal']['preset']}); total {res['total_s']:.0f} s")
    print(f"{'draft':<16}{'hold per chain step':<24}{'drafts/round':>13}{'draft MB':>10}")
    for k, v in res["offline"].items():
        print(f"{k:<16}{' / '.join(f'{x:.3f}' for x in v['hold']):<24}{v['drafts_per_round']:>13.3f}{v['bytes'] / 1e6:>10.2f}")
    sp = res["offline_span"]
    print(f"{'f16 rows ' + sp['rows']:<16}{' / '.join(f'{x:.3f}' for x in sp['hold']):<24}{sp['drafts_per_round']:>13.3f}")
    print(f"\n{'draft':<6}{'depth':>6}  {'prompts':<10}{'new':>5}{'real':>8}{'offline':>9}{'ratio':>7}{'span':>7}{'rounds':>8}")
    for r in res["real"]:
        print(f"{r['codec']:<6}{r['depth']:>6}  {r['prompts_from']:<10}{r['max_new']:>5}{r['accepted_per_round']:>8.3f}"
              f"{r['offline_predicted']:>9.3f}{r['ratio']:>7.2f}{r['span_predicted']:>7.3f}{r['rounds']:>8}")
    if "raw" in res:
        rw = res["raw"]
        print(f"\ntrained on the data's own text ({rw['metrics']['steps']:.0f} steps): hold "
              f"{' / '.join(f'{x:.3f}' for x in rw['hold'])}, {rw['drafts_per_round']:.3f} drafts a round offline")
        for r in rw["real"]:
            print(f"  real depth 3 {r['prompts_from']}: {r['accepted_per_round']:.3f} a round "
                  f"(offline {r['offline_predicted']:.3f}, {r['rounds']} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
