"""heal: the student distilled back toward its source, scored.

    source → data → compress (cached) → heal (teacher top-k, prefix, train, export) → score

The student is the compress stage's output for the same parameters (taken
from the cache when a compress or compress-and-heal run made it).
"""

from __future__ import annotations

from prefect import flow

from cortiq.settings import load_settings
from tasks.stages import compress_task, heal_task, plan_compress, plan_heal

from .compress_and_heal import data, model_source, run_tracked, score, summary


@flow(name="heal", log_prints=True)
def heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Heal the compressed student on a parameter set; returns the summary (NLL source / pruned / healed)."""
    s = load_settings(params)
    with run_tracked(s, "heal") as st:
        # source and data, as compress-and-heal has them
        source = model_source(st, s)
        tdata = data(st, s, source)
        # the student: the compress stage's output (cached when it exists)
        student = st.run("compress", compress_task, plan_compress, model=source, tdata=tdata, settings=s.compress)["path"]
        # heal: distil the source's next-token distribution back into the student
        healed = st.run("heal", heal_task, plan_heal, teacher=source, student=student, tdata=tdata,
                        settings=s.heal)["path"]
        # score: test NLL of source, pruned and healed on the same windows
        for label, model in (("source", source), ("pruned", student), ("healed", healed)):
            score(st, s, label, model, tdata)
        st.artifacts({"healed": healed})
        return summary(st)
