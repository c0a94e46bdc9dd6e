"""The facts stage: per-fact scores cached per model, compared with the source's."""

from __future__ import annotations

import numpy as np

from cortiq import tracking
from cortiq.runner import LocalRunner
from cortiq.facts import encode_facts, load_facts, score_facts
from cortiq.facts.stages import ProbeSettings, facts_chain, facts_line
from cortiq.model import load_model
from cortiq.tokenizer import load_tokenizer

from tiny import llama_arch, write_random


def test_facts_chain_compares_with_the_source_and_reuses_its_scores(tmp_path):
    src = write_random(tmp_path / "s.cmf", llama_arch(), seed=1)
    other = write_random(tmp_path / "o.cmf", llama_arch(), seed=2)
    run = LocalRunner(tmp_path / "work", tracking.NULL, False)
    s = ProbeSettings(part="dev", device="cpu")
    got = facts_chain(run, {"source": src, "same": src, "other": other}, s)
    facts = load_facts("dev")
    want = score_facts(load_model(other), encode_facts(facts, load_tokenizer(other)))
    base = score_facts(load_model(src), encode_facts(facts, load_tokenizer(src)))
    assert got["other"]["known"] == int(want.known.sum()) and got["other"]["facts"] == len(facts)
    assert got["other"]["kept"] == int((want.known & base.known).sum())
    assert got["same"]["kept"] == got["same"]["source_known"] == int(base.known.sum())
    # the source's scores are one stage output, made once
    assert run.results["facts.same"]["path"] == run.results["facts.source"]["path"]
    again = LocalRunner(tmp_path / "work", tracking.NULL, False)
    facts_chain(again, {"source": src}, s)
    assert again.results["facts.source"]["reused"]
    assert facts_line(got).startswith(f"facts kept (the fact probe's dev part, {len(facts)} facts): same ")
