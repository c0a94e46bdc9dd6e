"""The pipeline's stages as sequences of cached tasks, shared by every flow.

Each function runs one stage of the pipeline through a `Stages` runner and
returns its output's path; the flows (compress, heal, mtp-heal,
compress-and-heal) are these calls in order, so they share one cache.
"""

from __future__ import annotations

from cortiq.settings import PipelineSettings
from cortiq.tracking import flatten
from tasks.compress import fold_task, gptq_task, grams_task, masks_task, plan_fold, plan_gptq, plan_grams, plan_masks
from tasks.heal import export_task, plan_export, plan_prefix, plan_targets, plan_train, prefix_task, targets_task, train_task
from tasks.measure import plan_reencode, plan_score, reencode_task, score_task
from tasks.stages import (data_task, has_draft, mtp_init_task, mtp_task, plan_data, plan_mtp, plan_mtp_init, plan_source,
                          plan_trunk, source_kind, source_task, trunk_task)

from .common import Stages, flow_run_id, flow_run_name
from .tracking import tracked_run


def model_source(st: Stages, s: PipelineSettings) -> str:
    """The source as a CMF path: a .cmf is used where it is, anything else converted once (cached)."""
    if source_kind(s.source) == "cmf":
        return s.source
    return st.run("source", source_task, plan_source, source=s.source)["path"]


def data(st: Stages, s: PipelineSettings, model: str) -> str:
    """The tdata directory of the parameter set's sources, tokenized with `model`'s tokenizer."""
    return st.run("data", data_task, plan_data, sources=s.extra("data", "sources"), model=model,
                  settings=_plain(s.stage("data")))["path"]


def score(st: Stages, s: PipelineSettings, label: str, model: str, tdata: str) -> dict:
    r = st.run(f"score.{label}", score_task, plan_score, model=model, tdata=tdata, window=s.score_window,
               max_tokens=s.score_tokens, label=label)
    if label == "healed":
        log_gap(st)
    return r


def log_gap(st: Stages) -> float | None:
    """heal.gap_recovered = (pruned − healed) / (pruned − source) and the three NLLs
    as MLflow metrics, once source, pruned and healed are scored; the tag
    heal.gap_text says on which text (the parameter set's own test split)."""
    from cortiq.heal.stages import gap_recovered

    nll = {name: ((st.results.get(f"score.{label}") or {}).get("report") or {}).get("metrics", {}).get("nll")
           for name, label in (("source", "source"), ("student", "pruned"), ("healed", "healed"))}
    if any(v is None for v in nll.values()):
        return None
    g = gap_recovered(nll)
    st.log.log_metrics({"heal.nll.source": nll["source"], "heal.nll.pruned": nll["student"],
                        "heal.nll.healed": nll["healed"], **({} if g is None else {"heal.gap_recovered": g})})
    st.log.set_tags({"heal.gap_text": "test split of the parameter set's data (in-domain)"})
    return g


def compress(st: Stages, s: PipelineSettings, source: str, tdata: str) -> str:
    """masks → grams (for the repair, an activation ranking or GPTQ) → fold → gptq: the student."""
    c = s.stage("compress")
    # where it runs enters no digest: the same outputs on any device
    dev, cdt = {"device": c.device}, {"device": c.device, "compute_dtype": c.compute_dtype}
    masks = grams = None
    if c.learn_masks:
        masks = st.run("masks", masks_task, plan_masks, model=source, tdata=tdata, settings=_plain(c.masks),
                       **cdt)["path"]
    if c.needs_grams:
        grams = st.run("grams", grams_task, plan_grams, model=source, tdata=tdata, settings=_plain(c.grams),
                       **cdt)["path"]
    student = st.run("fold", fold_task, plan_fold, model=source, masks=masks, grams=grams,
                     settings=_plain(c.fold), **dev)["path"]
    if c.use_gptq:
        student = st.run("gptq", gptq_task, plan_gptq, model=student, grams=grams, settings=_plain(c.gptq),
                         **dev)["path"]
    return student


def heal(st: Stages, s: PipelineSettings, teacher: str, student: str, tdata: str) -> str:
    """teacher top-k → frozen prefix (when the tail trains alone) → train → export: the healed model."""
    h = _plain(s.stage("heal"))
    targets = st.run("targets", targets_task, plan_targets, teacher=teacher, tdata=tdata, settings=h)["path"]
    prefix = None
    if h["train_from"] > 0:
        prefix = st.run("prefix", prefix_task, plan_prefix, student=student, tdata=tdata, settings=h)["path"]
    trained = st.run("train", train_task, plan_train, student=student, targets=targets, prefix=prefix, tdata=tdata,
                     settings=h)["path"]
    return st.run("heal", export_task, plan_export, student=student, teacher=teacher, train=trained, prefix=prefix,
                  settings=h)["path"]


def mtp(st: Stages, s: PipelineSettings, model: str, tdata: str) -> str:
    """mtp init (when the model has no draft) → trunk pass → draft training: the model with a healed draft."""
    if not has_draft(model):
        model = st.run("mtp_init", mtp_init_task, plan_mtp_init, model=model)["path"]
    m = _plain(s.stage("mtp"))
    trunk = st.run("trunk", trunk_task, plan_trunk, model=model, tdata=tdata, settings=m)["path"]
    return st.run("mtp", mtp_task, plan_mtp, model=model, tdata=tdata, trunk=trunk, settings=m)["path"]


def reencode(st: Stages, s: PipelineSettings, model: str, tdata: str) -> None:
    """The model in each codec of the parameter set, each re-scored."""
    for codec in s.codecs:
        enc = st.run(f"codec.{codec}", reencode_task, plan_reencode, model=model, codec=codec)["path"]
        score(st, s, f"codec.{codec}", enc, tdata)


def _plain(x):
    import dataclasses

    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x


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


def summary(st: Stages) -> dict:
    """What `cortiq demo` prints: NLL per model, drafts per round before/after, size and NLL per codec."""
    r = st.results

    def metric(key, name):
        return ((r.get(key) or {}).get("report") or {}).get("metrics", {}).get(name)

    out = {
        "mlflow_run_id": st.log.run_id,
        "tracking_uri": st.settings.run.tracking(),
        "params": st.settings.name,
        "nll": {k.removeprefix("score."): metric(k, "nll") for k in r if k.startswith("score.") and "codec." not in k},
        "bytes": {k.removeprefix("score."): metric(k, "bytes") for k in r if k.startswith("score.") and "codec." not in k},
        "codecs": {k.removeprefix("codec."): {"bytes": metric(k, "bytes"), "nll": metric(f"score.{k}", "nll")}
                   for k in r if k.startswith("codec.")},
        "states": dict(st.states),
        "outputs": {k: v["path"] for k, v in r.items()},
    }
    if "mtp" in r:
        out["drafts_per_round"] = {"before": metric("mtp", "drafts_per_round_before"),
                                   "after": metric("mtp", "drafts_per_round_after")}
    return out
