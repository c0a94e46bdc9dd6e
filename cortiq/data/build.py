"""Build a tdata directory: read sources, cut plain text, render chats, tokenize, split, write.

Tokenizing goes through the tokenizer's `encode_batch` (Rust, all cores); the
Python loops here run over paragraphs and records, never over tokens.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from .. import store
from ..errors import CortiqError
from ..pipeline import Stage
from .settings import BuildSettings
from .chats import chat_parts
from .sources import _LINE_END, _PARA_END, _SENT_END, Document, Item, _cut_at, read_source
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


def cut_text(tok, text: str, record_tokens: int, span: int | None = None) -> list[str]:
    """Contiguous pieces of `text` (they join back to it exactly), each up to ~record_tokens tokens:
    whole paragraphs packed together; a paragraph alone over the limit is cut at lines, then sentences.
    A piece is tokenized only when it is short enough to be within the limit (`span`:
    chars_per_token), so the work is bounded by the record size, not by the longest line."""
    span = span or chars_per_token(tok)
    paras = _cut_at(text, _PARA_END)
    counts = _count(tok, paras, record_tokens, span)
    pieces: list[tuple[str, int]] = []
    for p, c in zip(paras, counts):
        if c <= record_tokens:
            pieces.append((p, c))
            continue
        for line, lc in zip(lines := _cut_at(p, _LINE_END), _count(tok, lines, record_tokens, span)):
            if lc <= record_tokens:
                pieces.append((line, lc))
            else:
                sents = _cut_at(line, _SENT_END)
                pieces += list(zip(sents, _count(tok, sents, record_tokens, span)))
    out, cur, n = [], [], 0
    for p, c in pieces:
        if cur and n + c > record_tokens:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += c
    if cur:
        out.append("".join(cur))
    return out


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


def _sample(rids: list[str], lengths: list[int], cap: int) -> list[int]:
    """Indices (in their own order) of the records kept under a total-token cap:
    taken by a hash of their rid until the cap is reached (salted: the splits
    hash the rid too, and an unsalted order would fill the train split first)."""
    import hashlib

    order = sorted(range(len(rids)), key=lambda i: hashlib.sha256(b"sample:" + rids[i].encode()).digest())
    total = np.cumsum(np.asarray(lengths, dtype=np.int64)[order])
    n = max(1, int(np.searchsorted(total, cap, side="right")))
    return sorted(order[:n])


def check_out_dir(out: str | os.PathLike) -> None:
    """`out` may be new, empty, or a tdata directory (which is replaced): never a file, nor a
    directory of other things that replacing it would delete. Checked before any work."""
    out = Path(out)
    if os.path.lexists(out) and not out.is_dir():
        raise CortiqError(f"{out}: exists and is not a directory (--out names the tdata directory to write)")
    if out.is_dir() and any(out.iterdir()) and not (out / store.META).is_file():
        raise CortiqError(f"{out}: a directory that is not tdata (no {store.META}); refusing to replace it")


def build(sources: list[str], tokenizer: str | os.PathLike, out: str | os.PathLike, settings: BuildSettings | None = None,
          progress: Callable[[str], None] | None = None, device: str | None = None) -> Tdata:
    """Tokenize `sources` (paths, or `corpus:NAME`) with the tokenizer of the CMF file `tokenizer`
    into the tdata directory `out` (written whole or not at all; meta.json last)."""
    from ..cmf import open_cmf
    from ..tokenizer import from_doc

    settings = settings or BuildSettings()
    if not sources:
        raise CortiqError("no sources to build data from")
    check_out_dir(out)
    cmf = open_cmf(tokenizer)
    tdoc = cmf.tokenizer or {}
    tok = from_doc(tdoc, str(tokenizer))
    eos_id = cmf.eos_id
    bos_id = tdoc.get("bos_id")
    vocab = cmf.arch.vocab_size

    span = chars_per_token(tok)
    items: list[Item] = []
    docs: list[Document] = []
    for s in sources:
        if progress:
            progress(f"reading {s}")
        i, d = read_source(s, settings.category, max_chars=settings.max_tokens * span)
        items += i
        docs += d
    if not items and not docs:
        raise CortiqError(f"no records in {', '.join(sources)}")

    if settings.generate_with:
        from .generate import generate_answers

        if progress:
            progress(f"generating answers with {settings.generate_with}")
        generate_answers(items, settings.generate_with, cmf, settings.max_new, device, progress)

    # (prompt, answer, where, bos?) per record; text records are all answer, scored from their second token
    rids, splits_given, cats, wheres, prompts, answers, use_bos = [], [], [], [], [], [], []
    for d in docs:
        for k, piece in enumerate(cut_text(tok, d.text, settings.record_tokens, span)):
            rids.append(f"{d.stem}:{k}")
            splits_given.append(None)
            cats.append(d.category)
            wheres.append(f"{d.where} (record {k})")
            prompts.append("")
            answers.append(piece)
            use_bos.append(True)
    bos_s = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos_s = tok.id_to_token(eos_id) or ""
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
        rids.append(it.rid)
        splits_given.append(it.split)
        cats.append(it.category)
        wheres.append(it.where)
        prompts.append(p)
        answers.append(a)
        use_bos.append(it.kind != "chat")  # a chat template writes its own BOS

    seen: dict[str, str] = {}
    for rid, w in zip(rids, wheres):
        if rid in seen:
            raise CortiqError(f"{w}: record id {rid!r} already used at {seen[rid]}")
        seen[rid] = w

    for i in range(len(rids)):  # refused untokenized: too many characters to be within max_tokens
        if len(prompts[i]) + len(answers[i]) > settings.max_tokens * span:
            raise CortiqError(f"{wheres[i]}: record {rids[i]!r} has more than max_tokens {settings.max_tokens} tokens "
                              f"({len(prompts[i]) + len(answers[i])} characters)")
    if progress:
        progress(f"tokenizing {len(rids)} records")
    p_enc = tok.encode_batch(prompts, add_special_tokens=False)
    a_enc = tok.encode_batch(answers, add_special_tokens=False)
    records = []
    head = [bos_id] if bos_id is not None else []
    tail = [eos_id] if settings.eos else []
    for i in range(len(rids)):
        pre = (head if use_bos[i] else []) + p_enc[i].ids
        ids = np.array(pre + a_enc[i].ids + tail, dtype=np.uint32)
        if len(ids) > settings.max_tokens:
            raise CortiqError(f"{wheres[i]}: record {rids[i]!r} has {len(ids)} tokens, more than max_tokens {settings.max_tokens}")
        records.append(Record(rids[i], "", cats[i], ids, max(1, len(pre))))
    top = max(int(r.ids.max()) for r in records)
    if top >= vocab:
        raise CortiqError(f"{tokenizer}: its tokenizer makes id {top}, outside the model's vocabulary ({vocab} ids)")

    if settings.max_total_tokens:
        keep = _sample(rids, [len(r.ids) for r in records], settings.max_total_tokens)
        records = [records[i] for i in keep]
        rids = [rids[i] for i in keep]
        splits_given = [splits_given[i] for i in keep]
    splits = assign_splits(rids, splits_given, settings.fractions)
    hashed = [g is None for g in splits_given]
    for r, s in zip(records, splits):
        r.split = s
    for s, f in zip(SPLITS, settings.fractions):
        if s == "train" or (f > 0 and any(hashed)):
            if not any(x == s for x in splits):
                raise CortiqError(f"the {s} split is empty: {sum(hashed)} records split {settings.fractions[0]:g}/"
                                  f"{settings.fractions[1]:g}/{settings.fractions[2]:g} left none there "
                                  f"(more data, other --fractions, or name splits in the JSONL)")

    digest = build_digest(sources, tokenizer, settings)
    meta = {
        "stage": STAGE, "version": VERSION, "digest": digest, "settings": asdict(settings),
        "inputs": {"sources": list(sources), "tokenizer": str(tokenizer)},
        "tokenizer_digest": tokenizer_digest(tdoc["json"]), "vocab_size": vocab, "eos_id": eos_id, "bos_id": bos_id,
    }
    return write_tdata(out, records, meta)


# ── the stage, declared once (cortiq.pipeline runs it for the flows) ──

def _data(out, ctx, sources, model, settings) -> dict:
    td = build(list(sources), model, out, settings)
    counts = {f"records_{sp}": float(len(td.indices(sp))) for sp in ("train", "val", "test")}
    counts["tokens"] = float(td.n_tokens)
    return {"metrics": counts}


# the data names its own digest (sources by content, the tokenizer by its text)
DATA = Stage("data", str(VERSION), _data, BuildSettings, (),
             extra=lambda p: {"build": build_digest(list(p["sources"]), p["model"], p["settings"])},
             doc="the corpus tokenized with the model's tokenizer into train / val / test records (tdata)")
