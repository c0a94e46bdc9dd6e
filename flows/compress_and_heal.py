"""compress-and-heal: the whole pipeline, one cached task per stage.

    source → data → compress → heal → score → mtp heal → re-encode

Every stage is keyed on the digest of its inputs and settings: a run that
failed, run again, finds every finished stage in the cache and resumes at the
one that failed. One MLflow run per flow run, tagged with the Prefect flow-run
id and the parameter set's name.
"""

from __future__ import annotations

from prefect import flow

from cortiq.settings import load_settings

from . import pipeline as P
from .registry import register_final


@flow(name="compress-and-heal", log_prints=True)
def compress_and_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Run the pipeline on a parameter set (a YAML file or its mapping); returns the summary."""
    s = load_settings(params)
    with P.run_tracked(s, "compress-and-heal") as st:
        # source → data → compress: the model as one CMF file (HF directory, GGUF or the bundled SmolLM2
        # converted once), the corpus tokenized and split, neuron masks learned and the MLPs folded → the student
        source, tdata, student = P.student(st, s)
        # heal → score: the teacher's targets once, the frozen prefix once, the tail trained → the healed
        # model; test NLL of source, pruned and healed on the same windows
        healed = P.healed_and_scored(st, s, source, student, tdata)
        final = healed
        # mtp heal: the draft head retrained on the healed trunk; hold rates before / after
        if s.mtp_enabled:
            final = P.mtp(st, s, healed, tdata)
        # re-encode: the final model in each codec, each re-measured
        P.reencode(st, s, final, tdata)
        st.artifacts({"healed": final})
        # registry: a new version of the parameter set's model; `champion` moves only on a better test NLL
        register_final(st, final)
        return P.summary(st)
