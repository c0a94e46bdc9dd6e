"""cortiq's q4 and q8 beside llm-compressor's GPTQ (W4A16 / W8A16) on one healed model and one set of
calibration windows: NLL on the codecs bench's panel, bytes and the quantization's wall time, one call.

    make peer                                   # llm-compressor in .venv-peer (once)
    python -m bench.quality.peer --cpu [--model HEALED.cmf] [--out DIR]
    python -m bench.quality.peer --cpu --tiny   # the code paths; the peer's rows too where .venv-peer exists

The model: --model (a healed CMF, e.g. the codecs or knowledge bench's), else one made here cheaply:
SmolLM2-135M-Instruct (--gguf, default the bundled one) with 25 % of its MLP neurons pruned by activation
score (`cortiq compress --no-learn-masks`: widths uniform) and a short heal (--heal-tokens, windows of 256,
8 a step: the teacher's targets cover every train window, so the data is kept small too), both on the heal
corpus of bench/quality/codecs.py (Shakespeare plays) cut to --heal-data-tokens, with the retain mix
(--retain, default corpus:pydoc, as a CPU run's `auto`).

The calibration: the leading train windows of the whole heal corpus and the retain mix, as many and as long
as QuantSettings says (64 of 256 tokens), taken by cortiq.compress.stages.calibration_windows, the function `cortiq recode --data`
calibrates on. cortiq's rows quantize from them; their token ids go to a file, and llm-compressor's
`oneshot` calibrates on the same windows (bench/quality/peer_gptq.py, run by the peer's venv as a
subprocess: its pins conflict with cortiq's).

The rows: f16; cortiq q8 at its default method (round to nearest); cortiq q4 at its default (AWQ, the
down_proj of some layers at q8, the embedding at q8), by plain GPTQ, and by AWQ with every down_proj in q4
(the peer's share of 4-bit matrices); llm-compressor GPTQ W8A16 in groups of 32 (cortiq's q8 block), W4A16
in groups of 32 (cortiq's q4 block) and of 64 (--peer-groups; its preset's 128 does not divide
SmolLM2's 576 inputs). Symmetric int groups, static activation order, block 128, dampening 0.01:
llm-compressor's GPTQ defaults, which are cortiq's too. llm-compressor's checkpoints are read back by
`cortiq convert` (compressed-tensors pack-quantized int4 / int8 groups of 32 and 64: exactly its values;
checked against the peer's own dequantized copy) and every row is scored by cortiq on the same records:
the codecs bench's panel (own: the heal corpus's test split; unseen plays; pydoc; program source; licence
text), the first --panel-tokens tokens of each. Bytes: the decoder layers' linear weights (codes, scales,
mins) and the whole checkpoint (cortiq's CMF; llm-compressor's safetensors). Seconds: the quantization
alone (cortiq's Gram capture and GPTQ / AWQ; llm-compressor's `oneshot`), on the device named.
Results: OUT/peer.json and the table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import ROOT, finish, log, parser, run_dirs, smollm2_cmf, table, tiny_cmf, write_json
from bench.quality.codecs import TEXTS, tdata_sets, timed

#: llm-compressor's venv (`make peer`)
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
PEER_SCRIPT = ROOT / "bench" / "quality" / "peer_gptq.py"
#: texts no calibration window comes from (the heal corpus's own test split and pydoc are calibrated on)
OTHER_SOURCES = ("unseen", "code", "legal")


def parse_args(argv=None):
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the healed model to compare (CMF; default: made here, cheaply)")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M GGUF the default model starts from (default: bundled)")
    ap.add_argument("--cache", default=None, help="models, tdata and stage outputs (default ~/cache/peer)")
    ap.add_argument("--retain", default="corpus:pydoc", help="retain sources of the compress, heal and calibration "
                                                            "mix, comma-separated")
    ap.add_argument("--heal-tokens", type=int, default=8192, help="the default model's heal budget in tokens")
    ap.add_argument("--heal-data-tokens", type=int, default=8000, help="tokens of the heal corpus the default model's "
                                                                       "compress and heal read (the retain mix doubles it)")
    ap.add_argument("--panel-tokens", type=int, default=2048, help="tokens scored of each panel text")
    ap.add_argument("--peer-groups", default="32,64", help="llm-compressor W4A16 group sizes, a row each")
    ap.add_argument("--peer-python", default=str(PEER_PYTHON), help="the python of llm-compressor's venv")
    return ap.parse_args(argv)


def heal_data(cache: Path, source: Path, tiny: bool, cap: int) -> Path:
    """The heal corpus of bench/quality/codecs.py cut to `cap` tokens, for the default model's compress and heal.
    A record's split goes by a hash of its id, and the train share here (0.8) is below the whole corpus's
    (0.94): what trains here is train there, so the whole corpus's test split ("own") is never trained on
    (the rest is held out, for the heal's choice of checkpoint; no test split, which a cut this small
    could leave empty)."""
    from cortiq import store
    from cortiq.data import BuildSettings, build

    from bench.quality.quality import plays, split_plays

    out = cache / f"tdata-heal-{cap}"
    if not store.is_complete(out):
        build([str(p) for p in split_plays(plays(), tiny)[0]], source, out,
              BuildSettings(record_tokens=512, fractions=(0.8, 0.2, 0.0), max_total_tokens=cap))
    return out


def healed_model(c, source: Path, heal_mix: str) -> tuple[Path, str]:
    """(--model, or a cheap compress + heal of `source` on `heal_mix`; the line the report names it by)."""
    if c.args.model:
        return Path(c.args.model), f"given: {c.args.model}"
    from cortiq.compress import compress
    from cortiq.compress.settings import CompressSettings, GramSettings
    from cortiq.heal import heal
    from cortiq.heal.settings import HealSettings

    tokens = 2048 if c.tiny else c.args.heal_tokens
    cut = 30000 if c.tiny else c.args.heal_data_tokens
    pruned, healed = c.cache / f"pruned-{cut}.cmf", c.cache / f"healed-{cut}-{tokens}.cmf"
    grams = GramSettings(window=64, max_windows=8) if c.tiny else GramSettings()
    if not pruned.exists():
        timed(c.times, "compress", lambda: compress(source, heal_mix, CompressSettings(
            learn_masks=False, grams=grams, device=c.device), pruned, work=c.cache / "stages"))
    # the teacher's targets cover every train window of the data: on the CPU, a few tens of thousands
    hs = HealSettings(window=64 if c.tiny else 256, batch=4 if c.tiny else 8, tokens=tokens, eval_every=4,
                      checkpoint_every=0, device=c.device)
    if not healed.exists():
        timed(c.times, "heal", lambda: heal(pruned, source, heal_mix, hs, healed, work_dir=c.cache / "stages",
                                            progress=False, score_split=None))
    return healed, (f"SmolLM2-135M-Instruct{' (tiny: a random model)' if c.tiny else ''}, 25 % of the MLP neurons "
                    f"pruned by activation score (uniform widths), healed {tokens:,} tokens (window {hs.window}, "
                    f"batch {hs.batch}) on {cut:,} tokens of the heal "
                    f"corpus + retain mix")


def calibration(model: Path, calib_tdata, qs, out: Path) -> tuple[object, Path]:
    """The windows cortiq calibrates on (QuantSettings' window and count), and the same token ids in a
    safetensors file for the peer (input_ids, attention_mask: 0 on the stream's padding)."""
    import torch
    from safetensors.torch import save_file

    from cortiq.compress.stages import calibration_windows

    ids, rows = calibration_windows(model, calib_tdata, qs.window, qs.max_windows)
    path = out / "calibration.safetensors"
    save_file({"input_ids": ids.to(torch.int64).contiguous(), "attention_mask": rows.to(torch.int64).contiguous()},
              str(path))
    return (tuple(ids.shape), int((~rows).sum())), path


def cortiq_rows(c, model: Path, calib_tdata) -> dict[str, dict]:
    """{row: {"path", "seconds"}} of cortiq's codecs: f16 and q8 by `recode`, q4 by `requantize`."""
    from cortiq.measure import recode
    from cortiq.quant import QuantSettings, requantize

    rows = {}
    for label, codec in (("f16", "f16"), ("cortiq q8 rtn (default)", "q8")):
        p = c.run / f"{codec}.cmf"
        t0 = time.perf_counter()
        recode(model, p, codec)
        rows[label] = {"path": p, "seconds": time.perf_counter() - t0}
    small = {"window": 64, "max_windows": 8} if c.tiny else {}
    for label, kw in (("cortiq q4 awq (default)", {}), ("cortiq q4 gptq", {"method": "gptq"}),
                      ("cortiq q4 awq, every down_proj q4", {"down_8bit": "none"})):
        s = QuantSettings(device=c.device, **kw, **small)
        t0 = time.perf_counter()
        r = requantize(model, calib_tdata, "q4", s, c.run / "stages", progress=False, log=log)
        rows[label] = {"path": Path(r["path"]), "seconds": time.perf_counter() - t0}
        log(f"{label}: {rows[label]['seconds']:.1f} s")
    return rows


def peer_run(c, hf: Path, calib: Path, bits: int, group: int) -> dict:
    """llm-compressor's GPTQ of `hf` in its venv: {"path": the checkpoint read back as CMF, ...}."""
    from cortiq.convert.hf import convert_hf_dir

    out = c.run / f"peer-w{bits}g{group}"
    cmd = [c.args.peer_python, str(PEER_SCRIPT), "--model", str(hf), "--calib", str(calib), "--bits", str(bits),
           "--group", str(group), "--out", str(out)]
    t0 = time.perf_counter()
    # no stdin: a background child that reads the terminal is stopped (SIGTTIN) and the run waits forever
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": ""})
    wall = time.perf_counter() - t0
    if p.returncode:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        log(f"llm-compressor w{bits} g{group} failed (exit {p.returncode}): {tail[0]}")
        return {"error": tail[0]}
    info = json.loads((out / "peer.json").read_text())
    cmf = convert_hf_dir(out / "packed", c.run / f"peer-w{bits}g{group}.cmf")
    dense = convert_hf_dir(out / "dense", c.run / f"peer-w{bits}g{group}-dense.cmf")
    return {"path": cmf, "seconds": info["seconds"], "process_seconds": wall, "info": info,
            "checkpoint": out / "packed", "max_abs_diff_dense": max_diff(cmf, dense)}


def max_diff(a: Path, b: Path) -> float:
    """The largest |difference| of two CMF files' decoded values, tensor by tensor (the same names)."""
    from cortiq.cmf import open_cmf

    fa, fb = open_cmf(a), open_cmf(b)
    if set(fa.names) != set(fb.names):
        return float("inf")
    return max(float((fa.tensor(n) - fb.tensor(n)).abs().max()) for n in fa.names)


def peer_rows(c, model: Path, calib: Path) -> tuple[dict[str, dict], str | None]:
    """llm-compressor's rows, or none and the reason (no venv)."""
    from bench.quality.sizes import cortiq

    if not Path(c.args.peer_python).exists():
        return {}, f"llm-compressor rows skipped: no {c.args.peer_python} (`make peer` makes it)"
    hf = c.run / "hf-f32"
    cortiq("export", model, "--to", "hf", hf, "--dtype", "f32", "--quantized", "none", "--force")
    rows = {}
    for bits, group in [(8, 32)] + [(4, int(g)) for g in c.args.peer_groups.split(",") if g]:
        label = f"llm-compressor W{bits}A16 GPTQ g{group}"
        rows[label] = timed(c.times, label, lambda: peer_run(c, hf, calib, bits, group))
    return rows, None


def linear_bytes_cmf(path: Path) -> int:
    """Stored bytes of the decoder layers' matrices (attention and MLP projections) of a CMF file."""
    from cortiq.cmf import open_cmf

    f = open_cmf(path)
    return sum(f.info(n).nbytes for n in f.names if ".layers." in f".{n}" and len(f.info(n).shape) == 2)


def linear_bytes_hf(ckpt: Path) -> tuple[int, int]:
    """(the decoder layers' linear modules' bytes, every tensor's) of a safetensors checkpoint."""
    from safetensors import safe_open

    lin = total = 0
    for st in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(st), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n = _dtype_bytes(sl.get_dtype())
                for d in sl.get_shape():
                    n *= d
                total += n
                if ".layers." in k and (".weight_" in k or (k.endswith(".weight") and len(sl.get_shape()) == 2)):
                    lin += n
    return lin, total


def _dtype_bytes(dt: str) -> int:
    return {"F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I64": 8, "I8": 1, "U8": 1}[dt]


def score_rows(c, rows: dict, sets: dict) -> None:
    """Each row's NLL on each panel text (`nll` in the row), cortiq's scorer on the same records."""
    from cortiq.measure import score

    models = {k: str(r["path"]) for k, r in rows.items() if "path" in r}
    cap = 2000 if c.tiny else c.args.panel_tokens
    for text, split in TEXTS:
        got = timed(c.times, f"score {text}", lambda: score(models, sets["heal" if text == "own" else text], split,
                                                            "all", c.device, progress=False, window=512,
                                                            max_tokens=cap))
        for k, v in got.items():
            rows[k].setdefault("nll", {})[text] = v


def sizes(rows: dict) -> None:
    """`linear_bytes` and `bytes` (the whole checkpoint) of each row."""
    for r in rows.values():
        if "path" not in r:
            continue
        if "checkpoint" in r:
            r["linear_bytes"], r["bytes"] = linear_bytes_hf(Path(r["checkpoint"]))
        else:
            r["linear_bytes"], r["bytes"] = linear_bytes_cmf(Path(r["path"])), Path(r["path"]).stat().st_size


def report(c, rows: dict, what: str, calib_note: str, skipped: str | None) -> str:
    names = [t for t, _ in TEXTS]
    base = rows["f16"]["nll"]
    lines = [f"cortiq vs llm-compressor on {c.device_name}: {what}; calibration {calib_note}; NLL per token "
             f"(Δ vs f16) on the first {2000 if c.tiny else c.args.panel_tokens} tokens of each text "
             f"(calibrated on: own, pydoc; other sources: {', '.join(OTHER_SOURCES)})"]
    body = []
    for k, r in rows.items():
        if "nll" not in r:
            body.append([k, "", "", r.get("error", "")] + [""] * (len(names) - 1))
            continue
        body.append([k, f"{r['linear_bytes'] / 1e6:.1f}", f"{r['bytes'] / 1e6:.1f}", f"{r['seconds']:.1f}"]
                    + [f"{r['nll'][n]:.4f}" + ("" if k == "f16" else f" ({r['nll'][n] - base[n]:+.3f})") for n in names])
    lines.append(table(["model", "linear MB", "checkpoint MB", "quantize s", *names], body))
    if skipped:
        lines.append(skipped)
    lines.append(f"total {time.perf_counter() - c.t_all:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    import torch

    from cortiq.data.settings import RetainSettings
    from cortiq.data.stages import cli_runner, with_retain
    from cortiq.quant import QuantSettings

    args = parse_args(argv)
    device, cache, out = run_dirs(args, "peer")
    c = argparse.Namespace(args=args, device=device, tiny=args.tiny, cache=cache, run=cache / "run", times={},
                           t_all=time.perf_counter(),
                           device_name=f"CPU ({torch.get_num_threads()} threads)" if device == "cpu"
                           else torch.cuda.get_device_name())
    shutil.rmtree(c.run, ignore_errors=True)  # every quantization runs (and is timed) afresh
    c.run.mkdir(parents=True)
    source = (cache / "tiny.cmf" if (cache / "tiny.cmf").exists() else tiny_cmf(cache / "tiny.cmf", hidden=128, inter=256)) \
        if args.tiny else smollm2_cmf(cache, args.gguf)
    sets = timed(c.times, "tdata", lambda: tdata_sets(cache, source, args.tiny))
    rs = RetainSettings(sources=[x for x in args.retain.split(",") if x], **({"tokens": 8000} if args.tiny else {}))
    runner = cli_runner(cache / "stages", progress=False)
    # the calibration reads the whole heal corpus and the retain mix (what `cortiq recode --data` is given after
    # a heal); the default model's compress and heal a cut of it (the teacher's targets cover every train window)
    calib_mix = with_retain(sets["heal"], source, rs, runner, cache / "stages", progress=False)[0]
    heal_mix = with_retain(heal_data(cache, source, args.tiny, 30000 if args.tiny else args.heal_data_tokens), source,
                           rs, runner, cache / "stages", progress=False)[0]
    model, what = healed_model(c, source, heal_mix)
    qs = QuantSettings(**({"window": 64, "max_windows": 8} if args.tiny else {}))
    (shape, pads), calib = calibration(model, calib_mix, qs, c.run)
    calib_note = (f"{shape[0]} windows of {shape[1]} tokens of the heal corpus + {', '.join(rs.sources) or 'no retain'} "
                  f"mix ({pads} padding tokens)")
    rows = cortiq_rows(c, model, calib_mix)
    peer, skipped = peer_rows(c, model, calib)
    rows.update(peer)
    if skipped:
        log(skipped)
    score_rows(c, rows, sets)
    sizes(rows)
    printed = report(c, rows, what, calib_note, skipped)
    for r in rows.values():  # paths under the cache, named from it (no machine's folders in a result)
        for k in ("path", "checkpoint"):
            if k in r:
                r[k] = f"CACHE/{Path(r[k]).relative_to(cache)}" if Path(r[k]).is_relative_to(cache) else str(r[k])
    write_json(out, "peer.json", {"tiny": args.tiny, "device": c.device_name, "model": what, "calibration": calib_note,
                                  "panel_tokens": 2000 if args.tiny else args.panel_tokens, "rows": rows,
                                  "times": c.times, "peer_skipped": skipped, "table": printed})
    print(printed)
    return 0


if __name__ == "__main__":
    finish(main())
