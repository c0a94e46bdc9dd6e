"""mtp_heal: the MTP draft head retrained on a model's own trunk, re-encoded per codec.

    source → data → mtp init (when the model has no draft) → trunk pass → draft training → re-encode per codec

Any model the converters read: the source of the parameter set itself (to
heal the draft of a model compressed elsewhere, give that model as `source`).
"""

from __future__ import annotations

from prefect import flow

from cortiq import chains
from cortiq.settings import load_settings

from . import flow_run as P


@flow(name="mtp-heal", log_prints=True)
def mtp_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Retrain the source's draft head on its trunk; returns the summary (drafts per round before / after)."""
    s = load_settings(params)
    with P.run_tracked(s, "mtp-heal") as st:
        # source and data, as compress-and-heal has them; mtp heal: a fresh draft when there is none, the
        # trunk pass, the draft trained on the trunk's predictions; re-encode: the model in each codec, re-measured
        final = chains.mtp_only(st, s)
        return P.finish(st, "drafted", final, register=False)
