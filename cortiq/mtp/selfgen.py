"""Self-generated training data for the draft: the model's own greedy
continuations of prompts cut from its data and of chat requests.

A draft trained on a book's text learns the book, but in decoding it drafts
against what the model writes, which is another distribution (a draft trained
on a novel held far more of its drafts on the novel's held-out text than real
decoding accepted: bench/MTP.md, "A draft trained on a book's text").
Draft-training practice (EAGLE-3, HASS, FastMTP) trains on the
target model's own generations instead; this module makes them.

Each data window's first `gen_prompt` tokens are a prompt; the model continues
it to a full window. A share of the windows (`gen_chat`, for a model with a chat
template) gets a chat request in the template instead (cortiq.data.selfgen's
requests, chosen by seed, or with `gen_ask` requests the model wrote itself, each
used once), so the draft also sees the model answering a chat (what a chat user
decodes). The prompts, of whatever lengths, decode in one
continuously refilled batch through the shared generator
(cortiq.data.selfgen.generate_rows, on the static-cache decode engine).
Greedy by default (what a greedy speculative round verifies against), sampled
at a temperature when asked. A row that emits an end-of-sequence token ends
there: the window's length stops after it and the rest is padding.

Output per data set: a directory named by its digest (the trunk, the prompts,
the settings), `gen.arrow` (ids, length, prompt length, held, chat) and
`meta.json` written last, read back when it exists. Each window knows its
prompt's length and whether it answers a chat request: the measure walks a
decode's rounds from the prompt's end and reports data continuations and chat
answers apart.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .. import store
from ..data.windowing import Packed
from ..errors import CortiqError

STAGE = "mtp-gen"
VERSION = 3
ARROW = "gen.arrow"


@dataclass
class Generated(Packed):
    """A packed set of generated windows: the data set's fields, per window its prompt's
    length and whether that prompt was a chat request."""

    #: [N] bool: the window is the model's answer to a chat request
    chat: np.ndarray | None = None
    #: [N] int64 tokens of each window's prompt (the model's continuation starts after them)
    prompt_lens: np.ndarray | None = None


def chat_rows(n: int, share: float) -> np.ndarray:
    """[n] bool: an even spread of round(n · share) rows (row i when ⌊(i+1)·share⌋ > ⌊i·share⌋)."""
    i = np.arange(n)
    return np.floor((i + 1) * share + 1e-9) > np.floor(i * share + 1e-9)


#: share of the chat requests kept for held-out windows alone
HELD_REQUESTS = 0.2


def make_prompts(windows: np.ndarray, P: int, share: float, requests: list[list[int]], seed: int,
                 held: np.ndarray | None = None, asked: list[list[int]] = ()) -> tuple[list[list[int]], np.ndarray]:
    """The prompts of windows [n, ≥P]: each window's first P tokens, or (an even `share` of
    them, when there are `requests`) a chat request drawn by `seed`; the first len(asked) of
    those chat rows in an even spread (asked_rows) take the `asked` requests instead, one each,
    in order. -> (prompts, chat [n]).

    With `held` [n] (the held-out windows), a seeded HELD_REQUESTS of the requests answer held
    windows only and the rest train windows only: a greedy answer is the same text wherever its
    request is drawn, so a request shared by both sides would put training text in the held-out
    measure (it read 0.65 drafts kept a round on such chat windows, where the server kept 0.28 on
    questions of its own)."""
    n = len(windows)
    out = [list(r) for r in np.asarray(windows[:, :P], dtype=np.int64).tolist()]
    if share <= 0 or not (requests or asked):
        return out, np.zeros(n, dtype=bool)
    chat = chat_rows(n, share)
    if not requests:  # every chat row needs an asked request then
        chat &= np.cumsum(chat) <= len(asked)
    rows = np.flatnonzero(chat)
    if requests:
        rng = np.random.default_rng([seed, 3])
        if held is None or len(requests) < 2:
            pick = rng.integers(len(requests), size=len(rows))
        else:
            order = rng.permutation(len(requests))
            cut = max(1, int(round(HELD_REQUESTS * len(requests))))
            pools = (order[cut:], order[:cut])  # (train, held)
            side = np.asarray(held, dtype=bool)[rows].astype(np.int64)
            draw = rng.integers(np.iinfo(np.int64).max, size=len(rows))
            sizes = np.asarray([len(pools[0]), len(pools[1])])
            pick = np.where(side == 1, pools[1][draw % sizes[1]], pools[0][draw % sizes[0]])
        for i, r in zip(rows.tolist(), pick.tolist()):
            out[i] = list(requests[r])
    # an asked request is used once, so no held-out window answers one a train window answers
    for i, a in zip(rows[asked_rows(len(rows), len(asked))].tolist(), asked):
        out[i] = list(a)
    return out, chat


def asked_rows(n: int, k: int) -> np.ndarray:
    """[n] bool: an even spread of min(k, n) of n chat rows (those the asked requests take)."""
    return chat_rows(n, min(k, n) / n) if n else np.zeros(0, dtype=bool)


def cut_prompts(ids: np.ndarray, lens: np.ndarray, P: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """m prompts of P tokens cut from windows ids [n, T] of lengths [n] (each > P): ⌈m / n⌉
    cuts a window at even offsets of its text, the first cut of every window first (offset 0),
    then the second of every window, ... -> (prompts [m, P], the window of each [m])."""
    n = len(ids)
    r = -(-m // n)
    cut = np.arange(r)[:, None]  # [r, 1]
    off = (cut * (np.asarray(lens)[None, :] - P)) // r  # [r, n]: offsets within each window's text
    rows = np.broadcast_to(np.arange(n), (r, n)).reshape(-1)[:m]
    off = off.reshape(-1)[:m]
    return ids[rows[:, None], off[:, None] + np.arange(P)], rows


def chat_requests(f, T: int) -> list[list[int]]:
    """The chat openings (cortiq.data.selfgen.chat_openings) of `f` that leave at least half a
    window of T to answer in; none for a model without a chat template (its chat text would
    be no chat a user decodes)."""
    from ..data.selfgen import chat_openings
    from ..tokenizer import from_doc

    doc = f.tokenizer or {}
    if not doc.get("chat_template"):
        return []
    ops = chat_openings(f, from_doc(doc, str(f.path)), str(f.path))
    return [o for o in ops if len(o) <= T // 2]


def gen_digest(tkey: str, prompts: list[list[int]], window: int, temperature: float, seed: int, eos: list[int]) -> str:
    lens = np.asarray([len(p) for p in prompts], dtype=np.int64)
    flat = np.asarray([t for p in prompts for t in p], dtype=np.int64)
    h = hashlib.sha256(lens.tobytes() + b"|" + flat.tobytes()).hexdigest()[:32]
    settings = {"window": int(window), "temperature": float(temperature), "seed": int(seed) if temperature > 0 else None,
                "eos": [int(e) for e in eos]}
    return store.digest(STAGE, VERSION, settings, [tkey, h])


def default_cache(s) -> Path:
    if s.gen_cache:
        return Path(s.gen_cache)
    if s.trunk_cache:
        return Path(s.trunk_cache)
    return store.home() / "cache" / "mtp-gen"


def _write(d: Path, ids: np.ndarray, lens: np.ndarray, plens: np.ndarray, held: np.ndarray, chat: np.ndarray,
           meta: dict) -> None:
    N, T = ids.shape
    table = pa.table({
        "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.astype(np.uint32).reshape(-1), pa.uint32()), T),
        "length": pa.array(lens.astype(np.int32), pa.int32()),
        "prompt": pa.array(plens.astype(np.int32), pa.int32()),
        "held": pa.array(held.astype(bool), pa.bool_()),
        "chat": pa.array(chat.astype(bool), pa.bool_()),
    })
    with store.stage_dir(d, meta) as part:
        store.write_arrow(part / ARROW, table)


def _read(d: Path):
    meta = store.read_meta(d)
    t = store.read_arrow(d / ARROW)
    N, T = int(meta["windows"]), int(meta["window"])
    if t.num_rows != N:
        raise CortiqError(f"{d / ARROW}: {t.num_rows} windows, meta.json says {N}")
    ids = t.column("ids").combine_chunks().flatten().to_numpy().astype(np.int64).reshape(N, T)
    lens = t.column("length").to_numpy().astype(np.int64)
    plens = t.column("prompt").to_numpy().astype(np.int64)
    held = t.column("held").to_numpy(zero_copy_only=False).astype(bool)
    chat = t.column("chat").to_numpy(zero_copy_only=False).astype(bool)
    return ids, lens, plens, held, chat


def generated_sets(model, f, packed: list, s, cache: str | os.PathLike | None = None, say=None,
                   most: dict | None = None) -> tuple[list, list[dict]]:
    """For each packed data set (cortiq.data.windowing.Packed) the model's continuations to
    `s.window` tokens of its windows' first `s.gen_prompt` tokens (and of chat requests in
    place of a `s.gen_chat` share of them), as a Packed set `NAME.gen` with the same held-out
    windows; `s.gen_windows` of them where that is more than the set's windows, but at most
    `most[NAME]` (the set's token budget in windows); cached under `cache` (see default_cache).
    -> (sets of Generated, per-set info)."""
    from ..data.selfgen import asked_openings, generate_rows
    from .trunk import trunk_key

    P, T = s.gen_prompt, s.window
    eos = sorted({int(e) for e in ((f.tokenizer or {}).get("eos_ids") or [f.eos_id])})
    root = Path(cache) if cache is not None else default_cache(s)
    tkey = trunk_key(f)
    requests = chat_requests(f, T) if s.gen_chat > 0 else []
    out, info = [], []
    for j, p in enumerate(packed):
        keep = np.asarray(p.lengths) > P  # windows long enough to cut a prompt from
        held = np.asarray(p.held)[keep]
        cuts = np.asarray(p.ids)[keep]
        n = min(s.gen_windows or 0, (most or {}).get(p.name, s.gen_windows or 0))
        if n > len(cuts) > 0:
            cuts, rows = cut_prompts(cuts, np.asarray(p.lengths)[keep], P, n)
            held = held[rows]
        asked = []
        if requests and s.gen_ask > 0:
            n_chat = int(chat_rows(len(cuts), s.gen_chat).sum())
            asked = asked_openings(model, f, int(round(s.gen_ask * n_chat)), seed=s.seed * 1000 + j, slots=s.gen_batch)
            asked = [a for a in asked if len(a) <= T // 2]  # half a window at least to answer in
        prompts, chat = make_prompts(cuts, P, s.gen_chat, requests, s.seed, held, asked)
        if len(prompts) == 0:
            raise CortiqError(f"mtp generate: no window of data set {p.name} is longer than gen_prompt {P}")
        dg = gen_digest(tkey, prompts, T, s.gen_temperature, s.seed, eos)
        d = root / f"{p.name}-gen-{dg[:16]}"
        name = f"{p.name}.gen"
        if store.is_complete(d) and store.read_meta(d).get("digest") == dg:
            ids, lens, plens, held, chat = _read(d)
            out.append(Generated(name, ids, lens, held, chat, plens))
            info.append({"set": name, "windows": len(ids), "cache": str(d), "read_back": True})
            continue
        plens = np.asarray([len(x) for x in prompts], dtype=np.int64)
        new = generate_rows(model, prompts, (T - plens).tolist(), temperature=s.gen_temperature, eos_ids=eos,
                            slots=s.gen_batch, seed=s.seed, progress=True, desc=f"mtp generate {p.name}")
        lens = plens + np.asarray([len(x) for x in new], dtype=np.int64)
        ids = np.full((len(prompts), T), f.eos_id, dtype=np.int64)
        flat = np.concatenate([np.concatenate([np.asarray(a, dtype=np.int64), b]) for a, b in zip(prompts, new)])
        ids[np.arange(T)[None, :] < lens[:, None]] = flat  # row-major: each row's tokens, then its padding
        meta = {"stage": STAGE, "version": VERSION, "digest": dg, "set": p.name, "windows": len(ids), "window": T,
                "prompt": P, "chat_prompts": int(chat.sum()), "asked_prompts": len(asked),
                "temperature": s.gen_temperature, "seed": s.seed, "eos": eos,
                "trunk": tkey, "tokens": int(lens.sum()), "model": str(f.path)}
        _write(d, ids, lens, plens, held, chat, meta)
        if say is not None:
            say(f"mtp heal: generated {len(ids)} windows of {T} from {p.name} ({int(chat.sum())} of them answers to "
                f"chat requests, {len(asked)} of those written by the model; {int(lens.sum())} tokens, "
                f"{int((lens < T).sum())} ended early) into {d}")
        out.append(Generated(name, ids, lens, held, chat, plens))
        info.append({"set": name, "windows": len(ids), "cache": str(d), "read_back": False})
    return out, info
