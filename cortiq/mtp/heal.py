"""MTP heal: retrain the draft head on the compressed trunk's own predictions.

What the trunk and mtp stages (cortiq.mtp.stages) and the commands call:

- `trunk_pass(model_cmf, data_spec, settings, cache_dir)`: the trunk's hidden rows and top-k per window, cached;
- `mtp_heal(model_cmf, data_spec, settings, out_cmf, logger)`: hold rates and drafts per round before,
  training, after; the trained draft written into `model.mtp.*` (and in every `also` codec, each re-measured);
- `recode_draft(out_cmf, codec, path, data_spec, settings)`: the draft in another codec, re-measured;
- `mtp_init(model_cmf, out_cmf)`: a fresh MTP block for a model without one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from .. import dist, tracking
from ..errors import CortiqError
from ..settings_meta import what
from .settings import PRESETS, MtpSettings

#: the key of the draft's block in a model's provenance
STAGE = "mtp_heal"


def settings_key(s: MtpSettings) -> dict:
    """The settings that change the mtp stage's output (its digest's settings part: the same rule
    as cortiq.runner.key_of, the stage taking no layout), as its report and provenance record them."""
    return what(s, "mtp")


def mtp_init(model_cmf, out_cmf) -> dict:
    """A fresh MTP block for a model without one (cortiq.mtp.init)."""
    from .init import mtp_init as _init

    return _init(model_cmf, out_cmf)


def _say(msg: str) -> None:
    if dist.is_main():  # across ranks, rank 0 speaks for all
        print(msg, file=sys.stderr, flush=True)


def _open(model_cmf):
    from ..cmf import open_cmf
    from .init import has_draft

    f = open_cmf(model_cmf)
    if not has_draft(f):
        raise CortiqError(f"{f.path}: carries no MTP draft (model.mtp.*): give it one with "
                          f"`cortiq mtp init {f.path} --out OUT.cmf`")
    return f


def resolve(f, s: MtpSettings, say=None) -> MtpSettings:
    """`s` with its preset chosen (auto: "fresh" for a draft fresh from `mtp init`, by `f`'s
    provenance; else "retrain") and that preset's values in every field left unset."""
    from .init import draft_is_fresh

    preset = s.preset
    if preset == "auto":
        preset = "fresh" if draft_is_fresh(f) else "retrain"
    out = s.resolved(preset)
    if say is not None:
        why = "" if s.preset != "auto" else (" (the draft is fresh from mtp init)" if preset == "fresh" else "")
        given = [k for k in PRESETS[preset] if getattr(s, k) is not None]
        if out.generate:
            n = min(out.gen_windows, max(1, out.tokens // out.window))  # (a set's PATH@TOKENS may bound it further)
            text = "the model's own continuations" + (f" of {n} prompts" if out.gen_windows else "")
        elif out.gen_share > 0:
            text = f"the data's text and the model's own continuations of {out.gen_share:g} of its prompts"
        else:
            text = "the data's text"
        say(f"mtp heal: preset {preset}{why}: lr {out.lr:g}, warm-up {out.warm:g}, {out.epochs:g} epochs, "
            f"window {out.window}, batch {out.batch}, input side {'trained' if out.train_input else 'kept'}, on {text}"
            + (f" (given: {', '.join(given)})" if given else ""))
    return out


def _load(f, s: MtpSettings):
    from ..model import load_model
    from ..devices import rank_device

    return load_model(f, device=rank_device(s.device, "mtp settings"))


def _windows(f, data_spec: str, s: MtpSettings) -> list:
    import numpy as np

    from ..data.windowing import packed_windows

    packed = packed_windows(data_spec, s.window, s.tokens, min_len=16 + s.chain, pad_id=f.eos_id, hold_all=s.hold_all)
    for p in packed:
        if len(p) and int(np.max(p.ids)) >= f.arch.vocab_size:
            raise CortiqError(f"{data_spec}: data set {p.name} has id {int(np.max(p.ids))}, outside {f.path}'s vocabulary")
    n = sum(len(p) for p in packed)
    need = 1 if s.hold_all else 10 * s.batch
    if n < need:
        raise CortiqError(f"mtp heal: {n} windows of {s.window} tokens in {data_spec}, need {need} "
                          f"(every tenth is held out; lower --window or --batch, or give more data)")
    return packed


def _sets(model, f, data_spec: str, s: MtpSettings, cache=None) -> tuple[list, list[dict]]:
    """The packed windows training reads: the data's (with the model's continuations of an even
    `gen_share` of its windows' prompts beside them), or (generate) the model's continuations
    of them all."""
    from .selfgen import chat_rows, generated_sets

    from ..store import parse_data_spec

    packed = _windows(f, data_spec, s)
    if not s.generate and s.gen_share <= 0:
        return packed, []
    # the windows generated from a data set are bounded by its tokens, as its own windows are
    most = {p.name: max(1, (cap or s.tokens) // s.window) for p, (_, cap) in zip(packed, parse_data_spec(data_spec))}
    src = packed
    if not s.generate:
        src = []
        for p in packed:
            pick = chat_rows(len(p), s.gen_share)
            if pick.any():
                src.append(replace(p, ids=p.ids[pick], lengths=p.lengths[pick], held=p.held[pick]))
    root = s.gen_cache or cache or s.trunk_cache
    # across ranks rank 0 generates (and keeps) the windows first; the others read them back
    if not dist.is_main():
        dist.barrier()
    gen, info = generated_sets(model, f, src, s, root, _say, most)
    if dist.active() and dist.is_main():
        dist.barrier()
    return (gen if s.generate else packed + gen), info


def _chain(model, f, data_spec: str, s: MtpSettings, cache=None):
    from .draft import Chain
    from .trunk import trunk_sets

    packed, gen = _sets(model, f, data_spec, s, cache)
    for i in gen:
        if i["read_back"]:
            _say(f"mtp heal: {i['set']}: {i['windows']} generated windows read back from {i['cache']}")
    sets, info = trunk_sets(model, f, packed, s.window, s.topk, cache if cache is not None else s.trunk_cache,
                            s.trunk_batch, s.head_chunk)
    for i in info:
        src = f"read back from {i['cache']}" if i["read_back"] else "trunk pass"
        _say(f"mtp heal: {i['set']}: {i['windows']} windows ({src})")
    start, chat = _prompt_ends(packed, s)
    return Chain(model, sets, s.chain, s.stride, f.eos_id, s.hold_all, s.batch, s.head_chunk, start, chat,
                 s.span or None), info


def _prompt_ends(packed: list, s: MtpSettings):
    """Per window, the row of its prompt's last token (where a decode's first round starts) and
    whether it answers a chat request: a generated set knows both; a data set's text is
    read as a prompt of its first `gen_prompt` tokens and its continuation."""
    import numpy as np
    import torch

    start, chat = [], []
    for p in packed:
        n = len(p)
        P = getattr(p, "prompt_lens", None)
        start.append(np.full(n, (s.gen_prompt or 1) - 1, dtype=np.int64) if P is None else np.asarray(P, dtype=np.int64) - 1)
        c = getattr(p, "chat", None)
        chat.append(np.zeros(n, dtype=bool) if c is None else np.asarray(c, dtype=bool))
    return torch.from_numpy(np.concatenate(start)), torch.from_numpy(np.concatenate(chat))


def trunk_pass(model_cmf, data_spec: str, settings: MtpSettings, cache_dir) -> dict:
    """The trunk pass per data set into `cache_dir` (read back when its key matches)."""
    from ..cmf import open_cmf
    from .trunk import trunk_sets

    f = open_cmf(model_cmf)
    settings = resolve(f, settings)
    model = _load(f, settings)
    packed, gen = _sets(model, f, data_spec, settings, cache_dir)
    _, info = trunk_sets(model, f, packed, settings.window, settings.topk, cache_dir, settings.trunk_batch, settings.head_chunk)
    return {"sets": info, "generated": gen, "preset": settings.preset,
            "metrics": {"windows": float(sum(i["windows"] for i in info))}}


def _fmt(r) -> str:
    return " / ".join(f"{x:.3f}" for x in r)


def _measure(ch, tag: str, say=_say) -> dict:
    """Hold rates per step and drafts per round on the held-out windows. The headline
    (`hold`, `drafts_per_round`) walks the rounds a greedy decode runs from each window's
    prompt end over `span` new tokens: what speculative decoding accepts on that text.
    Beside it: the same per prompt kind (`data` continuations, `chat` answers), per data
    set, `every_row` (a chain from every row of the whole window: the figure before the
    walk, which counts a long continuation's easy repetitive tail and rounds that a decode
    never starts) and, for stride > 0, the layout's `ordered` walk."""
    from . import measures as M

    if ch.stride > 0:
        c = ch.hold()
        m = {"walk": c}
    else:
        m = ch.measure()
        c = m["walk"]
    r = M.rates(c)
    span = f"{ch.span} new tokens" if ch.span else "the window"
    out = {"hold": r, "counted": c[:, 0].tolist(), "drafts_per_round": M.drafts_per_round(c)}
    say(f"mtp heal: {tag}: hold per chain step {_fmt(r)} (of {' / '.join(str(int(x)) for x in c[:, 0])} rows), "
        f"{out['drafts_per_round']:.3f} drafts a round" + ("" if ch.stride > 0 else f" (decode rounds over {span})"))
    for kind in ("data", "chat", "every_row"):
        if kind in m and int(m[kind][0, 0]) > 0:
            v = m[kind]
            out[kind] = {"hold": M.rates(v), "drafts_per_round": M.drafts_per_round(v), "counted": v[:, 0].tolist()}
            what = {"data": "data continuations", "chat": "chat answers", "every_row": "a chain from every row"}[kind]
            say(f"    {what}: {_fmt(out[kind]['hold'])}, {out[kind]['drafts_per_round']:.3f} drafts a round")
    if len(ch.names) > 1:
        per = ch.per_set(ch.hold)
        out["per_set"] = {n: {"hold": M.rates(v), "drafts_per_round": M.drafts_per_round(v)} for n, v in per.items()}
        for n, v in out["per_set"].items():
            say(f"    {n}: {_fmt(v['hold'])}, {v['drafts_per_round']:.3f} drafts a round")
    if ch.stride > ch.chain:
        o = ch.order_counts(ch.held.nonzero().flatten())
        out["ordered"] = {"hold": M.rates(o), "drafts_per_round": M.drafts_per_round(o)}
        say(f"    rounds in order: {_fmt(out['ordered']['hold'])}, {out['ordered']['drafts_per_round']:.3f} drafts a round")
    return out


def _report(m: dict) -> dict:
    """Counts per kind -> {kind: {"hold", "drafts_per_round", "counted"}} (kinds that counted a round)."""
    from . import measures as M

    return {k: {"hold": M.rates(v), "drafts_per_round": M.drafts_per_round(v), "counted": v[:, 0].tolist()}
            for k, v in m.items() if int(v[0, 0]) > 0}


def measure_text(model, seqs, prompt_lens, chain: int = 3, span: int | None = None, chat=None, pad: int = 0,
                 batch: int = 4, chunk: int = 1024, branches: int | tuple[int, ...] = 1, vocab=None) -> dict:
    """mtp heal's measure on any token sequences: each a prompt of prompt_lens[i] tokens and
    the text after it (the model's greedy continuation: then "walk" is exactly what greedy
    speculative decoding at depth `chain` accepts a round over `span` new tokens, drafts past
    the sequence's end not counted; with `branches` N > 1, what rounds of a draft tree of N
    first guesses, each chained, accept (`--draft-branches N`); with a tuple (w_1, w_2, ...), a
    tree whose every node at step j has the draft's top w_j as its children, which no engine
    runs yet: what such a tree would keep); `vocab` (token ids [N]): the draft picking among those
    alone (the engine's `draft_vocab`). `chat` [n] bool marks chat answers. One trunk pass and
    one draft pass (cortiq.mtp.draft.Chain, the code mtp heal measures with). -> {kind:
    {"hold", "drafts_per_round", "counted"}} for kinds "walk", "data", "chat", "every_row"."""
    import torch

    from .draft import Chain
    from .trunk import TrunkSet, run_trunk

    if len(seqs) == 0 or len(seqs) != len(prompt_lens) or any(len(x) == 0 for x in seqs):
        raise CortiqError(f"measure_text: {len(seqs)} sequences and {len(prompt_lens)} prompt lengths (none empty)")
    n, T = len(seqs), max(len(x) for x in seqs)
    ids = torch.full((n, T), pad, dtype=torch.int64)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
    lens = torch.tensor([len(x) for x in seqs], dtype=torch.int64)
    ti, tp, h = run_trunk(model, ids, 1, batch, chunk)
    ch = Chain(model, [TrunkSet.held("text", ids, lens, ti, tp, h)], chain, 0, pad, hold_all=True, batch=batch, chunk=chunk,
               start=torch.as_tensor(list(prompt_lens), dtype=torch.int64) - 1, chat=chat, span=span,
               branches=branches, vocab=None if vocab is None else torch.as_tensor(vocab, dtype=torch.int64))
    return _report(ch.measure())


def heldout_windows(model, f, data_spec: str | None = None, settings: MtpSettings | None = None, cache=None) -> dict:
    """The held-out windows `mtp heal` measured the draft of `f` on (data spec and settings
    from its provenance unless given; generated windows read back from `cache`, else
    made again): {"ids" [n, T], "lens" [n], "chat" [n] bool, "start" [n] (prompt's last row),
    "span", "chain", "data", "settings"}."""
    prov = (f.provenance or {}).get(STAGE) or {}
    spec = data_spec or prov.get("data")
    if not spec:
        raise CortiqError(f"{f.path}: no mtp heal in its provenance: give the data spec the draft was measured on")
    if settings is None:
        keep = {k: v for k, v in (prov.get("settings") or {}).items() if k in MtpSettings.__dataclass_fields__}
        settings = MtpSettings(**{**keep, "epochs": 0, "hold_all": False})
    s = settings.resolved(settings.preset if settings.preset in PRESETS else "fresh")
    if cache is not None:
        s = replace(s, gen_cache=str(cache))
    packed, _ = _sets(model, f, spec, s)
    import numpy as np
    import torch

    start, chat = _prompt_ends(packed, s)
    ids = np.concatenate([np.asarray(p.ids) for p in packed])
    lens = np.concatenate([np.asarray(p.lengths) for p in packed])
    held = np.arange(len(ids)) % 10 == 9
    return {"ids": torch.as_tensor(ids[held], dtype=torch.int64), "lens": torch.as_tensor(lens[held], dtype=torch.int64),
            "chat": chat[torch.from_numpy(held)], "start": start[torch.from_numpy(held)], "span": s.span or None,
            "chain": s.chain, "data": spec, "settings": s}


def draft_ranking(ch, vocab: int, data_spec: str) -> dict:
    """The document's `draft_vocab` entry (cortiq.mtp.vocab) from the chain's training windows (all
    of them where every window is held out)."""
    import torch

    from . import vocab as V

    train = ~ch.held if bool((~ch.held).any()) else torch.ones_like(ch.held)
    ranked = V.ranking(ch.t1[train].numpy(), ch.ids[train].numpy(), ch.lens[train].numpy(), vocab)
    return V.entry(ranked, f"the trunk's greedy tokens on {int(train.sum())} windows of {data_spec}")


def _draft_tensors(model) -> dict:
    return {f"model.mtp.{n}": p.detach().float().cpu() for n, p in model.mtp.named_parameters()}


def write_draft(f, tensors: dict, codec: str, path, stage_block: dict | None = None, sensitive=None,
                sensitive_codec: str = "q8", ranking: dict | None = None):
    """`f`'s tensors as stored, with model.mtp.* replaced by `tensors` in `codec`, and the draft's
    token `ranking` (`draft_ranking`) in its document where given
    ("keep": each draft tensor's codec in `f`; a quantized codec only for 2-D weights;
    below 8 bits a weight named in `sensitive` goes to `sensitive_codec`; None: the
    whole-model rule's names, cortiq.codecs.KEEP_8BIT, which hold the draft's eh_proj).

    eh_proj at q8 makes no difference beyond noise to a trained draft, whose eh_proj has moved
    far from its initial [0 | I] (bench/MTP.md, "the 6-epoch preset" and "Conclusions"); it is
    kept for drafts trained less."""
    from ..cmf import copy_specs, with_provenance, write_cmf
    from ..codecs import KEEP_8BIT, choose_codec

    keep = KEEP_8BIT if sensitive is None else tuple(sensitive)

    def codec_for(name, info):
        if not name.startswith("model.mtp."):
            return info.codec
        c = choose_codec(codec, info.shape, info.codec, name, keep)  # the whole-model rule
        return sensitive_codec if codec not in ("keep", "q8") and c == "q8" else c

    specs = copy_specs(f, codec_for, replace=tensors)
    doc = {k: v for k, v in f.doc.items() if k not in ("codecs", "hashes", "shards")}
    if stage_block is not None:
        doc = with_provenance(doc, STAGE, stage_block)
    if ranking is not None:
        from .vocab import KEY

        doc[KEY] = ranking
    return write_cmf(Path(path), doc, specs)


def _draft_bytes(path) -> int:
    from ..cmf import open_cmf

    g = open_cmf(path)
    return sum(i.nbytes for n, i in g.infos.items() if n.startswith("model.mtp."))


def _remeasure(ch, path, s: MtpSettings, codec: str) -> dict:
    """Re-open `path` as a model and measure its draft on the same windows."""
    from ..cmf import open_cmf

    m = _load(open_cmf(path), s)
    ch2 = copy.copy(ch)
    ch2.model = m
    r = _measure(ch2, f"{path} (draft as {codec})")
    r["bytes"] = _draft_bytes(path)
    r["path"] = str(path)
    return r


def write_dump(ch, f, d, model) -> None:
    """The seed's file set a draft built elsewhere reads (raw little-endian arrays; meta.json last)."""
    import numpy as np

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "meta.json").exists():
        return
    ch.lens.numpy().astype("<u4").tofile(d / "len.u32")
    ch.ids.numpy().astype("<u4").tofile(d / "ids.u32")
    for name, rows, typ in (("ti.u32", ch.ti, "<u4"), ("tp.f32", ch.tp, "<f4")):
        with open(d / name, "wb") as out:  # part by part from the maps, never the set whole
            for part in rows.parts:
                out.write(part.astype(typ).tobytes())
    f16 = lambda name, t: t.detach().float().cpu().numpy().astype("<f2").tofile(d / name)
    f32 = lambda name, t: t.detach().float().cpu().numpy().astype("<f4").tofile(d / name)
    f16("embed.f16", model.model.embed_tokens.weight)
    f16("eh_proj.f16", model.mtp.eh_proj.weight)
    f16("head.f16", model.head_weight)
    f32("enorm.f32", model.mtp.enorm.weight)
    f32("hnorm.f32", model.mtp.hnorm.weight)
    f32("mtp_norm.f32", model.mtp.norm.weight)
    f32("norm.f32", model.model.norm.weight)
    a = model.arch
    meta = {"windows": len(ch), "window": int(ch.ids.shape[1]), "topk": int(ch.ti.shape[-1]), "draft_topk": 4,
            "chain": ch.chain, "hidden": a.hidden_size, "vocab": a.vocab_size, "norm_eps": a.rms_norm_eps,
            "gemma_norm": a.norm_style == "offset", "heldout": "window index % 10 == 9" if not bool(ch.held.all()) else "all",
            "trunk": ch.names, "model": str(f.path)}
    from .. import store

    store.write_text(d / "meta.json", json.dumps(meta, indent=2))


def dump_chain(ch, d) -> None:
    """Every window's chain, step by step: x{j}.f16 output rows, d{j}.u32 / dp{j}.f32 its top-4 (meta.json last)."""
    import torch

    d = Path(d)
    part = d.with_name(d.name + ".partial")
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    files = {}
    try:
        def put(j, o, di, dp):
            if j not in files:
                files[j] = [open(part / f"x{j}.f16", "wb"), open(part / f"d{j}.u32", "wb"), open(part / f"dp{j}.f32", "wb")]
            fx, fd, fp = files[j]
            fx.write(o.to(torch.float16).cpu().numpy().astype("<f2").tobytes())
            fd.write(di.numpy().astype("<u4").tobytes())
            fp.write(dp.numpy().astype("<f4").tobytes())

        ch.chain_counts(torch.arange(len(ch)), dump=put)
    finally:
        for fs in files.values():
            for x in fs:
                x.close()
    (part / "meta.json").write_text(json.dumps({"windows": len(ch), "chain": ch.chain, "topk": 4}))
    if d.exists():
        shutil.rmtree(d)
    os.replace(part, d)


def mtp_heal(model_cmf, data_spec: str, settings: MtpSettings, out_cmf, logger: tracking.Logger = tracking.NULL) -> dict:
    """Train `model_cmf`'s draft on its own trunk; write it to `out_cmf` (and every `also` path).

    Under torchrun (cortiq.dist) every rank calls it: the trunk pass and
    training split across ranks, rank 0 measures and writes; the others return None."""
    from . import measures as M
    from .draft import train
    from .trunk import write_taps

    f = _open(model_cmf)
    s = resolve(f, settings, _say)
    model = _load(f, s)
    main = dist.is_main()
    if not main:
        logger = tracking.NULL
    logger.log_params(tracking.flatten({"mtp": settings_key(s)}))
    ch, info = _chain(model, f, data_spec, s)
    if not main:  # training is all a rank other than 0 takes part in
        if s.epochs > 0:
            from .draft import train

            train(ch, s, None, _say)
        return None
    if s.taps:
        write_taps(model, ch.ids, ch.lens, ch.t1, ch.held, Path(s.taps[0]), list(s.taps[1]))
    if s.dump:
        write_dump(ch, f, s.dump, model)
        dump_chain(ch, Path(s.dump) / "before")
    before = _measure(ch, "before training")
    logger.log_metrics({"drafts_per_round_before": before["drafts_per_round"],
                        **{f"hold_before_{j + 1}": r for j, r in enumerate(before["hold"])}})
    run = {"steps": 0, "best_step": 0, "history": [], "kl_start": float("nan"), "kl_best": float("nan")}
    if s.epochs > 0:
        run = train(ch, s, logger, _say)
    after = _measure(ch, "after training") if run["steps"] else before
    if s.dump and run["steps"]:
        dump_chain(ch, Path(s.dump) / "after")
    block = {"model": str(f.path), "data": data_spec, "preset": s.preset, "settings": settings_key(s), "windows": len(ch),
             "tokens": int(ch.lens.sum()), "steps": run["steps"], "best_step": run["best_step"],
             "hold_before": before["hold"], "hold_after": after["hold"],
             "drafts_per_round_before": before["drafts_per_round"], "drafts_per_round_after": after["drafts_per_round"],
             "measure": f"decode rounds over {s.span} new tokens from each prompt's end" if s.span else "decode rounds"}
    for kind in ("data", "chat", "every_row"):
        if kind in after:
            block[f"drafts_per_round_after_{kind}"] = after[kind]["drafts_per_round"]
    tensors = _draft_tensors(model)
    ranking = draft_ranking(ch, f.arch.vocab_size, data_spec)
    codecs = {}
    for codec, path in [(s.codec, out_cmf)] + list(s.also):
        write_draft(f, tensors, codec, path, block, ranking=ranking)
        codecs[codec if path != out_cmf else f"out:{codec}"] = _remeasure(ch, path, s, codec)
    metrics = {"drafts_per_round_before": before["drafts_per_round"], "drafts_per_round_after": after["drafts_per_round"],
               "steps": float(run["steps"]), "best_step": float(run["best_step"]), "skipped": float(run.get("skipped", 0)),
               "train_seconds": float(run.get("seconds", 0.0)),
               "heldout_kl_start": run["kl_start"], "heldout_kl_best": run["kl_best"]}
    for j, (a, b) in enumerate(zip(before["hold"], after["hold"])):
        metrics[f"hold_before_{j + 1}"], metrics[f"hold_after_{j + 1}"] = a, b
    for kind in ("data", "chat", "every_row"):
        if kind in after:
            metrics[f"drafts_per_round_after_{kind}"] = after[kind]["drafts_per_round"]
    for name, r in codecs.items():
        tag = name.replace(":", "_")
        metrics[f"{tag}.drafts_per_round"] = r["drafts_per_round"]
        for kind in ("data", "chat", "every_row"):
            if kind in r:
                metrics[f"{tag}.drafts_per_round_{kind}"] = r[kind]["drafts_per_round"]
        metrics[f"{tag}.draft_bytes"] = float(r["bytes"])
        for j, x in enumerate(r["hold"]):
            metrics[f"{tag}.hold_{j + 1}"] = x
    logger.log_metrics({k: v for k, v in metrics.items() if v == v})
    return {"metrics": metrics, "history": run["history"], "before": before, "after": after, "codecs": codecs,
            "trunk": info, "preset": s.preset, "settings": settings_key(s), "out": str(out_cmf)}


def recode_draft(out_cmf, codec: str, path, data_spec: str | None = None, settings: MtpSettings | None = None,
                 logger: tracking.Logger = tracking.NULL) -> dict:
    """`out_cmf` with its draft in `codec` at `path`; re-measured on `data_spec` when given."""
    from ..cmf import open_cmf

    f = _open(out_cmf)
    s = resolve(f, settings or MtpSettings(epochs=0))
    m = _load(f, s)
    write_draft(f, _draft_tensors(m), codec, path, None)
    rep = {"path": str(path), "codec": codec, "bytes": _draft_bytes(path), "metrics": {}}
    if data_spec:
        g = open_cmf(path)
        ch, _ = _chain(_load(g, s), g, data_spec, s.resolved(s.preset))
        r = _measure(ch, f"{path} (draft as {codec})")
        rep.update(r)
        rep["metrics"] = {"drafts_per_round": r["drafts_per_round"], **{f"hold_{j + 1}": x for j, x in enumerate(r["hold"])}}
    rep["metrics"]["draft_bytes"] = float(rep["bytes"])
    logger.log_metrics({f"{codec}.{k}": v for k, v in rep["metrics"].items()})
    return rep
