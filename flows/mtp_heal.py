"""mtp_heal: the MTP draft head retrained on a model's own trunk, re-encoded per codec.

Any model the converters read: the source of the parameter set itself (to
heal the draft of a model compressed elsewhere, give that model as `source`).
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from .flow_run import finish, run_tracked


@flow(name="mtp-heal", log_prints=True)
def mtp_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Retrain the source's draft head on its trunk; returns the summary (drafts per round before / after)."""
    s = load_settings(params)
    with run_tracked(s, "mtp-heal") as st:
        final = chains.mtp_only(st, s)  # source, data, mtp init → trunk → mtp, each codec scored
        return finish(st, "drafted", final, register=False)
