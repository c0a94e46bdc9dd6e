"""Self-generated text: the batched, continuously refilled generator against the plain decoder,
and the SELFGEN stage (tdata out, reproducible by seed, taken from the cache the second time)."""

import numpy as np
import pytest

from cortiq.data.selfgen import REQUESTS, SelfGenSettings, generate_rows
from cortiq.data.stages import SELFGEN, self_tdata
from cortiq.data.tdata import Tdata
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.model.generate import generate
from cortiq.tokenizer import load_tokenizer

from data_helpers import EOS, tiny_model_cmf


@pytest.fixture(scope="module")
def model_cmf(tmp_path_factory):
    return tiny_model_cmf(tmp_path_factory.mktemp("selfgen") / "m.cmf", seed=3)


def _prompts(n, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, size=int(g.integers(1, 12))).tolist() for _ in range(n)]


def test_batched_varied_lengths_equal_the_plain_greedy_decoder(model_cmf):
    """Prompts of 1 to 11 tokens in one batch of 3 slots (so rows end and slots are refilled
    mid-run), blocks of 4 steps: every row is the plain decoder's greedy continuation of its
    prompt alone, token for token, ending at the same EOS."""
    m = load_model(model_cmf)
    prompts = _prompts(7)
    plain = [generate(m, p, max_new=13).tokens for p in prompts]
    # an end token the rows really write mid-way (the random model seldom writes its EOS)
    mids = [t for r in plain for t in r[2:9]]
    stop = max(set(mids), key=mids.count)
    want = [r[: r.index(stop) + 1] if stop in r else r for r in plain]  # what generate(..., eos_ids=[stop]) gives
    assert any(len(w) < 13 for w in want) and any(len(w) == 13 for w in want)
    got = generate_rows(m, prompts, 13, eos_ids=[stop], slots=3, block=4)
    assert [g.tolist() for g in got] == want


def test_a_token_total_is_exact_and_sampling_follows_the_seed(model_cmf, monkeypatch):
    m = load_model(model_cmf)
    got = generate_rows(m, iter(_prompts(200)), 10, total=57, slots=4, max_prompt=11, block=3)
    assert sum(len(g) for g in got) == 57 and all(1 <= len(g) <= 10 for g in got)
    # a small total decodes on no more slots than rows can be live at once: total // max_new + 1
    from cortiq.model import decode

    made = []
    init = decode.DecodeEngine.__init__
    monkeypatch.setattr(decode.DecodeEngine, "__init__", lambda self, *a, **k: (made.append(k["slots"]), init(self, *a, **k))[1])
    got = generate_rows(m, iter(_prompts(200)), 10, total=57, slots=64, max_prompt=11, block=3)
    assert made == [6] and sum(len(g) for g in got) == 57
    assert generate_rows(m, [], [], total=57) == []  # no prompts: no budgets to bound the slots by, nothing made
    a = generate_rows(m, _prompts(6), 9, temperature=1.0, slots=4, seed=5)
    b = generate_rows(m, _prompts(6), 9, temperature=1.0, slots=4, seed=5)
    c = generate_rows(m, _prompts(6), 9, temperature=1.0, slots=4, seed=6)
    assert [x.tolist() for x in a] == [x.tolist() for x in b] != [x.tolist() for x in c]
    with pytest.raises(CortiqError, match=r"^generate: a prompt of 12 tokens \(need 1 to 11\)$"):
        generate_rows(m, iter([[1] * 12]), 4, max_prompt=11)


def test_selfgen_writes_tdata_reproducible_by_seed_and_cached(model_cmf, tmp_path):
    s = SelfGenSettings(tokens=300, max_new=24, slots=8, device="cpu", seed=1)
    d = self_tdata(model_cmf, s, tmp_path / "a", progress=False)
    td = Tdata.open(d)
    recs = td.records()
    assert td.meta["stage"] == "tdata" and td.meta["eos_id"] == EOS
    # the generated tokens are scored, the opening is not; every opening kind is there
    assert sum(len(r.ids) - r.first for r in recs) == 300
    assert {r.category for r in recs} == {"self-bos", "self-chat", "self-corpus"}
    tok = load_tokenizer(model_cmf)
    for r in recs:
        opening = tok.decode(r.ids[: r.first].tolist(), skip_special_tokens=False)
        if r.category == "self-bos":
            assert r.first == 1 and r.ids[0] == EOS  # the byte tokenizer has no BOS: the EOS opens
        elif r.category == "self-chat":  # no template in the model: the plain chat text around a request
            assert opening.startswith("user: ") and opening.endswith("\n\nassistant: ")
            assert opening[len("user: "):-len("\n\nassistant: ")] in REQUESTS
        else:
            assert r.ids[0] == EOS and 4 <= r.first - 1 <= 32
    # the same seed elsewhere: identical ids; another seed: other text
    again = Tdata.open(self_tdata(model_cmf, s, tmp_path / "b", progress=False))
    assert [r.ids.tolist() for r in again.records()] == [r.ids.tolist() for r in recs]
    other = Tdata.open(self_tdata(model_cmf, SelfGenSettings(**{**s.__dict__, "seed": 2}), tmp_path / "a", progress=False))
    assert [r.ids.tolist() for r in other.records()] != [r.ids.tolist() for r in recs]
    # the second time from the cache: the stage does not run
    from cortiq import runner

    res = runner.run(SELFGEN, tmp_path / "a", progress=False, model=model_cmf, settings=s)
    assert res["reused"] and res["path"] == str(d)


def test_asked_openings_take_their_share_of_the_chat_draws_each_once(model_cmf):
    """With `ask`, a chat draw takes the next asked opening (in order, never twice) with probability
    `ask`, and the list's requests once the pool is spent; with ask 0 the openings are the default's."""
    from itertools import islice

    from cortiq.cmf import open_cmf
    from cortiq.data.selfgen import Openings

    f = open_cmf(model_cmf)
    pool = [[1, 2, 3], [4, 5], [6]]
    s = SelfGenSettings(mix=(0.0, 1.0, 0.0), ask=1.0, seed=0)
    op = Openings(f, s, pool)
    got = list(islice(iter(op), 6))
    assert got[:3] == pool and op.kinds == ["asked"] * 3 + ["chat"] * 3
    plain = SelfGenSettings(mix=(0.25, 0.5, 0.25), seed=4)
    assert list(islice(iter(Openings(f, plain, pool)), 40)) == list(islice(iter(Openings(f, plain)), 40))
    half = Openings(f, SelfGenSettings(mix=(0.0, 1.0, 0.0), ask=0.5, seed=0), [[7]] * 400)
    list(islice(iter(half), 400))
    assert 150 < half.kinds.count("asked") < 250


def test_selfgen_with_ask_records_the_models_own_requests(tmp_path, monkeypatch):
    """A model with a chat template: SELFGEN's asked openings are that template around requests the
    model sampled, recorded as their own category; the key of ask 0 is the key without the field."""
    from data_helpers import tiny_model_cmf

    from functools import partial

    from cortiq import runner
    from cortiq.data import selfgen

    # a random model rarely ends a request within the 64 tokens a real one takes: give it room
    monkeypatch.setattr(selfgen, "asked_openings", partial(selfgen.asked_openings, longest=250))
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    path = tiny_model_cmf(tmp_path / "chat.cmf", seed=3, chat_template=tpl)
    s = SelfGenSettings(tokens=400, max_new=24, slots=8, device="cpu", seed=1, mix=(0.0, 1.0, 0.0), ask=1.0)
    recs = Tdata.open(self_tdata(path, s, tmp_path / "a", progress=False)).records()
    tok = load_tokenizer(path)
    asked = [r for r in recs if r.category == "self-asked"]
    assert asked
    for r in asked:
        opening = tok.decode(r.ids[: r.first].tolist(), skip_special_tokens=False)
        assert opening.startswith("<user>") and opening.endswith("<a>") and opening[6:-3] not in REQUESTS
    assert len({tuple(r.ids[: r.first].tolist()) for r in asked}) == len(asked)
    assert runner.key_of(SELFGEN, SelfGenSettings()) == runner.key_of(SELFGEN, SelfGenSettings(ask=0.0))
    assert "ask" not in runner.key_of(SELFGEN, SelfGenSettings())
    assert runner.key_of(SELFGEN, SelfGenSettings(ask=0.5)) != runner.key_of(SELFGEN, SelfGenSettings())
