"""The fact-recall probe: bundled cloze facts, for evaluation only (cortiq.facts.probe), and its
stage (cortiq.facts.stages). Names load on first use."""

from __future__ import annotations

from .._lazy import exports

_EXPORTS = {
    "Fact": "probe", "FactScores": "probe", "compare": "probe", "encode_facts": "probe", "holds_probe_fact": "probe",
    "kept_line": "probe", "load_facts": "probe", "part_of": "probe", "probe_models": "probe", "probe_prompts": "probe",
    "score_facts": "probe",
    "ProbeSettings": "settings",
    "FACTS": "stages", "facts_chain": "stages", "facts_from": "stages", "facts_line": "stages",
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
