"""mtp_heal: the MTP draft head retrained on a model's own trunk, re-encoded per codec.

    source → data → mtp init (when the model has no draft) → mtp heal → re-encode per codec → score each

Any model the converters read: the source of the parameter set itself (to
heal the draft of a model compressed elsewhere, give that model as `source`).
"""

from __future__ import annotations

from prefect import flow

from cortiq.settings import load_settings
from tasks.measure import plan_reencode, reencode_task
from tasks.stages import has_draft, mtp_init_task, mtp_task, plan_mtp, plan_mtp_init

from .compress_and_heal import data, model_source, run_tracked, score, summary


@flow(name="mtp-heal", log_prints=True)
def mtp_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Retrain the source's draft head on its trunk; returns the summary (drafts per round before / after)."""
    s = load_settings(params)
    with run_tracked(s, "mtp-heal") as st:
        # source and data, as compress-and-heal has them
        model = model_source(st, s)
        tdata = data(st, s, model)
        # mtp init: a fresh draft for a model that has none
        if not has_draft(model):
            model = st.run("mtp_init", mtp_init_task, plan_mtp_init, model=model)["path"]
        # mtp heal: the draft trained on the trunk's own predictions; hold rates before / after
        final = st.run("mtp", mtp_task, plan_mtp, model=model, tdata=tdata, settings=s.mtp)["path"]
        # re-encode: the model in each codec, each re-measured
        for codec in s.codecs:
            enc = st.run(f"codec.{codec}", reencode_task, plan_reencode, model=final, codec=codec)["path"]
            score(st, s, f"codec.{codec}", enc, tdata)
        st.artifacts({"drafted": final})
        return summary(st)
