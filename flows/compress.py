"""compress: the source folded down to its important MLP neurons, scored.

    source → data → compress (masks, fold, grams, gptq) → score source / pruned

The same cached tasks as compress-and-heal: a later compress-and-heal on the
same parameters takes all of this from the cache.
"""

from __future__ import annotations

from prefect import flow

from cortiq.settings import load_settings
from tasks.stages import compress_task, plan_compress

from .compress_and_heal import data, model_source, run_tracked, score, summary


@flow(name="compress", log_prints=True)
def compress(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Prune and fold the source on a parameter set; returns the summary (NLL source / pruned)."""
    s = load_settings(params)
    with run_tracked(s, "compress") as st:
        # source: the model as one CMF file
        source = model_source(st, s)
        # data: the corpus tokenized with the source's tokenizer
        tdata = data(st, s, source)
        # compress: DTG-MA masks, the fold (optional repair), optional GPTQ → the student
        student = st.run("compress", compress_task, plan_compress, model=source, tdata=tdata, settings=s.compress)["path"]
        # score: test NLL of the source and the student
        for label, model in (("source", source), ("pruned", student)):
            score(st, s, label, model, tdata)
        st.artifacts({"pruned": student})
        return summary(st)
