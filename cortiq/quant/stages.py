"""Quantization of a final model into cortiq's block codecs by GPTQ (or AWQ-style
scales and GPTQ) from calibration windows of its data.

Two stages (their chain, `quantize_chain`, runs for `cortiq recode` and the
flows' re-encode):

- `qgrams`: the Grams of every grouped linear input (cortiq.quant.layers) of
  every decoder layer, taken layer by layer: layer i's Grams are captured on
  the outputs of layers 0..i-1 already quantized (sequential GPTQ: each layer
  corrects the error of those below it), then layer i is quantized and its
  quantized outputs feed layer i+1. The quantization is thus made here, once:
  the stage keeps the Grams (f32, `qgrams.safetensors`; the layers are
  quantized from those f32 values, so the Grams re-quantize to the same
  blocks) and each weight's blocks and each rescaled norm (`blocks.safetensors`).
  Keyed on the model's content, the data and the settings.
- `quantize`: the model file: those blocks for the grouped weights, every
  other matrix round-to-nearest (as `cortiq recode` writes it), in the codec's
  exact bytes, so the GGUF export of a q4 file is byte for byte its blocks.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from .. import store, tracking
from ..errors import CortiqError
from ..runner import Stage
from .settings import BLOCK_CODECS, QuantSettings

GRAMS_FILE = "qgrams.safetensors"
BLOCKS_FILE = "blocks.safetensors"


def uses_grams(codec: str, s: QuantSettings) -> bool:
    """True when writing `codec` with `s` takes the Grams (a block codec, GPTQ or AWQ)."""
    return codec in BLOCK_CODECS and s.method_for(codec) != "rtn"


def _check(codec: str, s: QuantSettings) -> None:
    if not uses_grams(codec, s):
        raise CortiqError(f"quantize: method {s.method_for(codec)} with codec {codec}: GPTQ and AWQ write "
                          f"{', '.join(BLOCK_CODECS)} (use method rtn for the others)")


def _layer_args(codec: str, s: QuantSettings) -> dict:
    return {"method": s.method_for(codec), "block": s.block, "damp": s.damp, "act_order": s.act_order, "awq_grid": s.awq_grid,
            "clip_grid": s.clip_grid, "q4_grid": s.q4_grid}


def _device(s: QuantSettings):
    from ..devices import resolve_device

    return resolve_device(s.device, "quant settings")


def capture(model_cmf, tdata_dir, codec: str, s: QuantSettings, progress: bool = True) -> tuple[dict, dict, dict, dict]:
    """The sequential Gram capture and quantization: (report, meta.json, {"{layer}.{group}": G f32 [C, C]},
    {weight name: its codec bytes, rescaled norm name: its f32 values})."""
    import torch
    from tqdm import tqdm

    from ..codecs import below_8_bits, get as codec_get
    from ..compress.grams import add_gram
    from ..compress.stages import calibration_windows
    from ..model import load_model
    from .layers import _submodule, groups, more_bits, quantize_layer

    _check(codec, s)
    ids, rows = calibration_windows(model_cmf, tdata_dir, s.window, s.max_windows)
    dev = _device(s)
    model = load_model(model_cmf, dtype=torch.float32, device=dev)
    t0 = time.time()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim == 1}
    out, blocks, report, stored_in = {}, {}, [], {}
    down8 = more_bits(len(model.layers), s.down_8bit) if below_8_bits(codec_get(codec)) else set()
    with torch.no_grad():
        starts = range(0, ids.shape[0], s.batch)
        keep = [rows[a : a + s.batch].to(dev) for a in starts]
        # every window's hidden state, on the device: 64 windows of 256 at SmolLM2's width are 38 MB
        h = [model.embed(ids[a : a + s.batch].to(dev)) for a in starts]
        bar = tqdm(total=len(model.layers), desc=f"Grams and {s.method_for(codec)} → {codec}", unit="layer", file=sys.stderr,
                   disable=not progress, leave=False)
        for i, layer in enumerate(model.layers):
            gs = groups(layer)
            accs = {}
            for g in gs:
                C = int(_submodule(layer, g.hook).weight.shape[1])
                accs[g.key] = torch.zeros(C, C, dtype=torch.float64, device=dev)
            cur = {}

            def hook(key):
                return lambda mod, inp: add_gram(accs[key], inp[0], cur["keep"])

            handles = [_submodule(layer, g.hook).register_forward_pre_hook(hook(g.key)) for g in gs]
            try:
                for k, hb in enumerate(h):
                    cur["keep"] = keep[k]
                    model.run_layers(hb, i, i + 1)
            finally:
                for hd in handles:
                    hd.remove()
            grams = {key: a.float() for key, a in accs.items()}
            for key, G in grams.items():
                if not bool((torch.diagonal(G) > 0).any()):
                    raise CortiqError(f"{model_cmf}: layer {i} {key}: the calibration activations are all zero")
                out[f"{i}.{key}"] = G.cpu().contiguous()
            r = quantize_layer(layer, grams, codec, **_layer_args(codec, s),
                               codec_of={"down_in": "q8"} if i in down8 else None)
            report += [{"layer": i, **row} for row in r.rows]
            for g, row in zip(gs, r.rows):  # one row a group, in the groups' order
                if row["codec"] != codec:
                    stored_in.update({f"model.layers.{i}.{m}.weight": row["codec"] for m in g.mods})
            blocks.update({f"model.layers.{i}.{name}.weight": st for name, st in r.stored.items()})
            h = [model.run_layers(hb, i, i + 1) for hb in h]
            bar.update(1)
        bar.close()
    # the vectors AWQ rescaled (RMSNorm weights)
    blocks.update({n: p.detach().float().cpu().contiguous() for n, p in model.named_parameters()
                   if p.ndim == 1 and not torch.equal(p.detach(), before[n])})
    count = int(rows.sum())
    err, rtn = sum(r["err"] for r in report), sum(r["err_rtn"] for r in report)
    rep = {"metrics": {"qgram_rows": float(count), "qgram_sec": time.time() - t0, "quant_err": err,
                       "quant_err_rtn": rtn, "quant_over_rtn": err / max(rtn, 1e-30)},
           "count": count, "groups": report, "device": str(dev), "codecs": stored_in}
    meta = {"stage": QGRAMS.name, "version": QGRAMS.version, "settings": dataclasses.asdict(s), "codec": codec,
            "inputs": [str(model_cmf), str(tdata_dir)], "report": rep}
    return rep, meta, out, blocks


def read_grams(grams_dir) -> dict[int, dict]:
    """{layer: {group: G f32}} of a finished `qgrams` stage."""
    from safetensors.torch import load_file

    store.read_meta(grams_dir)  # a finished stage, or the one-line error
    out: dict[int, dict] = {}
    for k, v in load_file(str(Path(grams_dir) / GRAMS_FILE)).items():
        layer, _, key = k.partition(".")
        out.setdefault(int(layer), {})[key] = v
    return out


def quantize(model_cmf, grams_dir, codec: str, s: QuantSettings, out_cmf, progress: bool = True) -> dict:
    """The `quantize` stage: `model_cmf` in `codec`, its grouped weights in the
    blocks the `qgrams` stage made, the norms AWQ rescaled rewritten, every
    other tensor as `cortiq recode` writes it; provenance `quantize`."""
    from safetensors.torch import load_file

    from .. import codecs
    from ..cmf import Stored, copy_specs, open_cmf, with_provenance, write_cmf

    _check(codec, s)
    meta = store.read_meta(grams_dir)
    if meta.get("codec") != codec:
        raise CortiqError(f"{grams_dir}: Grams and blocks made for {meta.get('codec')}, not {codec}")
    src = open_cmf(model_cmf)
    made = load_file(str(Path(grams_dir) / BLOCKS_FILE))
    unknown = sorted(set(made) - set(src.infos))
    if unknown:
        raise CortiqError(f"{grams_dir}: blocks of {unknown[0]}, which {model_cmf} does not have")
    replace = {}
    for name, t in made.items():
        shape = tuple(src.info(name).shape)
        replace[name] = (shape, lambda t=t: Stored(t)) if len(shape) == 2 else t

    rep = meta["report"]
    other = rep["codecs"]  # the weights written in another codec than the file's (QuantSettings.down_8bit)

    def codec_for(name, info):
        if name in made and len(info.shape) == 2:
            return other.get(name, codec)
        return codecs.choose_codec(codec, info.shape, info.codec, name)

    doc = with_provenance({k: v for k, v in src.doc.items() if k not in ("codecs", "hashes", "shards")}, "quantize",
                          {"codec": codec, "settings": dataclasses.asdict(s), "from": store.file_digest(model_cmf),
                           "groups": rep["groups"]})
    write_cmf(Path(out_cmf), doc, copy_specs(src, codec_for, replace, q4_grid=s.q4_grid))
    m = {k: rep["metrics"][k] for k in ("quant_err", "quant_err_rtn", "quant_over_rtn")}
    return {"metrics": {**m, "bytes": float(open_cmf(out_cmf).nbytes())}, "codec": codec, "method": s.method_for(codec),
            "groups": rep["groups"]}


# ── the stages, declared once ──

def _qgrams(out, ctx, model, tdata, codec, settings):
    from safetensors.torch import save_file

    rep, meta, grams, blocks = capture(Path(model), Path(tdata), codec, settings, ctx.progress)
    with store.stage_dir(out, {**meta, "digest": ctx.digest}) as d:
        save_file(grams, str(d / GRAMS_FILE))
        save_file(blocks, str(d / BLOCKS_FILE))
    ctx.logger.log_metrics(rep["metrics"])
    return {"metrics": rep["metrics"], "count": rep["count"]}


def _quantize(out, ctx, model, grams, codec, settings):
    rep = quantize(Path(model), Path(grams), codec, settings, out, ctx.progress)
    ctx.logger.log_metrics({k: v for k, v in rep["metrics"].items() if k != "bytes"})
    return rep


def _rule_key(codec: str) -> dict:
    from ..codecs import rule_key  # torch's import stays out of `cortiq recode --help`

    return rule_key(codec)


def _codec(p: dict) -> dict:
    # sequential GPTQ: each layer's inputs come out of the layers below, already quantized in this codec
    return {"codec": p["codec"]}


QGRAMS = Stage("qgrams", 1, _qgrams, QuantSettings, ("model", "tdata"), extra=_codec,
               doc="Grams of every decoder layer's linear inputs over calibration windows, each layer's taken on "
                   "the outputs of the layers below it already quantized, and the blocks GPTQ (or AWQ) made of them")
# the file's other matrices follow the whole-model rule (embedding and head at q8 below 8 bits)
QUANTIZE = Stage("quantize", 1, _quantize, QuantSettings, ("model", "grams"),
                 extra=lambda p: {**_codec(p), **_rule_key(p["codec"])}, output="cmf",
                 doc="a model in a block codec (q4, q4_64, q8), its linear weights in the blocks GPTQ (or AWQ) made")


# ── the chain ──

def quantize_chain(runner, model, tdata, codec: str, s: QuantSettings, key: str = "quantize") -> str:
    """qgrams → quantize: `model` in the block codec `codec` by GPTQ or AWQ (`s`) from the Grams of
    `tdata`'s calibration windows, each stage reused when made before (`key`: the quantized model's
    run key, its Grams' `qgrams.<codec>`). Returns the quantized model's path."""
    _check(codec, s)
    grams = runner.run(QGRAMS, f"qgrams.{codec}", model=model, tdata=tdata, codec=codec, settings=s)["path"]
    return runner.run(QUANTIZE, key, model=model, grams=grams, codec=codec, settings=s)["path"]


def requantize(model_cmf, tdata_dir, codec: str, s: QuantSettings, work, logger: tracking.Logger = tracking.NULL,
               progress: bool = True, log=None) -> dict:
    """`quantize_chain` under `work`, the command line's call: {"path": the quantized model,
    "grams": the qgrams stage's result, "quantize": the quantize stage's}."""
    from ..runner import LocalRunner

    runner = LocalRunner(work, logger, progress, say=log or (lambda m: print(m, file=sys.stderr)))
    path = quantize_chain(runner, model_cmf, tdata_dir, codec, s)
    return {"path": path, "grams": runner.results[f"qgrams.{codec}"], "quantize": runner.results["quantize"]}
