"""The settings of a tdata build (light: the CLI reads its defaults without loading numpy or Arrow)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CortiqError


@dataclass
class BuildSettings:
    """How records are made from the sources."""

    # ── records from plain text ──
    #: paragraphs are packed into records of up to this many tokens; a longer
    #: paragraph is cut at line, then sentence boundaries
    record_tokens: int = 512
    #: the longest record accepted (the longest window a stage is asked to
    #: support): a record still longer after cutting is an error
    max_tokens: int = 8192

    #: keep at most this many tokens in all (0: everything): records are taken
    #: in the order of a hash of their rid (a fixed sample across the
    #: sources) until the cap; for quick runs on a large corpus
    max_total_tokens: int = 0

    # ── tokens ──
    #: append the EOS id to every record (a model learns where answers end;
    #: records in a stream stay apart)
    eos: bool = True

    # ── splits ──
    #: train/val/test fractions for records that name no split: a record goes
    #: where the sha256 of its rid falls
    fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)

    # ── labels ──
    #: category of records that name none (default: the source file's stem or the corpus name)
    category: str | None = None

    # ── generated answers (self-distillation) ──
    #: a CMF model that writes the answer of every prompt (greedy)
    generate_with: str | None = None
    #: the most tokens a generated answer has
    max_new: int = 256

    def __post_init__(self):
        self.fractions = tuple(float(f) for f in self.fractions)
        if len(self.fractions) != 3 or any(f < 0 for f in self.fractions) or abs(sum(self.fractions) - 1) > 1e-6:
            raise CortiqError(f"split fractions must be three non-negative numbers summing to 1, not {self.fractions}")
        if self.fractions[0] == 0:
            raise CortiqError("the train fraction must be positive")
        if self.record_tokens < 2:
            raise CortiqError(f"record_tokens must be at least 2, not {self.record_tokens}")
        if self.max_tokens < self.record_tokens:
            raise CortiqError(f"max_tokens ({self.max_tokens}) must be at least record_tokens ({self.record_tokens})")
        if self.max_total_tokens < 0:
            raise CortiqError(f"max_total_tokens must be 0 (no cap) or positive, not {self.max_total_tokens}")
        if self.max_new < 1:
            raise CortiqError(f"max_new must be at least 1, not {self.max_new}")
