"""The knowledge retain source: entities parsed from the model's lists, its greedy answers to
the filled templates as tdata, the fact probe's prompts never among them, cached as a stage."""

from __future__ import annotations

import pytest

from cortiq.data import knowledge as K
from cortiq.data.retain import source_name
from cortiq.data.stages import cli_runner, retain_tdata
from cortiq.data.settings import RetainSettings
from cortiq.data.tdata import Tdata
from cortiq.facts import holds_probe_fact
from cortiq.model import load_model
from cortiq.model.generate import generate
from cortiq.tokenizer import load_tokenizer

from data_helpers import tiny_model_cmf


@pytest.fixture(scope="module")
def model_cmf(tmp_path_factory):
    return tiny_model_cmf(tmp_path_factory.mktemp("knowledge") / "m.cmf", seed=4)


def test_parse_entities_reads_a_models_list():
    text = ("France\n2. Germany - a country in Europe\n3) United States of America (USA)\n4. france\n"
            "5. **Japan**\n6. 42\n7. A name that runs on and on past five words\n\n8. Côte d'Ivoire, Africa")
    assert K.parse_entities(text) == ["France", "Germany", "United States of America", "Japan", "Côte d'Ivoire"]


def _entities(monkeypatch):
    ents = {"country": ["France", "Narnia"], "animal": ["cat"]}
    monkeypatch.setattr(K, "_entities", lambda *a, **k: ents)
    return ents


def test_records_are_the_models_greedy_answers_and_never_a_probe_fact(model_cmf, tmp_path, monkeypatch):
    ents = _entities(monkeypatch)
    s = K.KnowledgeSettings(answer_tokens=6, lead_tokens=9, slots=4, device="cpu", fractions=(1.0, 0.0, 0.0))
    from cortiq import runner
    from cortiq.data.stages import KNOWLEDGE

    res = runner.run(KNOWLEDGE, tmp_path, progress=False, model=str(model_cmf), settings=s)
    td = Tdata.open(res["path"])
    tok, m = load_tokenizer(model_cmf), load_model(model_cmf)
    filled = {p: lead for _, p, lead in K.fill(ents)}
    assert "The capital of France is" in filled  # a probe prompt the filter must drop
    got = {}
    for r in td.records():
        prompt = tok.decode(r.ids[: r.first].tolist())
        got[prompt] = tok.decode(r.ids[r.first:].tolist())
        assert not holds_probe_fact(prompt + got[prompt])
    want = {p for p in filled if not holds_probe_fact(p)}
    assert "The capital of France is" not in got and "The capital of Narnia is" in got
    assert set(got) <= want
    for p in want:  # each kept prompt's answer is the model's greedy line; the others had none
        greedy = generate(m, tok.encode(p, add_special_tokens=False).ids, max_new=9 if filled[p] else 6).tokens
        line = K.first_line(tok.decode(greedy))
        assert got[p] == line if p in got else not line.strip()


def test_knowledge_is_a_retain_source_cached_as_a_stage(model_cmf, tmp_path, monkeypatch):
    calls = []
    ents = _entities(monkeypatch)
    monkeypatch.setattr(K, "_entities", lambda *a, **k: calls.append(1) or ents)
    run = cli_runner(tmp_path, progress=False)
    a = retain_tdata("knowledge", model_cmf, RetainSettings(sources=["knowledge"]), run, tmp_path, progress=False)
    b = retain_tdata("knowledge", model_cmf, RetainSettings(sources=["knowledge"]), run, tmp_path, progress=False)
    assert a == b and len(calls) == 1 and source_name("knowledge") == "knowledge"
    assert {r.category for r in Tdata.open(a).records()} <= {"knowledge-country", "knowledge-animal"}
    # another seed is another stage output
    c = retain_tdata("knowledge", model_cmf, RetainSettings(sources=["knowledge"], seed=1), run, tmp_path,
                     progress=False)
    assert c != a and len(calls) == 2


def test_bad_knowledge_settings_say_so():
    from cortiq.errors import CortiqError

    with pytest.raises(CortiqError, match=r"knowledge settings: the train fraction must be positive"):
        K.KnowledgeSettings(fractions=(0.0, 0.5, 0.5))
    with pytest.raises(CortiqError, match=r"knowledge settings: fractions must be three non-negative numbers"):
        K.KnowledgeSettings(fractions=(0.5, 0.6, -0.1))
