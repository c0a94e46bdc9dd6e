"""The flows' side of a chain: the MLflow run around a flow's runner, and a run's end.

The chains themselves (the stages in order) are written once in cortiq.chains; a flow passes
its runner (flows.common.Stages: each stage a cached Prefect task), the command line passes
cortiq.runner.LocalRunner: one list of stages, one cache. What a run reports (metrics, the
named texts and their gaps, the summary) is flows.summary.
"""

from __future__ import annotations

from cortiq.settings import PipelineSettings
from cortiq.tracking import flatten

from .common import Stages, flow_run_id, flow_run_name
from .summary import gap, summary
from .tracking import tracked_run


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
