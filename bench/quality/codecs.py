"""What each codec costs a healed model, on the heal's text and on text of other sources: one call, one table.

    python -m bench.quality.codecs [--gguf PATH] [--out DIR] [--cache DIR]
    python -m bench.quality.codecs --cpu --tiny   # a smoke run of every code path (measures nothing)
    python -m bench.quality.codecs --cpu --model pruned --texts pydoc,code,legal --score-tokens 8192 \
        --max-windows 16 --rows f16,'q4 rtn',...   # the cheap CPU version: no heal, a few rows

What runs is the library's own code: SmolLM2-135M-Instruct (the GGUF at
--gguf, default the bundled one) converted to CMF; the Shakespeare plays split
as bench/quality/quality.py splits them (most of them the heal corpus); 25 % of the
MLP neurons pruned with `cortiq compress`'s defaults; healed with the heal
defaults (cortiq.heal.heal, one epoch of the heal corpus); then the healed
model in each codec:

- f16, q8 and q4 round-to-nearest (`cortiq recode`, no data; a 4-bit file keeps
  the embedding, SmolLM2's tied head, at q8: cortiq.codecs.KEEP_8BIT), and q4
  round-to-nearest with the embedding in q4 too (the rule's ablation),
- q8 and q4 by GPTQ, and q4 by AWQ-style scales then GPTQ (`cortiq recode
  --data`: Grams over calibration windows of the heal corpus, cortiq.quant),
- q4 QAT-KD: the same heal, at the same tokens, with the trained matrices
  fake-quantized in q4 (heal qat_codec q4), written in q4 as it trained;
- q4 on the symmetric grid (QuantSettings.q4_grid "symmetric": every block's
  min −8·scale, the int4 an HF export packs exactly) by rtn, gptq and awq.

--model source or pruned quantizes the source as converted (the bundled
SmolLM2's weights lie on a Q4_1 grid already) or the compress output without
the heal (no masks learned, uniform widths: its down_proj columns regrouped,
off that grid), and leaves out the heal and the QAT row: a run the CPU affords.

Every row is scored (NLL per token) on the heal corpus's test split ("own"),
and on every record of texts no stage saw: the unseen plays, pydoc, Python
source (the standard library's .py files) and licence text (LICENSE files of
the installed packages' dist-info folders and Python's own). The table gives
each NLL and its difference from the f16 row; it is printed last and written to
OUT/codecs.json. Converted and compressed models and tdata are kept under
--cache (default ~/cache/codecs).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

from bench.common import default_out, finish, log, run_dirs, smollm2_cmf, table, tiny_cmf, write_json
from bench.quality.quality import _on_device, compressed, plays, split_plays

from cortiq import store
from cortiq.heal.settings import HealSettings
from cortiq.measure import recode, score

#: the texts every row is scored on: (name, split) — the heal corpus's test split, every record of the others
TEXTS = (("own", "test"), ("unseen", None), ("pydoc", None), ("code", None), ("legal", None))


def source_model(cache: Path, gguf: str | None, tiny: bool) -> Path:
    """The source: bench.common's tiny random model (--tiny), else SmolLM2 converted once from `gguf`."""
    if tiny:
        out = cache / "tiny.cmf"
        return out if out.exists() else tiny_cmf(out)
    return smollm2_cmf(cache, gguf)


def code_files(limit: int) -> list[Path]:
    """The standard library's own .py files (not site-packages), in name order, the first `limit`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())[:limit]


def licence_files(limit: int) -> list[Path]:
    """LICENSE files of the installed distributions (dist-info folders) and Python's own LICENSE.txt."""
    found = []
    own = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if own.is_file():
        found.append(own)
    for d in sorted({Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}):
        for p in sorted(d.glob("*.dist-info/**/*")):
            if p.is_file() and p.name.upper().startswith(("LICENSE", "LICENCE", "COPYING")):
                found.append(p)
    return found[:limit]


def licence_text(cache: Path, limit: int) -> Path:
    """The licence files in one text (many share a name, LICENSE, which a record id is made of)."""
    out = cache / "licences.txt"
    if not out.exists():
        parts = [p.read_text(errors="replace") for p in licence_files(limit)]
        if not parts:
            raise SystemExit("no licence text found on this machine")
        out.write_text("\n\n".join(parts))
    return out


def tdata_sets(cache: Path, source: Path, tiny: bool) -> dict[str, Path]:
    """The heal corpus (train/val/test) and the held-out texts (every record scored), built once."""
    from cortiq.data import BuildSettings, build

    heal_plays, unseen = split_plays(plays(), tiny)
    cap = 6000 if tiny else 65536

    def held(srcs):
        # every record is scored: the split only has to leave each part non-empty
        return [str(p) for p in srcs], BuildSettings(record_tokens=512, fractions=(0.5, 0.25, 0.25), max_total_tokens=cap)

    specs = {
        "heal": ([str(p) for p in heal_plays], BuildSettings(record_tokens=512, fractions=(0.8, 0.1, 0.1) if tiny else (0.94, 0.03, 0.03),
                                                              max_total_tokens=30000 if tiny else 0)),
        "unseen": held(unseen),
        "pydoc": (["corpus:pydoc"], held([])[1]),
        "code": held(code_files(40 if tiny else 400)),
        "legal": held([licence_text(cache, 20 if tiny else 200)]),
    }
    out = {}
    for name, (src, bs) in specs.items():
        if not src:
            raise SystemExit(f"no {name} text found on this machine")
        d = cache / f"tdata-{name}"
        if not store.is_complete(d):
            build(src, source, d, bs)
        out[name] = d
    return out


def all_q4(src: Path) -> Path:
    """`src` with every matrix in q4 round-to-nearest, the embedding included (no name rule)."""
    from cortiq.cmf import copy_specs, open_cmf, write_cmf
    from cortiq.codecs import choose_codec

    f = open_cmf(src)
    out = src.with_name(f"{src.stem}-q4-all.cmf")
    doc = {k: v for k, v in f.doc.items() if k not in ("codecs", "hashes", "shards")}
    return write_cmf(out, doc, copy_specs(f, lambda n, i: choose_codec("q4", i.shape, i.codec, n, keep_8bit=())))


def heal_settings(tiny: bool, device: str, **kw) -> HealSettings:
    if tiny:
        return HealSettings(window=64, batch=4, epochs=0.3, eval_every=5, checkpoint_every=0, device=device, **kw)
    return HealSettings(device=device, checkpoint_every=0, **kw)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: a smoke test)")
    ap.add_argument("--tiny", action="store_true", help="a small random model and little text: checks the code paths")
    ap.add_argument("--gguf", default=None, help="the SmolLM2-135M GGUF (default: the bundled one)")
    ap.add_argument("--cache", default=None, help="converted/compressed models and tdata (default ~/cache/codecs)")
    ap.add_argument("--out", default=default_out(), help="where codecs.json goes (default $OUT or bench/results/)")
    ap.add_argument("--retain", default="", help="retain sources mixed into the compress, the heals and the GPTQ/AWQ "
                                                 "calibration, comma-separated (e.g. self,corpus:pydoc; default none)")
    ap.add_argument("--clip-grids", default="1", help="QuantSettings.clip_grid values for the GPTQ/AWQ q4 rows, "
                                                     "comma-separated (a row each past the first)")
    ap.add_argument("--down-8bit", default="none", help="QuantSettings.down_8bit values for the q4 AWQ rows, "
                    "comma-separated (the first is the plain row's; the others add a row each)")
    ap.add_argument("--no-qat", action="store_true", help="leave out the q4 QAT-KD row (its heal)")
    ap.add_argument("--model", default="healed", choices=("healed", "source", "pruned"),
                    help="what the codecs quantize: healed (pruned and healed), source (as converted), pruned "
                         "(compress's fold, no masks learned, no heal)")
    ap.add_argument("--texts", default=",".join(t for t, _ in TEXTS), help="the texts scored, comma-separated")
    ap.add_argument("--score-tokens", type=int, default=0, help="most scored tokens per text (0: every record)")
    ap.add_argument("--max-windows", type=int, default=0, help="GPTQ/AWQ calibration windows (0: QuantSettings')")
    ap.add_argument("--rows", default="", help="only these rows, comma-separated (default: every row)")
    return ap.parse_args(argv)


def timed(times: dict, name: str, fn):
    """fn(), its seconds logged and kept in times[name]."""
    t0 = time.perf_counter()
    r = fn()
    times[name] = time.perf_counter() - t0
    log(f"{name}: {times[name]:.1f} s")
    return r


def heal_qat_row(c, pruned, sets, rs):
    """The q4 QAT-KD heal (compiled on CUDA; where that fails, the same heal eager), or None with --no-qat."""
    from cortiq.heal import heal

    def heal_qat(**kw):
        return heal(pruned, c.source, sets["heal"], heal_settings(c.tiny, c.device, qat_codec="q4", **kw), c.qat,
                    work_dir=c.work, progress=False, score_split=None, retain=rs)

    rep_q = None
    try:
        if not c.args.no_qat:
            rep_q = timed(c.times, "heal qat q4", heal_qat)
            c.times["qat_compiled"] = c.device == "cuda"
    except Exception as e:  # noqa: BLE001  (the table still comes out: the same heal, eager)
        log(f"QAT heal with compiled layers failed ({type(e).__name__}: {str(e)[:300]}); again eager")
        rep_q = timed(c.times, "heal qat q4", lambda: heal_qat(compile=False))
        c.times["qat_compiled"] = False
    return rep_q


def quant_runs(args) -> list[tuple[str, str, int, str, str]]:
    """(codec, method, clip grid, down_8bit, q4 grid) of each GPTQ/AWQ row: the plain rows, the symmetric q4
    grid's, then a row per further clip grid and per further down_8bit value."""
    clips = [int(x) for x in args.clip_grids.split(",")]
    downs = args.down_8bit.split(",")
    a = "asymmetric"
    runs = [("q8", "gptq", clips[0], downs[0], a), ("q4", "gptq", clips[0], downs[0], a), ("q4", "awq", clips[0], downs[0], a)]
    runs += [("q4", m, clips[0], downs[0], "symmetric") for m in ("gptq", "awq")]
    runs += [(c, m, g, downs[0], a) for g in clips[1:] for c, m in (("q4", "gptq"), ("q4", "awq"))]
    runs += [("q4", "awq", clips[0], d, a) for d in downs[1:]]
    return runs


def wanted(args, row: str) -> bool:
    """Whether --rows asks for `row` (f16 always: the other rows' differences are taken from it)."""
    return not args.rows or row == "f16" or row in args.rows.split(",")


def codec_models(c, healed: Path, calib) -> tuple[dict, dict]:
    """The healed model in each codec: round-to-nearest, the all-q4 ablation, GPTQ/AWQ ({row: path},
    {row: the quantize stage's metrics})."""
    from cortiq.quant import QuantSettings, requantize

    models: dict[str, Path] = {}
    for codec, grid in (("f16", "asymmetric"), ("q8", "asymmetric"), ("q4", "asymmetric"), ("q4", "symmetric")):
        tag = (f"{codec} rtn" if codec != "f16" else "f16") + (" symmetric" if grid == "symmetric" else "")
        p = healed.with_name(f"{healed.stem}-{tag.replace(' ', '-')}.cmf")
        if wanted(c.args, tag):
            timed(c.times, f"recode {tag}", lambda: recode(healed, p, codec, q4_grid=grid))
            models[tag] = p
    # what a 4-bit file was before cortiq.codecs.KEEP_8BIT: the embedding (SmolLM2's head too) in q4 as well
    if wanted(c.args, "q4 rtn, embedding q4"):
        models["q4 rtn, embedding q4"] = timed(c.times, "recode q4, embedding q4", lambda: all_q4(healed))
    quant_rep = {}
    clip0, down0 = int(c.args.clip_grids.split(",")[0]), c.args.down_8bit.split(",")[0]
    calib_size = {"window": 64, "max_windows": 8} if c.tiny else {}
    if c.args.max_windows:
        calib_size["max_windows"] = c.args.max_windows
    for codec, method, grid, down, q4_grid in quant_runs(c.args):
        s = QuantSettings(method=method, device=c.device, clip_grid=grid, down_8bit=down, q4_grid=q4_grid,
                          **({"method_8bit": method} if codec == "q8" else {}), **calib_size)
        tag = (f"{codec} {method}" + (f" clip {grid}" if grid != clip0 else "")
               + (f" down q8 {down}" if down != down0 else "") + (" symmetric" if q4_grid == "symmetric" else ""))
        if not wanted(c.args, tag):
            continue
        r = timed(c.times, tag, lambda: requantize(healed, calib, codec, s, c.work, progress=False))
        models[tag] = Path(r["path"])
        quant_rep[tag] = r["quantize"]["report"]["metrics"]
    return models, quant_rep


def texts(args) -> list[tuple[str, str | None]]:
    """The (name, split) of TEXTS that --texts names."""
    names = args.texts.split(",")
    return [(t, s) for t, s in TEXTS if t in names]


def score_all(c, models: dict, sets: dict) -> dict[str, dict[str, float]]:
    """{row: {text: NLL per token}} of every model on every text."""
    nll: dict[str, dict[str, float]] = {}
    for text, split in texts(c.args):
        got = timed(c.times, f"score {text}", lambda: score({k: str(v) for k, v in models.items()},
                                                            sets["heal" if text == "own" else text], split, "all",
                                                            c.device, progress=False, window=512,
                                                            max_tokens=c.args.score_tokens))
        for k, v in got.items():
            nll.setdefault(k, {})[text] = v
        # each text's NLL as it comes: a run cut short (a lease's end) keeps the texts it scored
        write_json(c.args.out, "codecs.partial.json", {"nll": nll, "times": c.times})
    return nll


def report(c, models, nll, heal_tokens, rep_q, rs) -> str:
    """The table, with its header line and the total time."""
    from cortiq.cmf import open_cmf

    base = nll["f16"]
    names = [t for t, _ in texts(c.args)]
    rows = [[k, f"{open_cmf(p).nbytes() / 1e6:.1f}"]
            + [f"{nll[k][n]:.4f}" + ("" if k == "f16" else f" ({nll[k][n] - base[n]:+.3f})") for n in names]
            for k, p in models.items()]
    where = "tiny smoke run" if c.tiny else "CPU" if c.device == "cpu" else torch.cuda.get_device_name()
    what = {"source": "the source SmolLM2-135M as converted (weights on a Q4_1 grid)",
            "pruned": "SmolLM2-135M with 25 % of MLP neurons pruned (fold per layer by activation, no heal)",
            "healed": f"the healed SmolLM2-135M: 25 % of MLP neurons pruned, healed {heal_tokens / 1e6:.2f}M tokens"
                      + (f" (QAT: {rep_q['metrics']['steps']} steps, the same)" if rep_q else "")}[c.args.model]
    lines = [f"codecs of {what} ({where}); clip grids {c.args.clip_grids}; retain {', '.join(rs.sources) or 'none'}"
             + (f"; at most {c.args.score_tokens} tokens a text" if c.args.score_tokens else "")
             + "; NLL per token, (Δ vs f16)",
             table(["model", "MB", *names], rows)]
    lines.append(f"total {time.perf_counter() - c.t_all:.0f} s")
    return "\n".join(lines)


def pruned_uniform(c, tdata: Path) -> Path:
    """`cortiq compress` of the source without learned masks (neurons ranked by activation), 25 % of the MLP
    neurons pruned per layer: minutes on a CPU, where learning the masks is hours."""
    from cortiq.cli import main as cortiq

    out = c.cache / ("tiny-pruned-uniform.cmf" if c.tiny else "smollm2-pruned-uniform.cmf")
    if not out.exists():
        argv = ["compress", str(c.source), "--data", str(tdata), "--keep-frac", "0.75", "--fold-scope", "per_layer",
                "--no-learn-masks", "--device", c.device, "--out", str(out), "--work", str(c.work)]
        if cortiq(argv + (["--grams-max-windows", "4"] if c.tiny else [])):
            raise SystemExit(f"cortiq {' '.join(argv)} failed")
    return out


def subject(c, sets, rs, calib) -> tuple[Path, dict | None, dict | None]:
    """The model the codec rows quantize (--model), the heal's report and the QAT heal's (None where not run)."""
    from cortiq.heal import heal

    if c.args.model == "source":
        return c.source, None, None
    if c.args.model == "pruned":
        return timed(c.times, "compress", lambda: pruned_uniform(c, sets["heal"])), None, None
    pruned = timed(c.times, "compress", lambda: compressed(c.cache, c.source, sets["heal"], c.tiny, c.device, rs))
    healed = c.cache / (f"healed{'-' + Path(calib).name if rs.sources else ''}.cmf")
    rep = timed(c.times, "heal", lambda: heal(pruned, c.source, sets["heal"], heal_settings(c.tiny, c.device), healed,
                                              work_dir=c.work, progress=False, score_split=None, retain=rs))
    c.qat = healed.with_name(healed.stem + "-qat-q4.cmf")
    return healed, rep, heal_qat_row(c, pruned, sets, rs)


def main(argv=None) -> int:
    from cortiq.data.stages import cli_runner, with_retain
    from cortiq.data.settings import RetainSettings

    args = parse_args(argv)
    device, cache, out = run_dirs(args, "codecs")
    c = argparse.Namespace(args=args, device=device, tiny=args.tiny, cache=cache, work=cache / "stages", times={},
                           t_all=time.perf_counter())
    tiny, work, times = c.tiny, c.work, c.times
    c.source = source = timed(times, "source", lambda: source_model(cache, args.gguf, tiny))
    sets = timed(times, "tdata", lambda: tdata_sets(cache, source, tiny))
    rs = RetainSettings(sources=[x for x in args.retain.split(",") if x], **({"tokens": 8000} if tiny else {}))
    # the calibration reads the same mix the heal trains on (the recode stage's --data is that mix)
    calib = timed(times, "retain", lambda: with_retain(sets["heal"], source, rs, cli_runner(work, progress=False), work,
                                                        progress=False)[0])
    healed, rep, rep_q = subject(c, sets, rs, calib)
    heal_tokens = rep["metrics"]["steps"] * (64 * 4 if tiny else HealSettings().window * HealSettings().batch) if rep else 0
    models, quant_rep = codec_models(c, healed, calib)
    if rep_q is not None:
        models["q4 qat-kd"] = c.qat
    nll = score_all(c, models, sets)
    printed = report(c, models, nll, heal_tokens, rep_q, rs)
    result = {"nll": nll, "times": times, "quant": quant_rep, "heal_tokens": heal_tokens, "model": args.model,
              "heldout": {"f16 heal": rep and rep["metrics"]["heldout_best"],
                          "qat heal": rep_q and rep_q["metrics"]["heldout_best"]},
              "models": {k: str(v) for k, v in models.items()}, "table": printed, "tiny": tiny,
              "retain": rs.sources}
    (out / "codecs.json").write_text(json.dumps(result, indent=1))
    (out / "codecs.partial.json").unlink(missing_ok=True)
    print(printed)
    return 0


if __name__ == "__main__":
    finish(main())
