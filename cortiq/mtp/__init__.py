"""MTP heal: retrain the draft head on the compressed trunk's own predictions.

- cortiq.mtp.stages: the mtp_init, trunk and mtp stages and `mtp_chain`;
- cortiq.mtp.heal: what they call (`trunk_pass`, `mtp_heal`, `recode_draft`,
  `mtp_init`) and the measures the benches and `cortiq generate` share
  (`measure_text`, `heldout_windows`);
- draft.py (the chain trained and measured), trunk.py (the trunk pass and its
  cache), selfgen.py (the model's own continuations), measures.py, rounds.py,
  init.py (a fresh draft block).

Names load on first use, so `cortiq.mtp.settings` (the CLI's defaults) stays
free of torch.
"""

from __future__ import annotations

from .._lazy import exports

_EXPORTS = {
    "MtpSettings": "settings",
    **{name: "heal" for name in ("trunk_pass", "mtp_heal", "recode_draft", "mtp_init", "resolve", "measure_text",
                                 "heldout_windows", "write_draft")},
    **{name: "stages" for name in ("mtp_chain", "MTP_INIT", "TRUNK", "MTP")},
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
