"""compress: the source folded down to its important MLP neurons, scored.

    source → data → masks → grams → fold → gptq → score source / pruned

The same cached tasks as compress-and-heal: a later compress-and-heal on the
same parameters takes all of this from the cache.
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from . import flow_run as P


@flow(name="compress", log_prints=True)
def compress(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Prune and fold the source on a parameter set; returns the summary (NLL source / pruned)."""
    s = load_settings(params)
    with P.run_tracked(s, "compress") as st:
        # source → data → compress: the model as one CMF file, the corpus tokenized, DTG-MA masks, Grams,
        # the fold (optional repair), optional GPTQ → the student
        m = chains.student(st, s)
        # score: test NLL of the source and the student
        chains.score_chain(st, {"source": m.source, "pruned": m.student}, [chains.data_text(s, m.tdata)])
        return P.finish(st, "pruned", m.student, register=False)
