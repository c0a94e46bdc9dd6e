"""compress-and-heal: the whole pipeline, one cached task per stage.

    source → data → compress → heal → score → mtp heal → re-encode

Every stage is keyed on the digest of its inputs and settings: a run that
failed, run again, finds every finished stage in the cache and resumes at the
one that failed. One MLflow run per flow run, tagged with the Prefect flow-run
id and the parameter set's name.
"""

from __future__ import annotations

from prefect import flow

from cortiq.settings import PipelineSettings, load_settings
from cortiq.tracking import flatten
from tasks.measure import plan_reencode, plan_score, reencode_task, score_task
from tasks.stages import (compress_task, data_task, has_draft, heal_task, mtp_init_task, mtp_task, plan_compress,
                          plan_data, plan_heal, plan_mtp, plan_mtp_init, plan_source, source_kind, source_task)

from .common import Stages, flow_run_id, flow_run_name
from .tracking import tracked_run


@flow(name="compress-and-heal", log_prints=True)
def compress_and_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Run the pipeline on a parameter set (a YAML file or its mapping); returns the summary."""
    s = load_settings(params)
    with run_tracked(s, "compress-and-heal") as st:
        # source: the model as one CMF file (HF directory, GGUF or the bundled SmolLM2 converted once)
        source = model_source(st, s)
        # data: the corpus tokenized with the source's tokenizer, split train / val / test
        tdata = data(st, s, source)
        # compress: learn neuron masks, fold the MLPs down to the kept neurons → the student
        student = st.run("compress", compress_task, plan_compress, model=source, tdata=tdata,
                         settings=s.compress)["path"]
        # heal: distil the source's next-token distribution back into the student
        healed = st.run("heal", heal_task, plan_heal, teacher=source, student=student, tdata=tdata,
                        settings=s.heal)["path"]
        # score: test NLL of source, pruned and healed on the same windows
        for label, model in (("source", source), ("pruned", student), ("healed", healed)):
            score(st, s, label, model, tdata)
        final = healed
        # mtp heal: retrain the draft head on the healed trunk; hold rates before / after
        if s.mtp_enabled:
            drafted = healed if has_draft(healed) else st.run("mtp_init", mtp_init_task, plan_mtp_init,
                                                              model=healed)["path"]
            final = st.run("mtp", mtp_task, plan_mtp, model=drafted, tdata=tdata, settings=s.mtp)["path"]
        # re-encode: the final model in each codec, each re-measured
        for codec in s.codecs:
            enc = st.run(f"codec.{codec}", reencode_task, plan_reencode, model=final, codec=codec)["path"]
            score(st, s, f"codec.{codec}", enc, tdata)
        st.artifacts({"healed": final})
        return summary(st)


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
    return st.run(f"score.{label}", score_task, plan_score, model=model, tdata=tdata, window=s.score_window,
                  max_tokens=s.score_tokens, label=label)


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
