"""Sources stream: the build cuts, tokenizes and samples a text a batch at a time, with the same
records as cutting the whole text at once, and memory bounded by the batch and the kept records."""

import hashlib
import importlib
import json
import random
import re
import shutil
import tracemalloc

import numpy as np
import pytest

from cortiq.data import BuildSettings, build
from cortiq.data.sources import _LINE_END, _PARA_END, _SENT_END, _cut_at, corpus_documents, decoded
from cortiq.data.tdata import assign_splits
from cortiq.errors import CortiqError
from cortiq.tokenizer import load_tokenizer

B = importlib.import_module("cortiq.data.builder")


# ── the plain reference: the whole text read at once, cut, tokenized, then sampled ──

def _count_ref(tok, texts, limit, span):
    return [len(tok.encode(t, add_special_tokens=False).ids) if len(t) <= limit * span else limit + 1 for t in texts]


def cut_text_ref(tok, text, record_tokens, span):
    pieces = []
    for p, c in zip(paras := _cut_at(text, _PARA_END), _count_ref(tok, paras, record_tokens, span)):
        if c <= record_tokens:
            pieces.append((p, c))
            continue
        for line, lc in zip(lines := _cut_at(p, _LINE_END), _count_ref(tok, lines, record_tokens, span)):
            if lc <= record_tokens:
                pieces.append((line, lc))
            else:
                sents = _cut_at(line, _SENT_END)
                pieces += list(zip(sents, _count_ref(tok, sents, record_tokens, span)))
    out, cur, n = [], [], 0
    for p, c in pieces:
        if cur and n + c > record_tokens:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += c
    return out + (["".join(cur)] if cur else [])


def build_ref(paths, tok_cmf, s):
    """(rid, split, ids, first) of plain text files built whole: read, cut, tokenized, sampled by sorting."""
    tok = load_tokenizer(tok_cmf)
    span = B.chars_per_token(tok)
    rids, ids = [], []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        for k, piece in enumerate(cut_text_ref(tok, text, s.record_tokens, span)):
            rids.append(f"{p.stem}:{k}")
            ids.append([] + tok.encode(piece, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")])
    keep = range(len(rids))
    if s.max_total_tokens:
        order = sorted(keep, key=lambda i: hashlib.sha256(b"sample:" + rids[i].encode()).digest())
        total = np.cumsum([len(ids[i]) for i in order])
        keep = sorted(order[:max(1, int(np.searchsorted(total, s.max_total_tokens, side="right")))])
    rids, ids = [rids[i] for i in keep], [ids[i] for i in keep]
    return list(zip(rids, assign_splits(rids, [None] * len(rids), s.fractions), ids, [1] * len(rids)))


def _records(td):
    return [(r.rid, r.split, r.ids.tolist(), r.first) for r in td.records()]


def _texts(tmp_path):
    """A few files of ordinary text: pydoc's topics with their blank lines, indents and long lines."""
    docs = corpus_documents("pydoc")
    out = []
    for k in range(3):
        p = tmp_path / f"doc{k}.txt"
        p.write_text("\n\n".join(d.text for d in docs[k * 12:(k + 1) * 12]) + "\r\n  \n\tend\r")
        out.append(p)
    return out


@pytest.mark.parametrize("cap", [0, 6000])
def test_streamed_build_equals_the_whole_file_build(cap, tmp_path, tok_cmf, monkeypatch):
    paths = _texts(tmp_path)
    # small chunks and batches: every text crosses many of them (a character of two bytes, a
    # \r\n and a paragraph's blank lines cut in two included)
    monkeypatch.setattr("cortiq.data.sources.CHUNK", 997)
    monkeypatch.setattr(B, "BATCH", 1500)
    s = BuildSettings(record_tokens=48, max_tokens=4096, max_total_tokens=cap)
    got = _records(build([str(p) for p in paths], tok_cmf, tmp_path / "td", s))
    ref = build_ref(paths, tok_cmf, s)
    assert got == ref and len(ref) > 50
    assert not cap or sum(len(r[2]) for r in got) <= cap < sum(len(r[2]) for r in build_ref(
        paths, tok_cmf, BuildSettings(record_tokens=48, max_tokens=4096)))


def test_cut_stream_equals_the_whole_text_cut(tok_cmf):
    """Random texts of words, spaces, tabs, blank lines and sentence ends, cut at random places."""
    tok = load_tokenizer(tok_cmf)
    span = B.chars_per_token(tok)
    alpha = ["a", "word", " ", "\t", "\n", "\n", "\n\n", " \n", ".", ". ", "! ", "?\n", ":  ", "x" * 40, "y" * 300]
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(alpha) for _ in range(rng.choice([5, 60, 600])))
        rt = rng.choice([2, 3, 5, 10, 40])
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.choice([0, 1, 5, 50]))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got = list(B.cut_stream(tok, chunks, rt, span, batch=rng.choice([1, 100, 1 << 16])))
        assert got == cut_text_ref(tok, text, rt, span), (rt, text[:80])
        # refusing while streaming: a sentence too long to be within max_tokens, and only then
        mt = rng.choice([rt, 2 * rt])
        try:
            streamed = list(B.cut_stream(tok, chunks, rt, span, max_tokens=mt))
            refused = any(len(p) > mt * span for p in streamed)  # the build's own check of each record
        except CortiqError:
            refused = True
        assert refused == any(len(p) > mt * span for p in got)


def test_a_large_one_line_file_is_built_in_bounded_memory(tmp_path, tok_cmf, monkeypatch):
    """3 MB on one line, sentences but no newline, under a 5000-token budget: the build keeps
    the budget's tokens, holding a small part of the file at any time (what it holds is set by
    the chunk and batch sizes, made small here so that a small file shows it)."""
    monkeypatch.setattr("cortiq.data.sources.CHUNK", 1 << 13)
    monkeypatch.setattr(B, "BATCH", 1 << 13)
    s = BuildSettings(record_tokens=64, max_tokens=128, max_total_tokens=5000)
    warm = tmp_path / "warm.txt"  # imports and first-call allocations before measuring
    warm.write_text("A warm up. " * 3000)
    build([str(warm)], tok_cmf, tmp_path / "w", s)
    src = tmp_path / "big.txt"
    sent = "The quick brown fox jumps over the lazy dog. "
    src.write_text(sent * (3_000_000 // len(sent)))
    size = src.stat().st_size
    tracemalloc.start()
    try:
        td = build([str(src)], tok_cmf, tmp_path / "td", s)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 3, f"peak {peak} bytes for a file of {size}"
    recs = td.records()
    assert 5000 - 128 < td.n_tokens <= 5000 and len(recs) == td.n_tokens // 46  # a sentence and the EOS each
    tok = load_tokenizer(tok_cmf)
    assert {tok.decode(r.ids[:-1].tolist()) for r in recs} == {sent}


def test_a_line_without_breaks_is_refused_once_max_tokens_of_it_is_read(tmp_path, tok_cmf):
    src = tmp_path / "flat.txt"
    src.write_text("short first line\n" + "abcdefghij" * 100_000)
    with pytest.raises(CortiqError, match=r"^.*flat\.txt:2: a sentence of more than 6656 characters: its record has "
                                          r"more than max_tokens 128 tokens$"):
        build([str(src)], tok_cmf, tmp_path / "td", BuildSettings(record_tokens=64, max_tokens=128))


def test_an_undecodable_byte_is_named_by_its_offset_in_the_file(tmp_path, tok_cmf):
    src = tmp_path / "bad.txt"
    raw = ("é" * 40_000).encode() + b"ok\xff"  # past several chunks; chunks cut characters in two
    src.write_bytes(raw)
    with pytest.raises(CortiqError, match=rf"bad\.txt: not UTF-8 text \(invalid start byte at byte {len(raw) - 1}\)$"):
        list(decoded(src))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        assert e.start == len(raw) - 1  # what the whole file's decoding says


def test_record_ids_across_texts_and_jsonl(tmp_path, tok_cmf):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "same.txt").write_text("one text\n")
    (tmp_path / "b" / "same.txt").write_text("another text\n")
    with pytest.raises(CortiqError, match=r"b/same\.txt \(record 0\): record id 'same:0' already used at "
                                          r".*a/same\.txt \(record 0\)$"):
        build([str(tmp_path / "a"), str(tmp_path / "b")], tok_cmf, tmp_path / "td")
    j = tmp_path / "j.jsonl"
    j.write_text(json.dumps({"id": "same:0", "text": "x"}) + "\n")
    with pytest.raises(CortiqError, match=r"j\.jsonl:1: record id 'same:0' already used at .*a/same\.txt \(record 0\)$"):
        build([str(tmp_path / "a"), str(j)], tok_cmf, tmp_path / "td")
    j.write_text(json.dumps({"id": "same:1", "text": "x"}) + "\n" + json.dumps({"id": "same:00", "text": "y"}) + "\n")
    td = build([str(tmp_path / "a"), str(j)], tok_cmf, tmp_path / "td", BuildSettings(fractions=(1, 0, 0)))
    assert sorted(r.rid for r in td.records()) == ["same:0", "same:00", "same:1"]
