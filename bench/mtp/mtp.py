"""A fresh MTP draft, trained with `mtp heal`'s defaults, judged where it is used.

    python -m bench.mtp.mtp [--model smollm2|MODEL.cmf] [--data SPEC] [--work DIR] [--out DIR]
    python -m bench.mtp.mtp --cpu --tiny      # a tiny random model on the CPU: a smoke test of the script

What it runs (as a user would): SmolLM2-135M converted, `mtp init` (a fresh
draft), `mtp heal` with its default settings (the fresh preset, chosen from
the init's provenance and printed) writing the draft in f16 with q8 and q4
copies. Then:

- offline: mtp heal's measure per codec on the held-out windows: drafts kept a
  round by the rounds a greedy decode walks from each prompt's end over `span`
  new tokens, overall and per prompt kind (data continuations, chat answers),
  beside the chain from every row of every window (`every row`, the figure
  before); q4 with and without its sensitive tensors kept at q8
  (cortiq.codecs.KEEP_8BIT);
- real decoding: greedy speculative decoding on the static-cache engine (f32)
  at draft depth 1–3 from the prompts of those held-out windows (data and chat
  kinds), accepted drafts per round next to the same measure
  (cortiq.mtp.measure_text) on the same windows, and the ratio; plus a few
  free chat questions (the measure on the decoded text itself, as no held-out
  window exists for them);
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

from bench.common import finish, parser, print_table, tiny_cmf, write_json
from cortiq.cmf import open_cmf
from cortiq.model import load_model

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


#: a CPU smoke test's settings (--tiny): small windows, few tokens, one epoch
TINY = {"window": 96, "gen_prompt": 40, "span": 40, "topk": 8, "batch": 4, "epochs": 1.0, "eval_every": 20,
        "gen_batch": 64, "head_chunk": 256, "trunk_batch": 8, "gen_windows": 0}


def prepare(args, work: Path) -> tuple[Path, str]:
    """(the model with a fresh draft, the data spec)."""
    from cortiq.cli import main as cli
    from cortiq.mtp import mtp_init

    if getattr(args, "tiny", False):
        src = work / "tiny.cmf"
        if not src.exists():
            tiny_cmf(src)
    elif args.model == "smollm2":
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
                 shakespeare_tokens: int = 480000, device: str = "auto") -> Path:
    """SmolLM2 with a draft from `mtp init` + `mtp heal` at the defaults (f16 draft), built once under
    `work` and reused: what a decode benchmark measures speculative decoding with.
    From another script: importlib.util.spec_from_file_location("mtp_bench", "bench/mtp/mtp.py")."""
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


def chat_prompts(f, n: int) -> list[list[int]]:
    from cortiq.data.chats import chat_text
    from cortiq.tokenizer import from_doc

    doc = f.tokenizer or {}
    tok = from_doc(doc, str(f.path))
    out = []
    for q in CHAT[:n]:
        text = chat_text(doc.get("chat_template"), [{"role": "user", "content": q}], str(f.path))
        out.append(tok.encode(text, add_special_tokens=False).ids)
    return out


_MODELS: dict = {}


def _model(path, device):
    key = str(path)
    if key not in _MODELS:
        _MODELS.clear()
        f = open_cmf(path)
        _MODELS[key] = (load_model(f, device=device), f)
    return _MODELS[key]


def real(path, prompts: list[list[int]], depth: int, max_new: int, device, eos: list[int]) -> dict:
    """Greedy speculative decoding of every prompt at once on the static-cache engine (f32)."""
    from cortiq.model.generate import decode

    m, _ = _model(path, device)
    t = time.perf_counter()
    rs = decode(m, prompts, max_new=max_new, draft=depth, eos_ids=eos)
    acc, rounds = sum(r.accepted for r in rs), sum(r.rounds for r in rs)
    return {"accepted_per_round": acc / max(rounds, 1), "rounds": rounds, "tokens": sum(len(r.tokens) for r in rs),
            "prompts": len(prompts), "seconds": time.perf_counter() - t, "texts": [p + r.tokens for p, r in zip(prompts, rs)]}


def offline(path, seqs, plens, depth: int, span: int, chat, device) -> dict:
    """mtp heal's measure (cortiq.mtp.measure_text) on these sequences: {kind: drafts a round}.
    The engine emits the first new token at prefill, so its rounds over N tokens are the walk's over N - 1."""
    from cortiq.mtp import measure_text

    m, f = _model(path, device)
    r = measure_text(m, seqs, plens, chain=depth, span=span - 1, chat=chat, pad=f.eos_id)
    return {k: v["drafts_per_round"] for k, v in r.items()}


def pick(n_all: int, n: int) -> np.ndarray:
    """n indices spread evenly over range(n_all)."""
    return np.unique(np.linspace(0, n_all - 1, min(n, n_all)).round().astype(int)) if n_all else np.zeros(0, int)


def parse_args() -> argparse.Namespace:
    """The command line; --cpu sets the device, --tiny the small sizes and a work folder of their own."""
    ap = parser(__doc__.split("\n\n")[0], cpu_help="run on the CPU (device cpu)",
                tiny_help="a tiny random model, a little data and small settings: a smoke test of this script")
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a model without a draft (.cmf)")
    ap.add_argument("--data", default=None, help="a data spec PATH.tdata[@TOKENS],...; default: pydoc and shakespeare")
    ap.add_argument("--pydoc-tokens", type=int, default=120000, help="tokens of the pydoc text (all of it: ~113k)")
    ap.add_argument("--shakespeare-tokens", type=int, default=480000, help="tokens of the shakespeare text")
    ap.add_argument("--work", default=str(WORK), help="cached inputs and outputs")
    ap.add_argument("--only-draft", action="store_true",
                    help="only build (or find) the healed draft under --work and print its path")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole bench (prompts trimmed to fit)")
    ap.add_argument("--time-limit", type=float, default=0.0, help="mtp heal's time_limit (0: the defaults' own steps)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts per kind (data, chat) decoded for real")
    ap.add_argument("--questions", type=int, default=8, help="free chat questions decoded for real")
    ap.add_argument("--max-new", type=int, default=0, help="tokens decoded per prompt (0: mtp heal's span)")
    ap.add_argument("--compare-raw", action=argparse.BooleanOptionalAction, default=True,
                    help="also train on the data's own text (time allowing)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--extra", default="", help="extra MtpSettings as JSON (e.g. a CPU check's small sizes)")
    args = ap.parse_args()
    if args.cpu:
        args.device = "cpu"
    if args.tiny:
        # the pydoc text alone: building the plays' tdata tokenizes all of them first (~5M bytes)
        args.pydoc_tokens, args.shakespeare_tokens = min(args.pydoc_tokens, 8000), 0
        args.prompts, args.questions = min(args.prompts, 4), min(args.questions, 2)
        if args.work == str(WORK):
            args.work = str(WORK.parent / "mtp-bench-tiny")
    return args


#: the measure's figures per prompt kind, beside the overall one
KINDS = ("data", "chat", "every_row")


def heal_draft(args, c) -> None:
    """mtp init's draft healed at the defaults (f16, with q8 and q4 copies): the heal's figures and each
    codec's offline measure into the result."""
    from cortiq.mtp import MtpSettings, mtp_heal, resolve

    c.init, c.spec = prepare(args, c.work)
    c.res["prep_s"] = time.perf_counter() - T0
    c.extra = {**(TINY if args.tiny else {}), **(json.loads(args.extra) if args.extra else {})}
    c.run_dir = c.work / "run"
    c.run_dir.mkdir(exist_ok=True)
    c.paths = {k: c.run_dir / f"healed.{k}.cmf" for k in ("f16", "q8", "q4")}
    s = MtpSettings(codec="f16", also=[("q8", str(c.paths["q8"])), ("q4", str(c.paths["q4"]))],
                    trunk_cache=str(c.work / "trunk"), time_limit=args.time_limit, device=args.device, **c.extra)
    c.sr = sr = resolve(open_cmf(c.init), s)
    say(f"preset {sr.preset}: lr {sr.lr:g}, {sr.epochs:g} epochs, window {sr.window}, batch {sr.batch}, "
        f"prompt {sr.gen_prompt}, chat share {sr.gen_chat:g}, span {sr.span}, eval every {sr.eval_every}; data {c.spec}")
    t = time.perf_counter()
    rep = mtp_heal(c.init, c.spec, s, c.paths["f16"])
    c.res["heal"] = {"seconds": time.perf_counter() - t, "preset": rep["preset"], "settings": rep["settings"],
                     "metrics": rep["metrics"], "before": rep["before"]["hold"]}
    c.res["offline"] = {("f16" if k == "out:f16" else k): {"hold": v["hold"], "drafts_per_round": v["drafts_per_round"],
                                                           "bytes": v["bytes"],
                                                           **{x: v[x]["drafts_per_round"] for x in KINDS if x in v}}
                        for k, v in rep["codecs"].items()}
    c.save()


def q4_variants(c):
    """q4: which tensors are sensitive (all at q4 with the sensitive ones at q8, and eh_proj kept at f16),
    each measured offline. Returns the loaded healed model, which the next part reads its windows with."""
    from cortiq.devices import rank_device
    from cortiq.mtp.heal import _chain, _draft_tensors, _remeasure, write_draft

    c.f = f = open_cmf(c.paths["f16"])
    c.dev = rank_device(c.sr.device, "mtp settings")
    m = load_model(f, device=c.dev)
    ch, _ = _chain(m, f, c.spec, c.sr)
    tensors = _draft_tensors(m)
    for tag, sens, keep in (("q4 all", (), "q8"), ("q4 eh_proj f16", None, "f16")):
        pth = c.run_dir / f"healed.{tag.replace(' ', '_')}.cmf"
        if sens is None:
            write_draft(f, tensors, "q4", pth, None, sensitive_codec=keep)
        else:
            write_draft(f, tensors, "q4", pth, None, sensitive=sens)
        r = _remeasure(ch, pth, c.sr, tag)
        c.res["offline"][tag] = {"hold": r["hold"], "drafts_per_round": r["drafts_per_round"], "bytes": r["bytes"],
                                 **{x: r[x]["drafts_per_round"] for x in KINDS if x in r}}
        c.save()
    del ch
    return m


def heldout_sets(args, c, m) -> dict:
    """Up to --prompts held-out windows per kind: {kind: (prompts, windows, prompt lengths, chat flags)}."""
    from cortiq.mtp import heldout_windows

    hw = heldout_windows(m, c.f, c.spec, c.sr)
    sets = {}
    for kind in ("data", "chat"):
        idx = (hw["chat"] if kind == "chat" else ~hw["chat"]).nonzero().flatten()
        idx = idx[torch.as_tensor(pick(len(idx), args.prompts), dtype=torch.long)] if len(idx) else idx
        if len(idx) == 0:
            continue
        seqs = [hw["ids"][i, : hw["lens"][i]].tolist() for i in idx]
        plens = [int(hw["start"][i]) + 1 for i in idx]
        sets[kind] = ([x[:p] for x, p in zip(seqs, plens)], seqs, plens, hw["chat"][idx])
    return sets


def real_decoding(args, c) -> None:
    """Real decoding on the held-out windows' prompts (and free questions), against the measure on those
    windows, per codec and depth, while the budget lasts."""
    qs = chat_prompts(c.f, args.questions)
    c.res["real"] = []
    plan = [("f16", d, k) for d in (1, 2, 3) for k in list(c.sets) + (["questions"] if qs else [])] + \
           [(codec, 3, k) for codec in ("q8", "q4") for k in c.sets]
    reserve = 60.0 if args.compare_raw else 5.0
    for codec, depth, kind in plan:
        if c.res["real"] and left(args.budget) < reserve:
            say(f"budget: real decoding stops before {codec} depth {depth} {kind}")
            break
        prompts = qs if kind == "questions" else c.sets[kind][0]
        r = real(c.paths[codec], prompts, depth, c.new, c.dev, c.eos)
        texts = r.pop("texts")
        if kind == "questions":  # no held-out window: the measure on the decoded text itself
            off = offline(c.paths[codec], texts, [len(p) for p in prompts], depth, c.new, None, c.dev).get("walk", 0.0)
        else:
            _, seqs, plens, chat = c.sets[kind]
            off = offline(c.paths[codec], seqs, plens, depth, c.new, chat, c.dev).get(kind, 0.0)
        r.update({"codec": codec, "depth": depth, "prompts_from": kind, "max_new": c.new, "offline": off,
                  "ratio": r["accepted_per_round"] / max(off, 1e-9)})
        c.res["real"].append(r)
        say(f"real {codec} depth {depth} {kind}: {r['accepted_per_round']:.3f} a round "
            f"(offline {off:.3f}; {r['prompts']} prompts, {r['seconds']:.1f} s)")
        c.save()


def raw_compare(args, c) -> None:
    """The same training on the data's own text instead of the model's continuations, in the time left."""
    from cortiq.mtp import MtpSettings, mtp_heal

    tl = max(min(c.res["heal"]["metrics"]["train_seconds"], left(args.budget) - 40), 5.0)
    raw = c.run_dir / "raw.f16.cmf"
    s2 = MtpSettings(codec="f16", generate=False, trunk_cache=str(c.work / "trunk"), time_limit=tl,
                     device=args.device, **c.extra)
    say(f"mtp heal on the data's own text (time limit {tl:.0f} s)")
    t = time.perf_counter()
    rep2 = mtp_heal(c.init, c.spec, s2, raw)
    off2 = rep2["codecs"]["out:f16"]
    c.res["raw"] = {"seconds": time.perf_counter() - t, "metrics": rep2["metrics"], "hold": off2["hold"],
                    "drafts_per_round": off2["drafts_per_round"], "real": []}
    c.save()
    for kind in c.sets:
        prompts, seqs, plens, chat = c.sets[kind]
        r = real(raw, prompts, 3, c.new, c.dev, c.eos)
        r.pop("texts")
        r.update({"depth": 3, "prompts_from": kind,
                  "offline": offline(raw, seqs, plens, 3, c.new, chat, c.dev).get(kind, 0.0)})
        c.res["raw"]["real"].append(r)
        c.save()


def report(res: dict, sr, new: int) -> None:
    """The offline table, the real-decoding table and the raw-text comparison."""
    hm = res["heal"]["metrics"]
    print(f"\ndevice: {res['device']}; heal {res['heal']['seconds']:.0f} s ({hm['steps']:.0f} steps, "
          f"training {hm['train_seconds']:.0f} s, preset {res['heal']['preset']}); total {res['total_s']:.0f} s")
    print(f"offline: held-out windows, chain {sr.chain}, decode rounds over {sr.span} new tokens from each prompt's end")
    print_table(["draft", "hold per chain step", "drafts/round", "data", "chat", "every row", "draft MB"],
                [[k, " / ".join(f"{x:.3f}" for x in v["hold"]), f"{v['drafts_per_round']:.3f}",
                  *(f"{v[x]:.3f}" if x in v else "" for x in KINDS), f"{v['bytes'] / 1e6:.2f}"]
                 for k, v in res["offline"].items()])
    print(f"\nreal: the engine (f32), greedy, {new} new tokens; offline: the same measure on the same prompts' held-out "
          f"windows (questions: on the decoded text)")
    print_table(["draft", "depth", "prompts", "n", "real", "offline", "ratio", "rounds"],
                [[r["codec"], r["depth"], r["prompts_from"], r["prompts"], f"{r['accepted_per_round']:.3f}",
                  f"{r['offline']:.3f}", f"{r['ratio']:.2f}", r["rounds"]] for r in res["real"]])
    if "raw" in res:
        rw = res["raw"]
        print(f"\ntrained on the data's own text ({rw['metrics']['steps']:.0f} steps): hold "
              f"{' / '.join(f'{x:.3f}' for x in rw['hold'])}, {rw['drafts_per_round']:.3f} drafts a round offline")
        for r in rw["real"]:
            print(f"  real depth 3 {r['prompts_from']}: {r['accepted_per_round']:.3f} a round "
                  f"(offline {r['offline']:.3f}, {r['rounds']} rounds)")


def main() -> int:
    args = parse_args()
    if args.only_draft:
        print(healed_draft(args.work, args.model, args.pydoc_tokens, args.shakespeare_tokens, args.device))
        return 0
    c = argparse.Namespace(work=Path(args.work))  # what the parts share
    c.work.mkdir(parents=True, exist_ok=True)
    c.res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"}
    c.save = lambda: write_json(args.out, "mtp.json", c.res)
    heal_draft(args, c)
    m = q4_variants(c)
    c.sets = heldout_sets(args, c, m)
    del m
    c.new = args.max_new or c.sr.span or (c.sr.window - c.sr.gen_prompt)
    c.eos = (c.f.tokenizer or {}).get("eos_ids") or [c.f.eos_id]
    real_decoding(args, c)
    if args.compare_raw and left(args.budget) > 45 and "data" in c.sets:
        raw_compare(args, c)
    c.res["total_s"] = time.perf_counter() - T0
    c.save()
    report(c.res, c.sr, c.new)
    return 0


if __name__ == "__main__":
    finish(main())
