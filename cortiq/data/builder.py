"""Build a tdata directory: read sources, cut plain text, render chats, tokenize, split, write.

Tokenizing goes through the tokenizer's `encode_batch` (Rust, all cores); the
Python loops here run over paragraphs and records, never over tokens.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .. import store
from ..errors import CortiqError
from .settings import BuildSettings
from .chats import chat_parts
from .sources import _LINE_END, _SENT_END, Document, Item, _cut_at, line_parts, read_source
from .tdata import SPLITS, STAGE, VERSION, Record, Tdata, assign_splits, tokenizer_digest, write_tdata


# ── cutting plain text ───────────────────────────────────────────────────


def chars_per_token(tok) -> int:
    """At most this many characters of text make one token: the longest vocabulary entry, four
    times over (a normalizer may compose several characters into one). A text longer than n
    times it holds more than n tokens, known without tokenizing it."""
    return 4 * max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def _count(tok, texts: list[str], limit: int, span: int) -> list[int]:
    """Token counts of `texts`; a text too long to have at most `limit` tokens counts limit + 1,
    untokenized (so no text of more than limit * span characters is ever tokenized here)."""
    short = [t for t in texts if len(t) <= limit * span]
    counts = iter([len(e.ids) for e in tok.encode_batch(short, add_special_tokens=False)] if short else [])
    return [next(counts) if len(t) <= limit * span else limit + 1 for t in texts]


#: characters counted (and records tokenized) in one tokenizer call: enough for its threads,
#: little next to a corpus
BATCH = 1 << 16

#: what a unit of each level is cut at when it is over the record size: a paragraph at lines,
#: a line at sentences (a sentence is not cut)
PARA, LINE, SENT = 0, 1, 2
_CUT = {PARA: _LINE_END, LINE: _SENT_END}
_BLANK = re.compile(r"[ \t]*\n")  # a line that, after a line, ends a paragraph (sources._PARA_END)
_SPACES = re.compile(r"[ \t]*")


def _pieces(tok, units: list[tuple[int, str]], limit: int, span: int) -> list[list[tuple[str, int]]]:
    """The (piece, token count) of each (level, text) unit, in order: a unit of at most `limit`
    tokens is one piece; a paragraph or line over it is cut a level down (one batched count a level)."""
    counts = _count(tok, [t for _, t in units], limit, span)
    out = [[(t, c)] for (_, t), c in zip(units, counts)]
    over = [i for i, ((lv, _), c) in enumerate(zip(units, counts)) if c > limit and lv < SENT]
    if over:
        subs = [[(units[i][0] + 1, p) for p in _cut_at(units[i][1], _CUT[units[i][0]])] for i in over]
        got = iter(_pieces(tok, [u for sub in subs for u in sub], limit, span))
        for i, sub in zip(over, subs):
            out[i] = [p for _ in sub for p in next(got)]
    return out


class _UnitReader:
    """`_units`' reading state: the paragraph, the line and (for a long line) the sentence
    being read, fed one part of a line at a time."""

    def __init__(self, where: str, limit_chars: int, max_tokens: int | None, span: int):
        self.where, self.limit_chars, self.max_tokens = where, limit_chars, max_tokens
        self.max_chars = None if max_tokens is None else max_tokens * span
        self.para: list[str] = []  # the paragraph's lines while it is within limit_chars
        self.size, self.over = 0, False  # its characters; whether it is past limit_chars (its lines are units)
        self.run, self.body = 0, False  # blank lines ending it so far; whether it has a line that is not blank
        self.line: list[str] = []  # the parts of the line being read
        self.width, self.spaces = 0, True  # its characters; whether they are all spaces and tabs
        self.sent: str | None = None  # once the line is past limit_chars: its text not yet cut into sentences
        self.n = 0  # lines read

    def read(self, part: str, ends: bool) -> Iterator[tuple[int, str]]:
        """The units complete once `part` (a part of a line; `ends`: the line's last) is read."""
        if self.sent is not None:  # a long line, cut into sentences as it is read
            self.sent += part
            yield from self._sentences(ends)
        else:
            self.line.append(part)
            self.width += len(part)
            self.spaces = self.spaces and _SPACES.fullmatch(part.removesuffix("\n")) is not None
            if ends:
                text = "".join(self.line)
                if _BLANK.fullmatch(text):
                    self.run += 1
                else:
                    yield from self._begin_line()
                yield from self._add_line(text)
            elif not self.spaces and self.width > self.limit_chars:  # a long line: its paragraph is over, its sentences are units
                yield from self._begin_line()
                if not self.over:
                    yield from self._spill()
                self.sent = "".join(self.line)
                yield from self._sentences(False)
            elif self.max_chars is not None and self.width > self.max_chars:
                raise CortiqError(f"{self.where}:{self.n + 1}: a line of more than {self.max_chars} spaces: its record "
                                  f"has more than max_tokens {self.max_tokens} tokens")
        if ends:
            self.n += 1
            self.line, self.width, self.spaces, self.sent = [], 0, True, None

    def end(self) -> Iterator[tuple[int, str]]:
        """The last paragraph, once the text is read."""
        if self.para:
            yield PARA, "".join(self.para)

    def _begin_line(self) -> Iterator[tuple[int, str]]:
        # a line that is not blank: after a run of blank lines that follows a line, a new paragraph
        if self.run and (self.body or self.run >= 2):
            if self.para:
                yield PARA, "".join(self.para)
            self.para, self.size, self.over = [], 0, False
        self.run, self.body = 0, True

    def _add_line(self, text: str) -> Iterator[tuple[int, str]]:
        if self.over:
            yield LINE, text
            return
        self.para.append(text)
        self.size += len(text)
        if self.size > self.limit_chars:
            yield from self._spill()

    def _spill(self) -> Iterator[tuple[int, str]]:
        # the paragraph is past limit_chars: its lines so far are units, and so is each line after
        self.over = True
        for t in self.para:
            yield LINE, t
        self.para = []

    def _sentences(self, final: bool) -> Iterator[tuple[int, str]]:
        # cut after each run of whitespace that follows an end of sentence; the last run is
        # final only when something follows it (it may go on in the next part)
        pieces = _cut_at(self.sent, _SENT_END)
        keep = [] if final else [pieces.pop()]
        for p in pieces:
            yield SENT, p
        self.sent = keep[0] if keep else None
        if self.sent is not None and self.max_chars is not None and len(self.sent) > self.max_chars:
            raise CortiqError(f"{self.where}:{self.n + 1}: a sentence of more than {self.max_chars} characters: its "
                              f"record has more than max_tokens {self.max_tokens} tokens")


def _units(chunks: Iterable[str], where: str, limit_chars: int, max_tokens: int | None,
           span: int) -> Iterator[tuple[int, str]]:
    """The units of a text, in order, read from `chunks` holding about limit_chars characters at
    most: whole paragraphs of at most limit_chars characters; the lines of a longer paragraph;
    the sentences of a line longer still, cut as it is read. Cutting these units as `_pieces`
    does gives the pieces `_cut_at` would give on the whole text (a unit of more than limit_chars
    characters counts as over the limit untokenized, so it is cut whole or in parts alike). A
    sentence of more than max_tokens * span characters (so of more than max_tokens tokens) is
    refused as it is read. Paragraphs end after a run of blank lines that follows a line (sources._PARA_END)."""
    reader = _UnitReader(where, limit_chars, max_tokens, span)
    for part, ends in line_parts(chunks, limit_chars):
        yield from reader.read(part, ends)
    yield from reader.end()


def _pack(pieces: Iterable[tuple[str, int]], record_tokens: int, state: list) -> Iterator[str]:
    """Records of pieces packed in order while their counts stay within record_tokens (a piece
    over it alone); `state` ([pieces, count]) carries the record being packed from one call to
    the next, and the caller ends with what is left in it."""
    for p, c in pieces:
        if state[0] and state[1] + c > record_tokens:
            yield "".join(state[0])
            state[0], state[1] = [], 0
        state[0].append(p)
        state[1] += c


def cut_stream(tok, chunks: Iterable[str], record_tokens: int, span: int, where: str = "text",
               max_tokens: int | None = None, batch: int | None = None) -> Iterator[str]:
    """Contiguous pieces of the text `chunks` spell (they join back to it exactly), each up to
    ~record_tokens tokens: whole paragraphs packed together; a paragraph alone over the limit is
    cut at lines, then sentences. Read, counted and packed in batches of about `batch` characters,
    so memory is bounded by the record size and the batch, not by the text or its longest line;
    no piece is tokenized that is too long to be within the limit (`span`: chars_per_token); a
    sentence too long to be within `max_tokens` is refused as soon as that is known."""
    state: list = [[], 0]
    units, size, batch = [], 0, batch or BATCH
    for u in _units(chunks, where, record_tokens * span, max_tokens, span):
        units.append(u)
        size += len(u[1])
        if size >= batch:
            yield from _pack((p for ps in _pieces(tok, units, record_tokens, span) for p in ps), record_tokens, state)
            units, size = [], 0
    if units:
        yield from _pack((p for ps in _pieces(tok, units, record_tokens, span) for p in ps), record_tokens, state)
    if state[0]:
        yield "".join(state[0])


def cut_text(tok, text: str, record_tokens: int, span: int | None = None) -> list[str]:
    """`cut_stream` of one text held whole."""
    return list(cut_stream(tok, [text], record_tokens, span or chars_per_token(tok)))


# ── the build ────────────────────────────────────────────────────────────


def inputs_of(sources: list[str], tokenizer: str | os.PathLike, settings: BuildSettings) -> list[str]:
    """Digests of everything a build reads (the sources, the tokenizer, the generating model)."""
    out = []
    for s in sources:
        if s.startswith("corpus:"):
            from .sources import corpus_documents

            h = hashlib.sha256()
            for d in corpus_documents(s.split(":", 1)[1]):
                h.update(d.stem.encode() + b"\0" + d.text.encode())
            out.append(h.hexdigest()[:32])
        else:
            from .sources import expand

            out += [store.file_digest(p) for p in expand(s)]
    out.append(store.file_digest(tokenizer))
    if settings.generate_with:
        out.append(store.file_digest(settings.generate_with))
    return out


def build_digest(sources: list[str], tokenizer: str | os.PathLike, settings: BuildSettings) -> str:
    return store.digest(STAGE, VERSION, asdict(settings), inputs_of(sources, tokenizer, settings))


def _sample_key(rid: str) -> bytes:
    # salted: the splits hash the rid too, and an unsalted order would fill the train split first
    return hashlib.sha256(b"sample:" + rid.encode()).digest()


class _Kept:
    """The records kept as they stream by, in their own order. Under a total-token `cap` (0: all),
    those first in the order of a hash of their rid while the running total stays within the cap
    (at least one): the same records as sorting them all would keep, with only about the cap's
    tokens held. A record's place in that order is decided as it comes: once the records before a
    rid's hash fill the cap, no later record can make room for it again."""

    def __init__(self, cap: int):
        self.cap, self.total, self.seq = cap, 0, 0
        self.heap: list = []  # (-hash, seq, record, given split): the kept ones, the largest hash first
        self.bar: int | None = None  # the smallest hash left out: no record above it is ever kept

    def left_out(self, rid: str) -> bool:
        """Whether a record of this rid cannot be kept, whatever its length (known untokenized)."""
        return self.bar is not None and int.from_bytes(_sample_key(rid), "big") > self.bar

    def add(self, rec: Record, split: str | None) -> None:
        self.seq += 1
        if not self.cap:
            self.heap.append((0, self.seq, rec, split))
            return
        h = int.from_bytes(_sample_key(rec.rid), "big")
        if self.bar is not None and h > self.bar:
            return
        heapq.heappush(self.heap, (-h, self.seq, rec, split))
        self.total += len(rec.ids)
        while self.total > self.cap and len(self.heap) > 1:
            nh, _, out, _ = heapq.heappop(self.heap)
            self.total -= len(out.ids)
            self.bar = -nh if self.bar is None else min(self.bar, -nh)

    def records(self) -> tuple[list[Record], list[str | None]]:
        kept = sorted(self.heap, key=lambda x: x[1])
        return [x[2] for x in kept], [x[3] for x in kept]


class _RidsSeen:
    """Record ids already used, and where. A text's records are "STEM:K" for K = 0, 1, ...: they
    are kept as a count per stem (not one entry per record), the JSONL ones one by one."""

    def __init__(self):
        self.stems: dict[str, tuple[str, int]] = {}  # stem -> (where its records are, how many)
        self.ids: dict[str, str] = {}

    def check(self, rid: str, where: str, text: tuple[str, str, int] | None = None) -> None:
        if text is not None:  # (stem, the document, K)
            stem, doc, k = text
            if k == 0 and stem in self.stems:  # another text of this stem made record 0 too
                raise CortiqError(f"{where}: record id {rid!r} already used at {self.stems[stem][0]} (record 0)")
            self.stems[stem] = (doc, k + 1)
            return
        stem, _, k = rid.rpartition(":")
        if k.isdigit() and str(int(k)) == k and int(k) < self.stems.get(stem, ("", 0))[1]:
            raise CortiqError(f"{where}: record id {rid!r} already used at {self.stems[stem][0]} (record {k})")
        if rid in self.ids:
            raise CortiqError(f"{where}: record id {rid!r} already used at {self.ids[rid]}")
        self.ids[rid] = where


#: (rid, given split, category, where, prompt, answer, BOS first?, (stem, document, K) of a text's
#: record) of a record before tokenizing
_Raw = tuple[str, "str | None", str, str, str, str, bool, "tuple[str, str, int] | None"]


def _text_raws(docs: list[Document], tok, settings: BuildSettings, span: int) -> Iterator[_Raw]:
    """The records of plain texts, each cut as it is read; all answer, scored from their second token."""
    for d in docs:
        pieces = cut_stream(tok, d.chunks(), settings.record_tokens, span, d.where, settings.max_tokens)
        for k, piece in enumerate(pieces):
            yield f"{d.stem}:{k}", None, d.category, f"{d.where} (record {k})", "", piece, True, (d.stem, d.where, k)


def _item_raws(items: Iterable[Item], tdoc: dict, bos_s: str, eos_s: str) -> Iterator[_Raw]:
    """The records of JSONL items: a text's is all answer; a pair's prompt and answer; a chat's
    its template's rendering (which writes its own BOS)."""
    for it in items:
        if it.kind == "text":
            p, a = "", it.text
        elif it.kind == "pair":
            if it.answer is None:
                raise CortiqError(f"{it.where}: a prompt with no 'answer' (give one, or build with --generate-with MODEL.cmf)")
            p, a = it.prompt, it.answer
        else:
            p, a = chat_parts(it, tdoc.get("chat_template"), bos_s or "", eos_s)
        if not a:
            raise CortiqError(f"{it.where}: the answer is empty")
        yield it.rid, it.split, it.category, it.where, p, a, it.kind != "chat", None


def _batches(raws: Iterable[_Raw], chars: int) -> Iterator[list[_Raw]]:
    """Raw records in lists of about `chars` characters (one tokenizer call each)."""
    out, n = [], 0
    for r in raws:
        out.append(r)
        n += len(r[4]) + len(r[5])
        if n >= chars:
            yield out
            out, n = [], 0
    if out:
        yield out


def _read_sources(sources: list[str], settings: BuildSettings, span: int, cmf, device: str | None,
                  progress: Callable[[str], None] | None) -> tuple[Iterable[Item], list[Document]]:
    """(the JSONL items of `sources`, answered by the generating model when the settings name
    one; their plain-text documents)."""
    items: list[Iterable[Item]] = []
    docs: list[Document] = []
    for s in sources:
        i, d = read_source(s, settings.category, max_chars=settings.max_tokens * span)
        items.append(i)
        docs += d
    items_all: Iterable[Item] = (it for i in items for it in i)
    if settings.generate_with:
        from .generate import generate_answers

        items_all = list(items_all)  # the prompts are answered in one batch on the decode engine
        if progress:
            progress(f"generating answers with {settings.generate_with}")
        generate_answers(items_all, settings.generate_with, cmf, settings.max_new, device, progress)
    return items_all, docs


def _tokenize(raws: Iterable[_Raw], tok, cmf, tokenizer, settings: BuildSettings, span: int,
              progress: Callable[[str], None] | None) -> _Kept:
    """The raw records checked (ids used once, within max_tokens) and tokenized a batch at a
    time into the sample kept."""
    tdoc = cmf.tokenizer or {}
    bos_id, vocab = tdoc.get("bos_id"), cmf.arch.vocab_size
    kept = _Kept(settings.max_total_tokens)
    ids_seen = _RidsSeen()
    head = [bos_id] if bos_id is not None else []
    tail = [cmf.eos_id] if settings.eos else []
    n = 0
    for batch in _batches(raws, BATCH):
        for rid, _, _, w, p, a, _, text in batch:
            ids_seen.check(rid, w, text)
            if len(p) + len(a) > settings.max_tokens * span:  # refused untokenized: too many characters
                raise CortiqError(f"{w}: record {rid!r} has more than max_tokens {settings.max_tokens} tokens "
                                  f"({len(p) + len(a)} characters)")
        n += len(batch)
        if progress:
            progress(f"tokenizing: {n} records")
        # a record the sample can no longer keep is not tokenized (nor checked against max_tokens)
        batch = [r for r in batch if not kept.left_out(r[0])]
        p_enc = tok.encode_batch([r[4] for r in batch], add_special_tokens=False)
        a_enc = tok.encode_batch([r[5] for r in batch], add_special_tokens=False)
        for (rid, split, cat, w, _, _, bos, _), pe, ae in zip(batch, p_enc, a_enc):
            pre = (head if bos else []) + pe.ids
            ids = np.array(pre + ae.ids + tail, dtype=np.uint32)
            if len(ids) > settings.max_tokens:
                raise CortiqError(f"{w}: record {rid!r} has {len(ids)} tokens, more than max_tokens {settings.max_tokens}")
            if len(ids) and int(ids.max()) >= vocab:
                raise CortiqError(f"{tokenizer}: its tokenizer makes id {int(ids.max())}, outside the model's "
                                  f"vocabulary ({vocab} ids)")
            kept.add(Record(rid, "", cat, ids, max(1, len(pre))), split)
    return kept


def _split_records(kept: _Kept, fractions) -> list[Record]:
    """The records kept, each in its split (given, or by a hash of its id); an empty split that
    the fractions call for is refused."""
    records, splits_given = kept.records()
    rids = [r.rid for r in records]
    splits = assign_splits(rids, splits_given, fractions)
    hashed = [g is None for g in splits_given]
    for r, s in zip(records, splits):
        r.split = s
    for s, f in zip(SPLITS, fractions):
        if s == "train" or (f > 0 and any(hashed)):
            if not any(x == s for x in splits):
                raise CortiqError(f"the {s} split is empty: {sum(hashed)} records split {fractions[0]:g}/"
                                  f"{fractions[1]:g}/{fractions[2]:g} left none there "
                                  f"(more data, other --fractions, or name splits in the JSONL)")
    return records


def build(sources: list[str], tokenizer: str | os.PathLike, out: str | os.PathLike, settings: BuildSettings | None = None,
          progress: Callable[[str], None] | None = None, device: str | None = None, force: bool = False) -> Tdata:
    """Tokenize `sources` (paths, or `corpus:NAME`) with the tokenizer of the CMF file `tokenizer`
    into the tdata directory `out` (written whole or not at all; meta.json last). An existing `out`
    is replaced when it is tdata or empty, anything else only with `force` (store.check_output).

    Sources stream: plain text is read, cut, tokenized and sampled a batch at a time, JSONL a
    line at a time, so memory is bounded by the records kept (`max_total_tokens`) and the batch,
    not by the size of a file or its longest line; a record over max_tokens is refused as soon
    as it is known to be (a text without breaks as soon as max_tokens' worth of it is read)."""
    from ..cmf import open_cmf
    from ..tokenizer import from_doc

    settings = settings or BuildSettings()
    if not sources:
        raise CortiqError("no sources to build data from")
    store.check_output(out, [*sources, tokenizer, settings.generate_with], folder=True, kind="tdata", force=force)
    cmf = open_cmf(tokenizer)
    tdoc = cmf.tokenizer or {}
    tok = from_doc(tdoc, str(tokenizer))
    eos_id, bos_id = cmf.eos_id, tdoc.get("bos_id")
    span = chars_per_token(tok)
    items, docs = _read_sources(sources, settings, span, cmf, device, progress)
    bos_s = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos_s = tok.id_to_token(eos_id) or ""
    raws = (r for part in (_text_raws(docs, tok, settings, span), _item_raws(items, tdoc, bos_s, eos_s))
            for r in part)
    kept = _tokenize(raws, tok, cmf, tokenizer, settings, span, progress)
    if not kept.heap:
        raise CortiqError(f"no records in {', '.join(sources)}")
    records = _split_records(kept, settings.fractions)
    meta = {
        "stage": STAGE, "version": VERSION, "digest": build_digest(sources, tokenizer, settings),
        "settings": asdict(settings), "inputs": {"sources": list(sources), "tokenizer": str(tokenizer)},
        "tokenizer_digest": tokenizer_digest(tdoc["json"]), "vocab_size": cmf.arch.vocab_size, "eos_id": eos_id,
        "bos_id": bos_id,
    }
    return write_tdata(out, records, meta)
