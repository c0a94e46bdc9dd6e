"""compress: the source folded down to its important MLP neurons, scored.

The same cached tasks as compress-and-heal: a later compress-and-heal on the
same parameters takes all of this from the cache.
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.measure import score_chain
from cortiq.settings import load_settings

from .flow_run import finish, run_tracked


@flow(name="compress", log_prints=True)
def compress(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Prune and fold the source on a parameter set; returns the summary (NLL source / pruned)."""
    s = load_settings(params)
    with run_tracked(s, "compress") as st:
        m = chains.student(st, s)  # source → data → retain mix → masks → grams → fold → gptq
        score_chain(st, {"source": m.source, "pruned": m.student}, [chains.data_text(s, m.tdata)])
        return finish(st, "pruned", m.student, register=False)
