"""The fact-recall probe (see cortiq.facts.probe): bundled cloze facts, for evaluation only."""

from .probe import (Fact, FactScores, compare, encode_facts, holds_probe_fact, kept_line, load_facts, part_of, probe,
                    probe_prompts, score_facts)

__all__ = ["Fact", "FactScores", "compare", "encode_facts", "holds_probe_fact", "kept_line", "load_facts", "part_of",
           "probe", "probe_prompts", "score_facts"]
