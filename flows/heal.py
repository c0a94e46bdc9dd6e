"""heal: the student distilled back toward its source, scored.

The student is the compress stages' output for the same parameters (taken from
the cache when a compress or compress-and-heal run made it).
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from .flow_run import finish, run_tracked
from .summary import log_gap


@flow(name="heal", log_prints=True)
def heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Heal the compressed student on a parameter set; returns the summary (NLL source / pruned / healed)."""
    s = load_settings(params)
    with run_tracked(s, "heal") as st:
        m = chains.healed(st, s)  # the student (cached), heal, scores: cortiq.chains.healed
        st.texts = m.texts
        log_gap(st)
        # the healed model logged and registered (`champion` moves only on a better test NLL)
        return finish(st, "healed", m.healed)
