"""The fact probe's settings as a stage takes them (light: no numpy)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings_meta import check, setting


@dataclass
class ProbeSettings:
    """What the facts stage scores (cortiq.facts.probe)."""

    part: str = setting("held", "the fact probe's part (held: the one methods are judged by)",
                        choices=("held", "dev", "all"))
    device: str = setting("auto", "where the model scores: auto (CUDA when present), cpu, cuda, cuda:N", how=True)

    def __post_init__(self):
        check(self, "probe settings")
