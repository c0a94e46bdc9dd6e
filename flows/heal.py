"""heal: the student distilled back toward its source, scored.

    source → data → compress (cached) → targets → prefix → train → export → score

The student is the compress stages' output for the same parameters (taken from
the cache when a compress or compress-and-heal run made it).
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from . import flow_run as P
from .summary import log_gap


@flow(name="heal", log_prints=True)
def heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Heal the compressed student on a parameter set; returns the summary (NLL source / pruned / healed)."""
    s = load_settings(params)
    with P.run_tracked(s, "heal") as st:
        # source → data → compress (the student, cached when compress-and-heal or compress made it) → heal:
        # the teacher's targets, the frozen prefix, the tail trained, the healed model exported → score:
        # test NLL of source, pruned and healed on the same windows
        m = chains.healed(st, s)
        st.texts = m.texts
        log_gap(st)
        # the healed model logged and registered (`champion` moves only on a better test NLL)
        return P.finish(st, "healed", m.healed)
