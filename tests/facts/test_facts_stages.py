"""The facts stage: per-fact scores cached per model, compared with the source's."""

from __future__ import annotations

import json

from cortiq import tracking
from cortiq.runner import LocalRunner
from cortiq.facts import encode_facts, load_facts, score_facts
from cortiq.facts.stages import LOST_SHOWN, SCORES, ProbeSettings, facts_chain, facts_from, facts_line
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


def _scores(path, known, first_top, now):
    path.mkdir()
    (path / SCORES).write_text(json.dumps({"part": "dev", "known": known, "logprob": [0.0] * len(known),
                                           "first_top": first_top, "now": now}))
    return {"path": str(path)}


def test_facts_from_names_the_first_facts_the_model_lost(tmp_path):
    facts = load_facts("dev")
    n = len(facts)
    src = [i % 3 != 0 for i in range(n)]  # the source knows two facts in three
    healed = [k and i not in (1, 2, 4, 7, 8) for i, k in enumerate(src)]  # and the model lost five of them
    now = [f"w{i}" for i in range(n)]
    results = {"facts.source": _scores(tmp_path / "s", src, [0] * n, [""] * n),
               "facts.healed": _scores(tmp_path / "h", healed, list(range(n)), [" " + w for w in now])}
    got = facts_from(results, ("source", "healed"), part="dev")["healed"]
    assert got["kept"] == sum(src) - 5 and got["source_known"] == sum(src)
    assert got["lost"] == [{"prompt": facts[i].prompt, "answer": facts[i].answer, "now": " " + now[i]}
                           for i in (1, 2, 4)][:LOST_SHOWN]
    head, lost = facts_line({"healed": got}).split("\n")
    share = f"({100 * (sum(src) - 5) / sum(src):.0f} %)"
    # every log-prob 0 here: the source is sure of every fact it knows, so the sure part counts the same
    assert head.endswith(f"healed {sum(src) - 5} of the source's {sum(src)} {share}; of the {sum(src)} the source "
                         f"is sure of (answer p >= 0.5): healed {sum(src) - 5} {share}")
    assert lost == "  healed lost, among others: " + "; ".join(f"{facts[i].prompt} {facts[i].answer} (now 'w{i}')"
                                                                for i in (1, 2, 4))
    # a model that lost none: no second line
    results["facts.same"] = _scores(tmp_path / "same", src, [0] * n, [""] * n)
    same = facts_from(results, ("source", "same"), part="dev")
    assert same["same"]["lost"] == [] and "\n" not in facts_line(same)
