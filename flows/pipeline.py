"""The pipeline's stages as sequences of cached tasks, shared by every flow.

Each function runs one stage of the pipeline through a `Stages` runner and
returns its output's path; the flows (compress, heal, mtp-heal,
compress-and-heal) are these calls in order, so they share one cache.
"""

from __future__ import annotations

import functools

from cortiq.cmf import open_cmf
from cortiq.compress import FOLD, GPTQ, GRAMS, MASKS
from cortiq.convert import SOURCE, source_kind
from cortiq.data.builder import DATA
from cortiq.heal.prefix import PREFIX
from cortiq.heal.stages import HEAL, TRAIN
from cortiq.heal.targets import TARGETS
from cortiq.measure import REENCODE, SCORE, panel_gap, text_gap
from cortiq.mtp import MTP, MTP_INIT, TRUNK
from cortiq.mtp.init import has_draft
from cortiq.pipeline import plain
from cortiq.quant import QGRAMS, QUANTIZE, uses_grams
from cortiq.settings import PipelineSettings
from cortiq.tracking import flatten

from .common import Stages, flow_run_id, flow_run_name
from .tracking import tracked_run


def model_source(st: Stages, s: PipelineSettings) -> str:
    """The source as a CMF path: a .cmf is used where it is, anything else converted once (cached)."""
    if source_kind(s.source) == "cmf":
        return s.source
    return st.run(SOURCE, source=s.source)["path"]


def data(st: Stages, s: PipelineSettings, model: str) -> str:
    """The tdata directory of the parameter set's sources, tokenized with `model`'s tokenizer."""
    return st.run(DATA, sources=s.extra("data", "sources"), model=model, settings=plain(s.stage("data")))["path"]


def score(st: Stages, s: PipelineSettings, label: str, model: str, tdata: str, split: str = "test") -> dict:
    """Test NLL of `model` (every record's with split "all"), logged as score.<label>."""
    return st.run(SCORE, f"score.{label}", model=model, tdata=tdata,
                  settings={"window": s.score_window, "max_tokens": s.score_tokens, "loss_on": "answer", "split": split})


def retained(st: Stages, s: PipelineSettings, source: str, tdata: str) -> tuple[str, dict]:
    """(the tdata the masks, Grams and heal read: the user's data with the retain sources mixed in, or
    the user's alone; {name: retain tdata}, whose test splits are the general panel). Made once a run."""
    memo = getattr(st, "retained", None)
    if memo is None:
        from cortiq.data.retain import with_retain

        memo = st.retained = with_retain(tdata, source, s.stage("retain"),
                                         lambda stage, key=None, **p: st.run(stage, key, **p), st.out_root,
                                         progress=False)
    return memo


def metric(st: Stages, key: str, name: str) -> float | None:
    """A finished stage's report metric (None while the stage has not run)."""
    v = (((st.results.get(key) or {}).get("report") or {}).get("metrics") or {}).get(name)
    return None if v is None else float(v)


def _nll3(st: Stages, pre: str) -> dict | None:
    nll = {name: metric(st, f"{pre}{label}", "nll")
           for name, label in (("source", "source"), ("student", "pruned"), ("healed", "healed"))}
    return None if any(v is None for v in nll.values()) else nll


def texts(st: Stages) -> dict:
    """The two named texts every report shows, once source, pruned and healed are scored:
    "data" (the test split of the parameter set's data) and "panel" (the general panel: the
    retain sources' test splits, scored as score.panel.NAME.*, and data.eval_sources, scored
    as score.eval.*; text no stage trained on), each with its NLLs, excess and gap."""
    out = {}
    nll = _nll3(st, "score.")
    if nll is not None:
        out["data"] = text_gap("test split of the parameter set's data (in-domain)", nll)
    parts = {}
    for name in dict.fromkeys(k.split(".")[2] for k in st.results if k.startswith("score.panel.")):
        nll = _nll3(st, f"score.panel.{name}.")
        if nll is not None:
            parts[name] = text_gap(f"the test split of the retain source {name}", nll)
    ev = st.settings.extra("data", "eval_sources")
    nll = _nll3(st, "score.eval.") if ev else None
    if nll is not None:
        parts["eval"] = text_gap(f"held-out text of another source: {', '.join(ev)}", nll)
    if parts:
        out["panel"] = panel_gap(parts)
    return out


def gap(st: Stages) -> dict | None:
    """The share of the pruning's NLL loss the heal won back: on the general panel when the
    parameter set has one (retain sources, data.eval_sources), else on the data's own test
    split. {"text", "nll", "gap_recovered", "excess", "texts": both named texts}."""
    t = texts(st)
    g = t.get("panel") or t.get("data")
    if g is None:
        return None
    return {"gap_recovered": None, **g, "texts": t}


def log_gap(st: Stages) -> None:
    """heal.gap_recovered and the three NLLs it comes from as MLflow metrics, the tag heal.gap_text
    saying on which text; and per named text (data, panel) heal.<text>.gap_recovered and
    heal.<text>.excess_nll (the healed model's NLL over the source's), the tag heal.<text>_text."""
    g = gap(st)
    if g is None:
        return
    n = g["nll"]
    st.log.log_metrics({"heal.nll.source": n["source"], "heal.nll.pruned": n["student"], "heal.nll.healed": n["healed"],
                        **({} if g["gap_recovered"] is None else {"heal.gap_recovered": g["gap_recovered"]})})
    st.log.set_tags({"heal.gap_text": g["text"]})
    for name, t in g["texts"].items():
        vals = {f"heal.{name}.gap_recovered": t.get("gap_recovered"), f"heal.{name}.excess_nll": t["excess"]["healed"],
                **{f"heal.{name}.{p}.excess_nll": q["excess"]["healed"] for p, q in t.get("parts", {}).items()}}
        st.log.log_metrics({k: v for k, v in vals.items() if v is not None})
        st.log.set_tags({f"heal.{name}_text": t["text"]})


def student(st: Stages, s: PipelineSettings) -> tuple[str, str, str]:
    """source → data → compress: (source CMF, tdata, the student), every flow's opening."""
    source = model_source(st, s)
    tdata = data(st, s, source)
    return source, tdata, compress(st, s, source, retained(st, s, source, tdata)[0])


def through_heal(st: Stages, s: PipelineSettings) -> tuple[str, str]:
    """source → data → compress → heal → score: (the healed model, the tdata it was healed and scored on)."""
    source, tdata, pruned = student(st, s)
    return healed_and_scored(st, s, source, pruned, tdata), tdata


def healed_and_scored(st: Stages, s: PipelineSettings, source: str, pruned: str, tdata: str) -> str:
    """heal (on the data with the retain sources mixed in) → score source, pruned and healed on the
    data's test split, on each retain source's test split (the general panel), and on every record of
    data.eval_sources when given (text no stage trained on): the healed model."""
    mixed, panel = retained(st, s, source, tdata)
    healed = heal(st, s, source, pruned, mixed)
    models = (("source", source), ("pruned", pruned), ("healed", healed))
    for label, model in models:
        score(st, s, label, model, tdata)
    for name, d in panel.items():
        for label, model in models:
            score(st, s, f"panel.{name}.{label}", model, d)
    ev = s.extra("data", "eval_sources")
    if ev:
        etd = st.run(DATA, "data.eval", sources=ev, model=source, settings=plain(s.stage("data")))["path"]
        for label, model in models:
            score(st, s, f"eval.{label}", model, etd, split="all")
    log_gap(st)
    return healed


def compress(st: Stages, s: PipelineSettings, source: str, tdata: str) -> str:
    """masks → grams (for the repair, an activation ranking or GPTQ) → fold → gptq: the student."""
    c = s.stage("compress")
    # where it runs enters no digest: the same outputs on any device
    dev, cdt = {"device": c.device}, {"device": c.device, "compute_dtype": c.compute_dtype}
    masks = grams = None
    if c.learn_masks:
        masks = st.run(MASKS, model=source, tdata=tdata, settings=plain(c.masks), **cdt)["path"]
    if c.needs_grams:
        grams = st.run(GRAMS, model=source, tdata=tdata, settings=plain(c.grams), **cdt)["path"]
    student = st.run(FOLD, model=source, masks=masks, grams=grams, settings=plain(c.fold), **dev)["path"]
    if c.use_gptq:
        student = st.run(GPTQ, model=student, grams=grams, settings=plain(c.gptq), **dev)["path"]
    return student


def heal(st: Stages, s: PipelineSettings, teacher: str, student: str, tdata: str) -> str:
    """teacher targets → frozen prefix (when the tail trains alone) → train → export: the healed model."""
    h = plain(s.stage("heal"))
    targets = st.run(TARGETS, teacher=teacher, tdata=tdata, settings=h)["path"]
    prefix = None
    if h["train_from"] > 0:
        prefix = st.run(PREFIX, student=student, tdata=tdata, settings=h)["path"]
    trained = st.run(TRAIN, student=student, targets=targets, prefix=prefix, tdata=tdata, settings=h)["path"]
    return st.run(HEAL, student=student, teacher=teacher, train=trained, prefix=prefix, settings=h)["path"]


def mtp(st: Stages, s: PipelineSettings, model: str, tdata: str) -> str:
    """mtp init (when the model has no draft) → trunk pass → draft training: the model with a healed draft."""
    if not has_draft(open_cmf(model)):
        model = st.run(MTP_INIT, model=model)["path"]
    m = plain(s.stage("mtp"))
    trunk = st.run(TRUNK, model=model, tdata=tdata, settings=m)["path"]
    return st.run(MTP, model=model, tdata=tdata, trunk=trunk, settings=m)["path"]


def panels(st: Stages) -> dict[str, tuple[str, str]]:
    """The held-out texts besides the data's own test split that every codec is scored on,
    {name: (tdata, split)}: each retain source's test split (the general panel, never trained on)
    and every record of data.eval_sources when the parameter set names one."""
    memo = getattr(st, "retained", None)
    out = {name: (d, "test") for name, d in (memo[1] if memo else {}).items()}
    ev = st.results.get("data.eval")
    if ev:
        out["eval"] = (ev["path"], "all")
    return out


def reencode(st: Stages, s: PipelineSettings, model: str, tdata: str,
             texts: dict[str, tuple[str, str]] | None = None) -> None:
    """The model in each codec of the parameter set, each re-scored on the data's test split and on each
    of `texts` ({name: (tdata dir, split)}: the general panel), as score.panel.<name>.reencode.<codec>.
    Block codecs are written by the quant group's method: GPTQ or AWQ from Grams over the data's calibration
    windows (cached per model, data and settings), else round-to-nearest (and the codec a QAT heal wrote the
    model in is copied as it is)."""
    q = s.stage("quant")
    trained_in = s.stage("heal").qat_codec
    for codec in s.codecs:
        # a model healed against this codec is already in it: the re-encode copies its blocks as they are
        if uses_grams(codec, q) and codec != trained_in:
            grams = st.run(QGRAMS, f"qgrams.{codec}", model=model, tdata=tdata, codec=codec, settings=plain(q))["path"]
            enc = st.run(QUANTIZE, f"reencode.{codec}", model=model, grams=grams, codec=codec, settings=plain(q))["path"]
        else:
            enc = st.run(REENCODE, f"reencode.{codec}", model=model, codec=codec)["path"]
        score(st, s, f"reencode.{codec}", enc, tdata)
        for name, (td, split) in (texts or {}).items():
            score(st, s, f"panel.{name}.reencode.{codec}", enc, td, split=split)


def codec_rows(st: Stages) -> dict:
    """{codec: {"bytes", "nll" (the data's test split), "method" (gptq, awq; rtn for the round-to-nearest
    re-encode, which is also what a plain codec's is), "panel": {text: nll}}} of the re-encode stages run."""
    r = st.results
    m = functools.partial(metric, st)
    names = sorted({k.removeprefix("score.panel.").split(".reencode.")[0] for k in r if k.startswith("score.panel.")})
    return {k.removeprefix("reencode."): {"bytes": m(k, "bytes"), "nll": m(f"score.{k}", "nll"),
                                         "method": (r[k].get("report") or {}).get("method", "rtn"),
                                         "panel": {p: m(f"score.panel.{p}.{k}", "nll") for p in names
                                                   if f"score.panel.{p}.{k}" in r}}
            for k in r if k.startswith("reencode.")}


class run_tracked:
    """The body of a flow: an MLflow run (tagged, params flattened) around a Stages runner."""

    def __init__(self, s: PipelineSettings, flow: str):
        self.s, self.flow = s, flow

    def __enter__(self) -> Stages:
        fid = flow_run_id()
        self._cm = tracked_run(self.s.run.tracking(), self.s.run.experiment, f"{self.s.name}/{flow_run_name()}",
                               {"prefect.flow_run_id": fid, "cortiq.params": self.s.name, "cortiq.flow": self.flow})
        log = self._cm.__enter__()
        log.log_params(flatten(self.s.to_dict()))
        self.stages = Stages(self.s, log)
        self.stages.mlflow_run_id = log.run_id
        return self.stages

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def finish(st: Stages, label: str, model: str, register: bool = True) -> dict:
    """The run's end: the final model (or a reference to it), its provenance and
    the plots logged to MLflow; with `register`, a new version of the parameter
    set's model in the registry (`champion` moves only on a better test NLL).
    Returns the summary."""
    st.artifacts({label: model})
    g = gap(st)
    if g is not None:  # both named texts, as the summary and the registry report them
        from .tracking import log_json

        log_json(st.log, "texts.json", g["texts"], "provenance")
    if register:
        from .registry import register_final

        register_final(st, model)
    return summary(st)


def summary(st: Stages) -> dict:
    """What `cortiq demo` prints: NLL per model, drafts per round before/after, size and NLL per codec."""
    r = st.results
    m = functools.partial(metric, st)
    out = {
        "mlflow_run_id": st.log.run_id,
        "tracking_uri": st.settings.run.tracking(),
        "params": st.settings.name,
        "nll": {k.removeprefix("score."): m(k, "nll") for k in r if k.startswith("score.") and "reencode." not in k},
        "gap": gap(st),
        "bytes": {k.removeprefix("score."): m(k, "bytes") for k in r if k.startswith("score.") and "reencode." not in k},
        "codecs": codec_rows(st),
        "states": dict(st.states),
        "outputs": {k: v["path"] for k, v in r.items()},
    }
    if "mtp" in r:
        out["drafts_per_round"] = {"before": m("mtp", "drafts_per_round_before"),
                                   "after": m("mtp", "drafts_per_round_after")}
    return out
