"""The compress stages: their functions, their declarations and the compress chain.

`learn_masks`, `capture_grams`, `fold` and `gptq` each make one stage's output
from paths and their settings group; MASKS, GRAMS, FOLD and GPTQ declare them
for the runner; `compress_chain` runs them in order, and `compress` is the
command line's call of that chain.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from .. import store, tracking
from ..errors import CortiqError
from ..runner import Stage
from .settings import CompressSettings, FoldSettings, GptqSettings, GramSettings, MaskSettings


MASKS_FILE = "masks.safetensors"
GRAMS_FILE = "grams.safetensors"


def _meta(stage: Stage, settings, model, tdata, extra=None) -> dict:
    """A masks/grams directory's meta.json: its digest is the one the stage runner names it by."""
    from ..runner import digest_of

    d = digest_of(stage, model=model, tdata=tdata, settings=settings)
    m = {"stage": stage.name, "version": stage.version, "digest": d, "settings": dataclasses.asdict(settings),
         "inputs": [str(model), str(tdata)]}
    m.update(extra or {})
    return m


def _bar(total, desc, unit):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


def _resources(device: str, compute_dtype: str):
    """(torch.device, autocast dtype) of a stage's `device` / `compute_dtype` names."""
    from ..devices import resolve_compute, resolve_device
    from ..settings_meta import check_value
    from .settings import CompressSettings

    check_value(CompressSettings.__dataclass_fields__["compute_dtype"], compute_dtype, "compress: compute_dtype")
    dev = resolve_device(device, "compress")
    return dev, resolve_compute(compute_dtype, dev)


def _open_data(source_cmf, tdata_dir):
    from ..data import Tdata

    td = Tdata.open(tdata_dir)
    td.check_tokenizer(source_cmf)
    return td


# ── masks ─────────────────────────────────────────────────────────────────


def learn_masks(source_cmf, tdata_dir, settings: MaskSettings, out_dir, logger: tracking.Logger = tracking.NULL,
                device: str = "auto", compute_dtype: str = "auto") -> dict:
    """DTG-MA gate logits for every MLP neuron of `source_cmf`, trained on the
    tdata's train split with the LM loss, scored on its val split, on `device`
    ("auto": CUDA when present) under `compute_dtype` autocast ("auto": bf16
    on CUDA). Writes `masks.safetensors` (`layer.{i}`: logits [I_i]) in the
    stage dir `out_dir`."""
    import torch
    from safetensors.torch import save_file

    from ..data import windows
    from ..model import load_model
    from .masks import learn_model_masks
    from .memory import mask_plan

    s = settings
    td = _open_data(source_cmf, tdata_dir)
    train = windows(td, "train", s.window, loss_on=s.loss_on)
    val = windows(td, "val", s.window, loss_on=s.loss_on)
    dev, cdt = _resources(device, compute_dtype)
    model = load_model(source_cmf, device=dev)
    plan = mask_plan(model, s.batch, s.window, s.objective, cdt, s.device_mem_gb)
    t0 = time.time()
    bar = _bar(s.max_steps, "DTG-MA masks", "step")

    def progress(step, row):
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}", l1=f"{row['l1']:.2f}", refresh=False)

    def on_eval(row):
        # the history row's own names: the same metric live and replayed from a reused output
        logger.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    try:
        # CUDA graphs on the GPU: the step is launch-bound at these sizes, and replayed it is several times
        # faster with the same masks (bench/RESULTS.md, "The DTG-MA mask step, eager against CUDA graphs")
        r = learn_model_masks(model, train, val, s, on_eval, progress, compute=cdt, graph=dev.type == "cuda", plan=plan)
    finally:
        bar.close()
    rep = r.report()
    rep["metrics"]["mask_sec_per_step"] = (time.time() - t0) / max(r.steps, 1)
    rep["windows"] = {"train": len(train), "val": len(val)}
    rep["device"], rep["compute_dtype"], rep["memory"] = str(dev), str(cdt).removeprefix("torch."), str(plan)
    with store.stage_dir(out_dir, _meta(MASKS, s, source_cmf, tdata_dir, {"report": rep})) as d:
        save_file({f"layer.{i}": t.detach().float().cpu().contiguous() for i, t in enumerate(r.logits)}, str(d / MASKS_FILE))
    logger.log_metrics({k: v for k, v in rep["metrics"].items()})
    return rep


def read_masks(masks_dir) -> tuple[list, dict]:
    """(per-layer logits, the masks stage's report) of a finished masks stage."""
    from safetensors.torch import load_file

    meta = store.read_meta(masks_dir)
    t = load_file(str(Path(masks_dir) / MASKS_FILE))
    return [t[f"layer.{i}"] for i in range(len(t))], meta.get("report", {})


# ── grams ─────────────────────────────────────────────────────────────────


def calibration_windows(model_cmf, tdata_dir, window: int, max_windows: int = 0):
    """The windows every Gram capture runs over: the leading `max_windows` (0:
    all) train windows of `window` tokens of the tdata (its tokenizer checked
    against `model_cmf`'s), every token, with the rows to count: (ids int64
    [N, T], rows bool [N, T]). One function, so what the calibration sees
    (the heal's data, and whatever is mixed into it) is decided in one place."""
    import torch

    from ..data import windows

    td = _open_data(model_cmf, tdata_dir)
    w = windows(td, "train", window, loss_on="all")
    n = len(w) if not max_windows else min(len(w), max_windows)
    if n == 0:
        raise CortiqError(f"{tdata_dir}: no train windows of {window} tokens for the Gram capture")
    ids = torch.from_numpy(w.ids[:n])
    # real tokens: a row is padding when it is the pad id past the stream's end (weight 0 and pad)
    rows = torch.from_numpy((w.weight[:n] > 0) | (w.ids[:n] != w.pad_id))
    return ids, rows


def capture_grams(source_cmf, tdata_dir, layers, settings: GramSettings, out_dir,
                  logger: tracking.Logger = tracking.NULL, device: str = "auto", compute_dtype: str = "auto") -> dict:
    """Grams of the MLP activations (down_proj inputs) of `layers` (None: all)
    over the train windows, on `device` (accumulators f64 there, the forward
    under `compute_dtype` autocast). Writes `grams.safetensors` (`gram.{i}`
    f64 [I, I])."""
    from safetensors.torch import save_file

    from ..model import load_model
    from .grams import capture_model_grams, room_bytes

    s = settings
    ids, rows = calibration_windows(source_cmf, tdata_dir, s.window, s.max_windows)
    dev, cdt = _resources(device, compute_dtype)
    model = load_model(source_cmf, device=dev)
    layers = list(range(len(model.layers))) if layers is None else sorted(int(l) for l in layers)
    bar = _bar(int(rows.sum()) * 1, "Gram capture", "tok")
    t0 = time.time()
    try:
        grams, count, passes = capture_model_grams(model, ids, rows, layers, room_bytes(s.room_mb, dev), s.batch,
                                                   lambda k: bar.update(k), compute=cdt)
    finally:
        bar.close()
    rep = {"metrics": {"gram_rows": float(count), "gram_passes": float(passes), "gram_sec": time.time() - t0},
           "layers": layers, "count": count, "device": str(dev), "compute_dtype": str(cdt).removeprefix("torch.")}
    with store.stage_dir(out_dir, _meta(GRAMS, s, source_cmf, tdata_dir, {"report": rep, "layers": layers})) as d:
        save_file({f"gram.{l}": g.contiguous() for l, g in grams.items()}, str(d / GRAMS_FILE))
    logger.log_metrics(rep["metrics"])
    return rep


def read_grams(grams_dir) -> tuple[dict, int]:
    """({layer: G f64 [I, I]}, rows counted) of a finished grams stage."""
    from safetensors.torch import load_file

    meta = store.read_meta(grams_dir)
    t = load_file(str(Path(grams_dir) / GRAMS_FILE))
    return {int(k.split(".")[1]): v for k, v in t.items()}, int(meta["report"]["count"])


# ── fold ──────────────────────────────────────────────────────────────────


def fold(source_cmf, masks_dir, grams_dir, settings: FoldSettings, out_cmf, logger: tracking.Logger = tracking.NULL,
         device: str = "auto") -> dict:
    """Keep the top `keep_frac` MLP neurons (by mask logit from `masks_dir`,
    else by activation score from `grams_dir`), optionally repair down_proj
    from the Grams (the least squares in f64 on `device`); write the student
    CMF `out_cmf`."""
    import torch

    from ..cmf import open_cmf
    from .folding import activation_scores, fold_cmf, mlp_names, repair_down, select_kept

    s = settings
    src = open_cmf(source_cmf)
    widths = src.arch.intermediate_sizes
    grams, count = read_grams(grams_dir) if grams_dir else ({}, 0)
    mask_rep = None
    if masks_dir:
        scores, mask_rep = read_masks(masks_dir)
        if [len(x) for x in scores] != list(widths):
            raise CortiqError(f"{masks_dir}: mask widths {[len(x) for x in scores]} do not match {source_cmf} {widths}")
        ranked_by = "mask"
    else:
        missing = [i for i in range(len(widths)) if i not in grams]
        if missing:
            raise CortiqError(f"fold: no mask and no Grams for layers {missing[:4]}: give --masks or Grams of every layer")
        scores = [activation_scores(grams[i], count, src.tensor(mlp_names(i)[2])) for i in range(len(widths))]
        ranked_by = "activation"
    scope = s.scope if s.scope != "auto" else ("global" if ranked_by == "mask" else "per_layer")  # FoldSettings.scope
    kept = select_kept(scores, s.keep_frac, scope, s.floor, s.multiple_of)
    down = {}
    if s.repair:
        missing = [i for i in range(len(widths)) if i not in grams]
        if missing:
            raise CortiqError(f"fold --repair: no Grams for layers {missing[:4]}")
        dev = _resources(device, "auto")[0]
        for i, k in enumerate(kept):
            down[i] = repair_down(src.tensor(mlp_names(i)[2]), grams[i].to(dev), k, s.damp).cpu()
    # the activation energy the fold drops (Gram diagonal), where Grams exist
    dropped = {}
    for i, k in enumerate(kept):
        if i in grams:
            d = torch.diagonal(grams[i])
            dropped[i] = float(1.0 - d[k].sum() / d.sum().clamp_min(1e-30))
    n_src, n_kept = sum(widths), sum(len(k) for k in kept)
    block = {"settings": dataclasses.asdict(s), "ranked_by": ranked_by, "scope": scope, "source_neurons": n_src, "kept_neurons": n_kept,
             "repaired": bool(s.repair)}
    if mask_rep:
        block["mask"] = {"steps": mask_rep["metrics"]["mask_steps"], "step": mask_rep["metrics"]["mask_step"],
                         "pruned": mask_rep["metrics"]["mask_pruned"], "nll_open": mask_rep["metrics"]["mask_nll_open"],
                         "nll_hard": mask_rep["metrics"]["mask_nll_hard"], "reached_target": mask_rep.get("reached_target")}
    fold_cmf(src, kept, out_cmf, down, block)
    rep = {"metrics": {"fold_kept_share": n_kept / n_src, "fold_kept_neurons": float(n_kept)},
           "widths": [len(k) for k in kept], "ranked_by": ranked_by, "scope": scope}
    if dropped:
        rep["metrics"]["fold_dropped_energy"] = sum(dropped.values()) / len(dropped)
    if s.repair:
        # the least squares overfits when the Gram saw fewer rows than there are neurons (SmolLM2, 1k rows: worse than no repair)
        rep["metrics"]["repair_rows_per_neuron"] = count / max(widths)
    logger.log_metrics(rep["metrics"])
    return rep


# ── gptq ──────────────────────────────────────────────────────────────────


def _gptq_layers(src, grams: dict, grams_dir, student_cmf) -> dict:
    """layer -> (down_proj name, W [H, I_i], G [I_i, I_i]) on the CPU, each Gram cut to the neurons
    the fold kept where the Grams were taken before the fold."""
    from .folding import kept_from_b64, mlp_names

    widths = src.arch.intermediate_sizes
    fold_prov = src.provenance.get("fold", {})
    todo = {}
    for i, G in sorted(grams.items()):
        if i >= len(widths):
            raise CortiqError(f"{grams_dir}: Gram of layer {i}, but {student_cmf} has {len(widths)} layers")
        name = mlp_names(i)[2]
        W = src.tensor(name)  # [H, I_i]
        if G.shape[0] != W.shape[1]:
            src_w = fold_prov.get("source_widths")
            if not fold_prov.get("kept") or not src_w or src_w[i] != G.shape[0]:
                raise CortiqError(f"{grams_dir}: layer {i} Gram is {G.shape[0]} wide, {student_cmf} has {W.shape[1]} "
                                  "neurons and no fold record maps them")
            k = kept_from_b64(fold_prov["kept"][i], src_w[i])
            G = G[k][:, k]
        todo[i] = (name, W, G)
    return todo


def _gptq_solve(todo: dict, s: GptqSettings, dev) -> tuple[dict, dict]:
    """GPTQ of every layer of `todo`, and round-to-nearest beside it for the report: ({name: (shape,
    stored getter)}, {layer: its row of errors under the Gram})."""
    import torch

    from .. import codecs
    from ..cmf import Stored
    from .gptq_solver import gptq_quantize_layers
    from .grams import room_bytes

    codec = codecs.get(s.codec)
    # layers of one shape (all of them after a per-layer fold) share one column
    # loop, in stacks sized to the memory room (U, H and their temporaries, f64)
    shapes: dict = {}
    for i, (_, W, _) in todo.items():
        shapes.setdefault(tuple(W.shape), []).append(i)
    room = room_bytes(0, dev)
    replace, rows = {}, {}
    bar = _bar(len(todo), "GPTQ", "layer")
    try:
        for (R, C), layers in shapes.items():
            per = 8 * (4 * C * C + 4 * R * C)
            for a in range(0, len(layers), max(1, room // per)):
                part = layers[a : a + max(1, room // per)]
                Ws = torch.stack([todo[i][1] for i in part]).to(dev)  # [n, H, I]
                Gs = torch.stack([todo[i][2] for i in part]).to(dev)  # [n, I, I] f64
                results = gptq_quantize_layers(Ws, Gs, s.codec, s.block, s.damp, s.act_order, clip_grid=s.clip_grid)
                rtn = torch.stack([codec.decode(codec.encode(todo[i][1]), (R, C)) for i in part]).to(dev)

                def err(Wq):
                    # ‖(W − Ŵ) X‖ under the Gram, per layer: √ Σ_oij D_oi G_ij D_oj
                    D = (Ws - Wq).double()  # [n, H, I]
                    return torch.einsum("noi,nij,noj->n", D, Gs, D).clamp_min(0).sqrt().tolist()

                e_gptq, e_rtn = err(torch.stack([r.weight for r in results])), err(rtn)
                for j, (i, r) in enumerate(zip(part, results)):
                    rows[i] = {"layer": i, "method": r.method, "err_gptq": e_gptq[j], "err_rtn": e_rtn[j]}
                    replace[todo[i][0]] = ((R, C), lambda st=r.stored: Stored(st))
                bar.update(len(part))
                del Ws, Gs, results, rtn
    finally:
        bar.close()
    return replace, rows


def gptq(student_cmf, grams_dir, settings: GptqSettings, out_cmf, logger: tracking.Logger = tracking.NULL,
         device: str = "auto") -> dict:
    """Quantize `student_cmf` into `settings.codec`: every MLP down_proj by
    GPTQ from the Grams (restricted to the neurons the fold kept), on
    `device`, the other linear weights of the layers by round-to-nearest;
    embeddings, head and norms keep their codec. Per layer, the output error
    ‖(W − Ŵ) X‖ under the Gram is reported for GPTQ and for RTN."""
    from .. import codecs
    from ..cmf import copy_specs, open_cmf, with_provenance, write_cmf

    s = settings
    dev = _resources(device, "auto")[0]
    src = open_cmf(student_cmf)
    grams, count = read_grams(grams_dir)
    codec = codecs.get(s.codec)
    replace, rows = _gptq_solve(_gptq_layers(src, grams, grams_dir, student_cmf), s, dev)
    rows = [rows[i] for i in sorted(rows)]

    def codec_for(n, info):
        if n in replace:
            return s.codec
        if n.startswith("model.layers.") and n.endswith("_proj.weight") and len(info.shape) == 2 \
                and info.shape[1] % codec.block == 0:
            return s.codec
        return info.codec

    doc = with_provenance(src.doc, "gptq", {"settings": dataclasses.asdict(s), "layers": rows, "gram_rows": count})
    for k in ("codecs", "hashes", "shards"):
        doc.pop(k, None)
    write_cmf(Path(out_cmf), doc, copy_specs(src, codec_for, replace))
    g = [r["err_gptq"] for r in rows]
    t = [r["err_rtn"] for r in rows]
    rep = {"metrics": {"gptq_err": sum(g), "rtn_err": sum(t), "gptq_over_rtn": sum(g) / max(sum(t), 1e-30)}, "layers": rows}
    logger.log_metrics(rep["metrics"])
    return rep


# ── the stages, declared once (cortiq.runner runs them for the CLI and the flows) ──

def _masks(out, ctx, model, tdata, settings):
    return learn_masks(Path(model), Path(tdata), settings, out, ctx.logger, settings.device, settings.compute_dtype)


def _grams(out, ctx, model, tdata, settings):
    return capture_grams(Path(model), Path(tdata), None, settings, out, ctx.logger, settings.device,
                         settings.compute_dtype)


def _fold(out, ctx, model, masks, grams, settings):
    return fold(Path(model), masks and Path(masks), grams and Path(grams), settings, out, ctx.logger, settings.device)


def _gptq(out, ctx, model, grams, settings):
    return gptq(Path(model), Path(grams), settings, out, ctx.logger, settings.device)


MASKS = Stage("masks", 1, _masks, MaskSettings, ("model", "tdata"),
              doc="DTG-MA: gate logits of every MLP neuron learned under a rising L1 pull")
GRAMS = Stage("grams", 1, _grams, GramSettings, ("model", "tdata"),
              doc="Grams of every MLP's down_proj input over the train windows (repair, activation ranking, GPTQ)")
FOLD = Stage("fold", 1, _fold, FoldSettings, ("model", "masks", "grams"), output="cmf",
             doc="the student: the MLPs sliced to the kept neurons (down_proj repaired when asked)")
GPTQ = Stage("gptq", 1, _gptq, GptqSettings, ("model", "grams"), output="cmf",
             doc="the student quantized into the q4/q8 codecs by GPTQ from the same Grams")


# ── the chain ─────────────────────────────────────────────────────────────


def compress_chain(runner, source, tdata, settings, say=lambda m: None) -> str:
    """masks → grams (when the fold repairs, ranks without masks, or GPTQ needs them) → fold →
    gptq (`settings`: CompressSettings), on `tdata` (retain text mixed in already): the student."""
    s = settings
    masks = grams = None
    if s.learn_masks:
        r = runner.run(MASKS, model=source, tdata=tdata, settings=s.masks)
        masks, m = r["path"], r["report"]["metrics"]
        say(f"masks: {m['mask_pruned'] * 100:.1f} % pruned at step {m['mask_step']:.0f} of {m['mask_steps']:.0f}; "
            f"val {'KL to the source' if s.masks.objective == 'teacher' else 'NLL'} open {m['mask_nll_open']:.4f}, "
            f"hard {m['mask_nll_hard']:.4f}")
    if s.needs_grams:
        grams = runner.run(GRAMS, model=source, tdata=tdata, settings=s.grams)["path"]
    r = runner.run(FOLD, model=source, masks=masks, grams=grams, settings=s.fold)
    student = r["path"]
    say(f"fold: kept {r['report']['metrics']['fold_kept_share'] * 100:.1f} % of the MLP neurons"
        f"{' (repaired)' if s.fold.repair else ''}")
    if s.use_gptq:
        r = runner.run(GPTQ, model=student, grams=grams, settings=s.gptq)
        student = r["path"]
        say(f"gptq: {s.gptq.codec}, output error {r['report']['metrics']['gptq_over_rtn']:.3f}× round-to-nearest's")
    return student


def compress(source_cmf, tdata_dir, settings: CompressSettings, out_cmf, logger: tracking.Logger = tracking.NULL,
             work=None, log=None, retain=None) -> dict:
    """`compress_chain` (masks → grams → fold → gptq) through
    the stage runner, each stage reused when its output under `work` (default: the cortiq
    home's work/, where the flows keep theirs too) is complete; the student is then put at
    `out_cmf`. `retain` (cortiq.data.settings.RetainSettings) mixes retain text into the data
    the masks and Grams see. Returns every stage's report."""
    from ..data.stages import with_retain
    from ..runner import LocalRunner, deliver

    s = settings
    _resources(s.device, s.compute_dtype)  # a bad device fails here, before any stage runs
    say = log or (lambda m: print(m, file=sys.stderr))
    runner = LocalRunner(store.work_root(work), logger, say=say)
    if retain is not None and retain.sources:
        tdata_dir, panel = with_retain(tdata_dir, source_cmf, retain, runner.run, None, logger)
        if panel:  # every source may have been left out (other_sources says which, and why)
            say(f"retain: {', '.join(panel)} mixed in at {retain.share:.0%} -> {tdata_dir}")
    student = compress_chain(runner, source_cmf, tdata_dir, s, say)
    deliver({"path": student}, out_cmf)
    say(f"student -> {out_cmf}")
    mine = {st.name for st in (MASKS, GRAMS, FOLD, GPTQ)}
    stages = {r["stage"]: r["report"] for r in runner.results.values() if r["stage"] in mine}
    return {"stages": stages, "metrics": {k: v for st in stages.values() for k, v in st.get("metrics", {}).items()}}
