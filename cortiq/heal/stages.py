"""The heal stages and their chain: the teacher's targets, the frozen prefix, the
training and the healed model's export; `heal`, the command line's call of the
chain, scores source, pruned and healed and puts the healed model at its path.

The work is done in cortiq.heal.targets, cortiq.heal.prefix and cortiq.heal.train;
the functions here make one stage's output each (`teacher_targets`,
`prefix_cache`, `train`, `export`), and name it by the digest the runner gives it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .. import codecs, dist, store, tracking
from ..devices import rank_device, resolve_compute
from ..errors import CortiqError
from ..runner import LocalRunner, Stage, deliver, digest_of, key_of, settings_gpus
from . import prefix as prefix_mod
from . import qat
from . import targets as targets_mod
from .kinds import stored_kind
from .settings import HealSettings

#: the trained tensors in a train stage's directory
TRAINED = "trained.safetensors"
#: scored tokens of each panel text the heal command scores (the leading records that hold them)
PANEL_TOKENS = 32768


# ── the chain ────────────────────────────────────────────────────────────


def heal_chain(runner, teacher, student, tdata, s: HealSettings) -> str | None:
    """teacher targets → frozen prefix (when layers below `train_from` stay frozen) → train →
    the healed CMF. `train_from` unset is decided first, against the device (its value then
    keys the stages: cortiq.heal.fitting). Under torchrun every rank runs the passes and the
    training; rank 0 alone exports (the others return None)."""
    from .fitting import fit_layers

    s = fit_layers(student, teacher, tdata, s)
    targets = runner.run(TARGETS, teacher=teacher, tdata=tdata, settings=s)["path"]
    prefix = None
    if s.train_from > 0:
        prefix = runner.run(PREFIX, student=student, tdata=tdata, settings=s)["path"]
    trained = runner.run(TRAIN, student=student, targets=targets, prefix=prefix, tdata=tdata, settings=s)["path"]
    if not dist.is_main():
        return None
    return runner.run(EXPORT, student=student, teacher=teacher, train=trained, prefix=prefix, settings=s,
                      codec=s.export_codec)["path"]


# ── each stage's output ──────────────────────────────────────────────────


def _record(stage: Stage, digest: str | None, **params) -> dict:
    """How a stage directory's meta.json opens: the stage that made it (name, version), its digest
    (the runner's, else the one the runner would give it) and the settings' part of its key."""
    p = stage.params(params)
    return {"stage": stage.name, "version": stage.version, "digest": digest or digest_of(stage, **params),
            "settings": key_of(stage, p["settings"])}


def teacher_targets(teacher_cmf, tdata_dir, settings: HealSettings, out, logger: tracking.Logger = tracking.NULL,
                    progress: bool = True, digest: str | None = None) -> dict:
    """The targets stage's output at `out` (cortiq.heal.targets.write_targets)."""
    record = _record(TARGETS, digest, teacher=teacher_cmf, tdata=tdata_dir, settings=settings)
    return targets_mod.write_targets(teacher_cmf, tdata_dir, settings, out, record, logger, progress)


def prefix_cache(student_cmf, tdata_dir, settings: HealSettings, out, logger: tracking.Logger = tracking.NULL,
                 progress: bool = True, digest: str | None = None) -> dict:
    """The prefix stage's output at `out` (cortiq.heal.prefix.write_prefix)."""
    settings = settings.every_layer_when_unset()
    record = _record(PREFIX, digest, student=student_cmf, tdata=tdata_dir, settings=settings)
    return prefix_mod.write_prefix(student_cmf, tdata_dir, settings, out, record, logger, progress)


def targets_digest(teacher_cmf, tdata_dir, s: HealSettings) -> str:
    """The digest the runner names these targets by."""
    return digest_of(TARGETS, teacher=teacher_cmf, tdata=tdata_dir, settings=s)


def prefix_digest(student_cmf, tdata_dir, s: HealSettings) -> str:
    """The digest the runner names this prefix by."""
    return digest_of(PREFIX, student=student_cmf, tdata=tdata_dir, settings=s)


def _tok_digest(f) -> str:
    from ..data import tokenizer_digest

    tok = f.tokenizer or {}
    if not tok.get("json"):
        raise CortiqError(f"{f.path}: carries no tokenizer")
    return tokenizer_digest(tok["json"])


def check_inputs(student_cmf, teacher_cmf, tdata_dir, s: HealSettings):
    """Every bad input the issue names, before any work: (tdata, {split: windows})."""
    from ..cmf import open_cmf

    st = open_cmf(student_cmf)
    if s.train_from is not None and s.train_from >= st.arch.num_layers:
        raise CortiqError(f"{student_cmf}: train_from {s.train_from} is beyond its {st.arch.num_layers} layers")
    if teacher_cmf is not None:
        te = open_cmf(teacher_cmf)
        if te.arch.vocab_size != st.arch.vocab_size:
            raise CortiqError(f"{teacher_cmf}: vocabulary of {te.arch.vocab_size} ids, the student {student_cmf} has {st.arch.vocab_size}")
        if _tok_digest(te) != _tok_digest(st):
            raise CortiqError(f"{teacher_cmf}: its tokenizer differs from the student's ({student_cmf})")
        if s.ce < 1.0 and te.arch.vocab_size < s.slots:
            raise CortiqError(f"{teacher_cmf}: vocabulary of {te.arch.vocab_size} ids is smaller than topk {s.slots}")
    elif s.ce < 1.0:
        raise CortiqError("heal: a teacher is needed unless ce = 1")
    td, wins = targets_mod.window_sets(tdata_dir, s)
    td.check_tokenizer(st)
    if len(wins["train"]) < s.batch:
        raise CortiqError(f"{tdata_dir}: {len(wins['train'])} train windows of {s.window} tokens, fewer than one batch of {s.batch}")
    if len(wins["val"]) == 0:
        raise CortiqError(f"{tdata_dir}: the val split has no scored window of {s.window} tokens")
    return td, wins


def train(student_cmf, targets_dir, prefix_dir, tdata_dir, settings: HealSettings, work_dir,
          logger: tracking.Logger = tracking.NULL, progress: bool = True, key: str | None = None) -> dict:
    """Train the student's tail on the targets; the best weights (by held-out
    loss) go to `work_dir/trained.safetensors`, checkpoints to `work_dir`."""
    from safetensors.torch import save_file

    from ..model import load_model
    from .parallel import prepare
    from ..data.windowing import batch_indices
    from .train import Objective, SplitData, StudentTail, fit, train_index, val_index_by_source

    s = settings.every_layer_when_unset()
    work_dir = Path(work_dir)
    dev = rank_device(s.device, "heal settings")
    cdt = resolve_compute(s.compute_dtype, dev)
    tg = targets_mod.Targets(targets_dir)
    if tg.T != s.window:
        raise CortiqError(f"{targets_dir}: targets of windows of {tg.T} tokens, the settings say {s.window}")
    kind = stored_kind(tg.kind, targets_dir)
    if kind is not s.target_kind:
        raise CortiqError(f"{targets_dir}: {kind.name} targets, the settings say {s.target_kind.name}")
    pre = prefix_mod.Prefix(prefix_dir) if prefix_dir is not None else None
    if pre is not None and pre.cached and pre.train_from != s.train_from:
        raise CortiqError(f"{prefix_dir}: a prefix of layers 0..{pre.train_from}, the settings train from {s.train_from}")
    _, wins = targets_mod.window_sets(tdata_dir, s)
    splits = {}
    for split, w in wins.items():
        if len(tg.ids[split]) != len(w):
            raise CortiqError(f"{targets_dir}: {len(tg.ids[split])} {split} windows, the data has {len(w)}: targets of other data")
        h0 = pre.h[split] if pre is not None and pre.cached else None
        source = w.source
        if split == "train":
            index = train_index(len(w), s.batch)
        elif source is not None:  # one source a batch: each source's held-out loss apart
            index, source = val_index_by_source(source, s.batch)
        else:
            index = batch_indices(len(w), s.batch)
        splits[split] = SplitData(w.ids, tg.ids[split], tg.probs[split], tg.total[split], index, h0,
                                  source=source, names=w.names)
    cached = splits["train"].h0 is not None
    model = load_model(student_cmf, dtype=torch.float32, device="cpu")
    tail = StudentTail(model, s.train_from, s.ffn_only, drop_prefix=cached)
    model.to(dev)
    # quantization-aware: before compiling and wrapping, so both see the fake-quantized linears
    qat.attach(model, s.qat_codec, range(s.train_from, tail.num_layers), () if cached else range(s.train_from))
    # the layers compiled, then across ranks DDP or fully_shard around the trained ones (cortiq.heal.parallel)
    sharding = prepare(tail, s, dev, cdt, compile=s.compile and dev.type == "cuda")
    obj = Objective(kind, None, s.ce)
    if kind.online:
        # the whole distribution, online: the teacher the targets stage names
        if not tg.teacher:
            raise CortiqError(f"{targets_dir}: \"{kind.name}\" targets that name no teacher")
        obj.teacher = load_model(tg.teacher, dtype=torch.float32, device=dev).eval()
        if s.compile and dev.type == "cuda":
            obj.teacher.compile_layers()
    # a checkpoint resumes only the run it was taken in: the digest the stage runner names this training by
    key = key or digest_of(TRAIN, student=student_cmf, targets=targets_dir, prefix=prefix_dir,
                                    tdata=tdata_dir, settings=s)
    if not dist.is_main():
        logger = tracking.NULL  # rank 0 reports for all
    logger.log_params({f"heal.{k}": v for k, v in s.to_dict().items()})
    rep = fit(tail, splits["train"], splits["val"], s, work_dir, dev, cdt, key=key, logger=logger, progress=progress,
              obj=obj, sharding=sharding)
    out = work_dir / TRAINED
    tmp = out.with_name(out.name + ".partial")
    state = tail.state()  # every rank: sharded weights are gathered
    if dist.is_main():
        save_file({n: t.contiguous() for n, t in state.items()}, str(tmp), metadata={"key": key})
        os.replace(tmp, out)
    dist.barrier()
    rep.update({"device": str(dev), "compute_dtype": str(cdt).removeprefix("torch."), "prefix_cached": cached,
                "trained": str(out), "slots": tg.k, "ranks": dist.world(), "shard": sharding.kind})
    return rep


def provenance_block(train_report: dict, s: HealSettings, teacher, prefix_dtype: str) -> dict:
    """The healed model's provenance `heal` block, from the train stage's report."""
    m = train_report["metrics"]
    return {
        "device": train_report["device"], "compute_dtype": train_report["compute_dtype"], "settings": s.to_dict(),
        "teacher": None if teacher is None else str(teacher),
        "teacher_digest": None if teacher is None else store.file_digest(teacher),
        "steps": m["steps"], "best_step": m["best_step"], "heldout_start": m["heldout_start"],
        "heldout_best": m["heldout_best"], "ce": s.ce, "genesis": s.genesis, "topk": train_report["slots"],
        "prefix": prefix_dtype,
    }


def healed_model(student_cmf, trained, device="cpu"):
    """The student with the trained tensors, in memory (f32)."""
    from safetensors.torch import load_file

    from ..model import load_model

    model = load_model(student_cmf, dtype=torch.float32, device="cpu")
    params = dict(model.named_parameters())
    got = load_file(str(trained))
    unknown = sorted(set(got) - set(params))
    if unknown:
        raise CortiqError(f"{trained}: tensors the student {student_cmf} has no place for: {unknown[:3]}")
    with torch.no_grad():
        for n, t in got.items():
            if tuple(t.shape) != tuple(params[n].shape):
                raise CortiqError(f"{trained}: {n} has shape {list(t.shape)}, the student's is {list(params[n].shape)}")
            params[n].copy_(t)
    return model.to(device)


def export(student_cmf, trained, out, provenance: dict, codec: str = "keep") -> Path:
    """The healed CMF: the student with the trained tensors, in the student's codecs, provenance `heal`."""
    from ..model import export_model

    model = healed_model(student_cmf, trained)
    return export_model(model, student_cmf, out, codec=codec, provenance_stage="heal", provenance=provenance)


# ── the command line's heal ──────────────────────────────────────────────


def heal(student_cmf, teacher_cmf, tdata_dir, settings: HealSettings, out, logger: tracking.Logger = tracking.NULL,
         work_dir=None, progress: bool = True, score_split: str | None = "test", eval_data=None, retain=None) -> dict:
    """`heal_chain` (targets, prefix, training, export) and the score chain on the healed model,
    the command line's call; every stage's output under `work_dir` is reused when complete, and
    training resumes from its last checkpoint.

    Scoring: NLL of source, student and healed on the heal data's `score_split` and, when
    `eval_data` (a tdata directory of other text) is given, on every record of it; the gap
    recovered is reported on `eval_data` when given (the heal data's own test split rewards
    adapting to that text, which is not recovery), and goes into the healed model's provenance
    with its NLLs (the file at `out`; the stage's own output keeps the training's provenance).

    `retain` (cortiq.data.settings.RetainSettings) mixes retain text into the
    train and val windows; the test splits of its sources, with `eval_data`,
    make the general panel. Two named texts are reported (`texts`): the heal
    data's own `score_split` ("data") and the panel ("panel"), each with the
    NLLs, the excess NLL over the source and the gap recovered.

    Under torchrun (cortiq.dist) every rank calls it: the passes and training
    split across ranks, rank 0 scores and exports; the others return None."""
    from ..measure import ScoreSettings, scored_texts, score_chain

    s = settings
    out = Path(out)
    teacher = None if s.ce >= 1.0 and teacher_cmf is None else teacher_cmf
    check_inputs(student_cmf, teacher, tdata_dir, s)
    if eval_data is not None:
        from ..data import Tdata

        Tdata.open(eval_data).check_tokenizer(student_cmf)
    from .fitting import fit_layers

    s = fit_layers(student_cmf, teacher, tdata_dir, s)  # a setting that cannot fit: refused before any work
    work = store.work_root(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runner = LocalRunner(work, logger, progress)
    mixed, panel = _retain_mix(runner, tdata_dir, teacher or student_cmf, retain)
    if mixed != tdata_dir:
        check_inputs(student_cmf, teacher, mixed, s)
    healed = heal_chain(runner, teacher, student_cmf, mixed, s)
    if healed is None:
        return None  # rank 0 scores, exports and reports
    report = _trained_report(runner.results, out, work)
    how = ScoreSettings(split=score_split or "test", loss_on=s.loss_on, device=s.device)
    texts = scored_texts(how, panel=panel, panel_tokens=PANEL_TOKENS,
                         data=(tdata_dir, f"the {score_split} split of the heal data {tdata_dir} (in-domain)")
                         if score_split else None,
                         eval=(Path(eval_data).name, eval_data, f"{eval_data} (held-out text of another source)")
                         if eval_data is not None else None)
    models = {**({"source": teacher} if teacher is not None else {}), "pruned": student_cmf, "healed": healed}
    named = score_chain(runner, models, texts)
    gap = _scores(report, named, runner.results, texts, tuple(models), logger, score_split, eval_data)
    facts = _facts(runner, models, s.device, report, logger)
    if texts or facts:
        report["gap"], report["texts"] = gap, named
        deliver_scored(healed, out, {"gap": gap, "texts": named, **({"facts": facts} if facts else {})})
    else:
        deliver({"path": healed}, out)
    logger.log_artifact(str(out))
    report["metrics"]["secs"] = time.perf_counter() - t0
    return report


def _retain_mix(runner, tdata_dir, source_cmf, retain) -> tuple:
    """(the data the heal trains on: `tdata_dir` with `retain`'s sources mixed in, {name: each
    retain source's tdata}: the panel); across ranks rank 0 makes the data stages, the others
    then reuse them."""
    if retain is None or not retain.sources:
        return tdata_dir, {}
    from ..data.stages import with_retain

    if dist.active():
        if dist.is_main():
            with_retain(tdata_dir, source_cmf, retain, runner.run, None)
        dist.barrier()
    return with_retain(tdata_dir, source_cmf, retain, runner.run, None)


def _trained_report(results: dict, out: Path, work: Path) -> dict:
    """The heal report of the stages' own: the training's metrics and curves, the targets' and
    the prefix's metrics."""
    rep = results["train"]["report"]
    trep = results["targets"]["report"]
    prep = results["prefix"]["report"] if "prefix" in results else {"metrics": {}}
    return {"metrics": {**rep["metrics"], **{f"targets.{k}": v for k, v in trep["metrics"].items()},
                        **{f"prefix.{k}": v for k, v in prep["metrics"].items()}},
            "history": rep["history"], "evals": rep["evals"], "out": str(out), "work": str(work),
            "memory": rep["memory"]}


def _scores(report: dict, named: dict, results: dict, texts: list, models: tuple, logger: tracking.Logger,
            score_split: str | None, eval_data) -> dict | None:
    """The scores into `report` and `logger` (the NLLs on the data and on `eval_data`, each named
    text's gap and excess): returns the one gap of earlier reports, the panel's when there is
    one (recovery, not adaptation)."""
    from ..measure import named_texts

    if score_split:
        nll = report["nll"] = named["data"]["nll"]
        report["metrics"].update({f"nll.{k}": v for k, v in nll.items()})
        logger.log_metrics({f"heal.nll.{k}": v for k, v in nll.items()})
    if eval_data is not None:
        nll = report["eval_nll"] = named_texts(results, texts[-1:], models)["panel"]["parts"][texts[-1].name]["nll"]
        report["metrics"].update({f"eval_nll.{k}": v for k, v in nll.items()})
        logger.log_metrics({f"heal.eval_nll.{k}": v for k, v in nll.items()})
    for name, g in named.items():
        got = {f"{name}.gap_recovered": g.get("gap_recovered"), f"{name}.excess_nll": (g.get("excess") or {}).get("healed")}
        got.update({f"{name}.{p}.excess_nll": (q.get("excess") or {}).get("healed") for p, q in g.get("parts", {}).items()})
        got = {k: v for k, v in got.items() if v is not None}
        report["metrics"].update(got)
        logger.log_metrics({f"heal.{k}": v for k, v in got.items()})
    gap = named.get("panel") or named.get("data")
    if gap is not None and "gap_recovered" in gap:
        report["metrics"]["gap_recovered"] = gap["gap_recovered"]
        logger.log_metrics({"heal.gap_recovered": gap["gap_recovered"]})
    return gap


def _facts(runner, models: dict, device: str, report: dict, logger: tracking.Logger) -> dict:
    """Facts kept of the source's, pruned and healed (cortiq.facts: the probe's held part), into
    the report and the logger; none without a source to compare with."""
    if "source" not in models:
        return {}
    from ..facts.stages import ProbeSettings, facts_chain

    facts = report["facts"] = facts_chain(runner, models, ProbeSettings(device=device))
    got = {f"facts.{label}.{k}": float(c[k]) for label, c in facts.items()
           for k in ("kept", "kept_share", "known", "sure_kept_share") if c.get(k) is not None}
    report["metrics"].update(got)
    logger.log_metrics({f"heal.{k}": v for k, v in got.items()})
    return facts


def deliver_scored(healed, out, scores: dict) -> Path:
    """The healed model at `out` with what it scored in its provenance's `heal` block (the
    tensors copied as stored; the cached output keeps the training's provenance)."""
    from ..cmf import copy_specs, open_cmf, write_cmf

    src = open_cmf(healed)
    doc = {k: v for k, v in src.doc.items() if k not in ("codecs", "hashes", "shards")}
    prov = dict(doc.get("provenance") or {})
    prov["heal"] = {**prov.get("heal", {}), **scores}
    doc["provenance"] = prov
    return write_cmf(out, doc, copy_specs(src))


# ── the stages, declared once (cortiq.runner runs them for the CLI and the flows) ──

def _every_layer_when_unset(p: dict) -> dict:
    return {**p, "settings": p["settings"].every_layer_when_unset()}


def _train(out, ctx, student, targets, prefix, tdata, settings) -> dict:
    # the output directory is the run's work directory: a killed run, started
    # again, finds its checkpoint there and resumes
    out.mkdir(parents=True, exist_ok=True)
    rep = train(Path(student), Path(targets), prefix and Path(prefix), Path(tdata), settings, out, ctx.logger,
                ctx.progress, key=ctx.digest)
    if dist.is_main():
        store.finish_dir(out, {"stage": TRAIN.name, "digest": ctx.digest, "report": rep})
    return rep


def _export(out, ctx, student, teacher, train, prefix, settings, codec) -> dict:
    rep = store.read_meta(train)["report"]
    dtype = store.read_meta(prefix)["dtype"] if prefix else "none"
    block = provenance_block(rep, settings, teacher if settings.ce < 1.0 else None, dtype)
    export(Path(student), Path(train) / TRAINED, out, block, codec)
    return {"metrics": {k: rep["metrics"][k] for k in ("heldout_start", "heldout_best", "best_step", "steps")}}


# 2: "sampled" draws are seeded per batch of windows (so any number of ranks draws the same)
TARGETS = Stage("targets", 2,
                lambda out, ctx, teacher, tdata, settings: teacher_targets(teacher, tdata, settings, out, ctx.logger,
                                                                          ctx.progress, ctx.digest),
                HealSettings, ("teacher", "tdata"), normalize=targets_mod.same_targets, gpus=settings_gpus,
                doc="the teacher's sparse next-token distribution per row (ce-mixed, weight-scaled), train and val")
PREFIX = Stage("prefix", 1,
               lambda out, ctx, student, tdata, settings: prefix_cache(student, tdata, settings, out, ctx.logger,
                                                                      ctx.progress, ctx.digest),
               HealSettings, ("student", "tdata"), gpus=settings_gpus, normalize=_every_layer_when_unset,
               doc="the frozen layers' output, once per window (f32, f16 or not cached, by the memory budget)")
# QAT rounds the frozen embedding and head as the file in its codec stores them (codecs.rule_key)
TRAIN = Stage("train", 1, _train, HealSettings, ("student", "targets", "prefix", "tdata"),
              gpus=settings_gpus, normalize=_every_layer_when_unset, extra=lambda p: codecs.rule_key(p["settings"].qat_codec),
              doc="the student's tail trained on the targets; the best held-out weights kept; resumes from its checkpoint")
# The healed model's export. Its stage name, "heal", stands in its outputs' digests and file names
# (heal-<digest>.cmf) and in the flows' keys: kept, so the healed models made before are reused.
# No heal setting feeds it: the trained weights come in through `train`, the codec as its own parameter
EXPORT = Stage("heal", 1, _export, HealSettings, ("student", "train"),
               extra=lambda p: {"codec": p["codec"], **codecs.rule_key(p["codec"])}, output="cmf",
               doc="the healed CMF: the student with the trained weights, in its codecs (the QAT codec's when it "
                   "trained against one), provenance `heal`")
