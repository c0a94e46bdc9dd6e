"""Heal (S4): distil the source model back into a smaller student.

Stages (docs/internals.md, "Stages"), each a plain function of paths and
`HealSettings`: `teacher_targets` (the teacher's top-k per row, ce-mixed,
weight-scaled), `prefix_cache` (the frozen layers' output once per window),
`train` (cortiq.heal.stages.train: resumable, best held-out checkpoint), `export` (the healed CMF in
the student's codecs, provenance `heal`), `score` (test NLL per model), and
`heal`, which chains them for the CLI.

Names load on first use, so `cortiq.heal.settings` (the CLI's defaults)
stays free of torch.
"""

from __future__ import annotations

from .._lazy import exports

_EXPORTS = {
    "HealSettings": "settings",
    "topk_kl": "loss", "topk_kl_reference": "loss",
    "teacher_targets": "stages", "mix_targets": "kinds",
    "prefix_cache": "stages",
    "check_inputs": "stages", "export": "stages", "heal": "stages",
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
