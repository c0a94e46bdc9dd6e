"""compress-and-heal: the whole pipeline, one cached task per stage.

    source → data → compress → heal → score → mtp heal → re-encode

Every stage is keyed on the digest of its inputs and settings: a run that
failed, run again, finds every finished stage in the cache and resumes at the
one that failed. One MLflow run per flow run, tagged with the Prefect flow-run
id and the parameter set's name.
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from . import flow_run as P
from .summary import log_gap


@flow(name="compress-and-heal", log_prints=True)
def compress_and_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Run the pipeline on a parameter set (a YAML file or its mapping); returns the summary."""
    s = load_settings(params)
    with P.run_tracked(s, "compress-and-heal") as st:
        # source → data → compress → heal → score: the model as one CMF file (HF directory, GGUF or the
        # bundled SmolLM2 converted once), the corpus tokenized and split, neuron masks learned and the MLPs
        # folded (the student), the teacher's targets and the frozen prefix once, the tail trained (the healed
        # model), test NLL of source, pruned and healed on the same windows
        # mtp heal: the draft head retrained on the healed trunk; hold rates before / after
        # re-encode: the final model in each codec, each re-measured on the test split and the held-out texts
        # (cortiq.chains.pipeline, the one chain `cortiq demo` runs too)
        final, m = chains.pipeline(st, s)
        st.texts = m.texts
        log_gap(st)
        # the final model logged and registered (`champion` moves only on a better test NLL)
        return P.finish(st, "healed", final)
