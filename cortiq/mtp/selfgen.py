"""Self-generated training data for the draft: the model's own continuations
of prompts cut from its data.

A draft trained on a book's text learns the book, but in decoding it drafts
against what the model writes, which is another distribution (measured on an
H200 with SmolLM2-135M: a draft trained on a novel held 0.47 of its step-1
drafts on the novel's held-out text but had 0.30 accepted a round in real
decoding). Draft-training practice (EAGLE-3, HASS, FastMTP) trains on the
target model's own generations instead; this module makes them.

Each data window's first `gen_prompt` tokens are a prompt; the model continues
it to a full window. A share of the prompts (`gen_chat`) is put in the model's
chat template as a user turn, so the draft also sees the model answering a
chat (what a chat user decodes). All prompts have one length, so B rows decode at once
through the model's KV cache with no padding: one forward over the [B, P]
prompts, then one [B, 1] step per new token (the loop over new tokens is the
decode itself; every step is one batched forward). Greedy by default (what a
greedy speculative round verifies against), sampled at a temperature when
asked. A row that emits an end-of-sequence token ends there: the window's
length stops after it and the rest is padding.

Output per data set: a directory named by its digest (the trunk, the prompts,
the settings), `gen.arrow` (ids, length, held, chat) and `meta.json` written
last, read back when it exists. Each window knows its prompt's length and
whether it answers a chat question: the measure walks a decode's rounds from
the prompt's end and reports data continuations and chat answers apart.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import store
from ..data.windows import Packed
from ..errors import CortiqError

STAGE = "mtp-gen"
VERSION = 2
ARROW = "gen.arrow"


@dataclass
class Generated(Packed):
    """A packed set of generated windows: the data set's fields, and per window whether its
    prompt was put in the chat template; every prompt has `prompt` tokens."""

    #: [N] bool: the window is the model's answer to a chat question
    chat: np.ndarray | None = None
    #: tokens of every window's prompt (the model's continuation starts after them)
    prompt: int = 0


@torch.no_grad()
def continue_batch(model, prompts: torch.Tensor, new: int, temperature: float = 0.0,
                   gen: torch.Generator | None = None) -> torch.Tensor:
    """prompts [B, P] int64 -> [B, P + new]: each row continued by `new` tokens (greedy at
    temperature 0, else sampled from softmax(logits / temperature) with `gen`)."""
    dev = model.model.embed_tokens.weight.device
    B, P = prompts.shape
    out = torch.empty(B, P + new, dtype=torch.int64, device=dev)
    out[:, :P] = prompts.to(dev)
    cache = model.new_cache()
    h, _ = model.forward_hidden(out[:, :P], cache=cache)  # [B, P, H]
    last = h[:, -1]  # [B, H]
    for i in range(new):
        logits = model.logits(last).float()  # [B, V]
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        else:
            tok = logits.argmax(-1)
        out[:, P + i] = tok
        if i + 1 < new:
            h, _ = model.forward_hidden(tok[:, None], cache=cache)  # [B, 1, H]
            last = h[:, -1]
    return out.cpu()


@torch.no_grad()
def continue_reference(model, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuations row by row with the plain decoder (tests compare continue_batch with it)."""
    from ..model.generate import generate

    rows = [list(r) + generate(model, list(r), max_new=new).tokens for r in prompts.tolist()]
    return torch.tensor(rows, dtype=torch.int64)


def end_at_eos(ids: torch.Tensor, start: int, eos: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row [N, T] after its first EOS at or past column `start`:
    (ids with pad past the end [N, T], lengths [N])."""
    N, T = ids.shape
    tail = ids[:, start:]
    hit = torch.isin(tail, torch.tensor(eos, dtype=ids.dtype)) if eos else torch.zeros_like(tail, dtype=torch.bool)
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((N,), T - start))  # [N] tokens kept past start
    lens = start + first
    out = ids.clone()
    out[torch.arange(T)[None, :] >= lens[:, None]] = pad
    return out, lens


def chat_wrapper(f) -> tuple[list[int], list[int]]:
    """The token ids before and after a user turn's text in `f`'s chat template (with the
    generation prompt): a data prompt put between them is a chat question."""
    from ..data.chats import render_chat
    from ..tokenizer import from_doc

    doc = f.tokenizer or {}
    tok = from_doc(doc, str(f.path))
    mark = "\u2063cortiq\u2063"  # text no template writes
    bos_id = doc.get("bos_id")
    eos_ids = doc.get("eos_ids") or []
    text = render_chat(doc.get("chat_template"), [{"role": "user", "content": mark}], True,
                       tok.id_to_token(bos_id) if bos_id is not None else "",
                       tok.id_to_token(eos_ids[0]) if eos_ids else "", str(f.path))
    before, sep, after = text.partition(mark)
    if not sep:
        return [], []
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids if t else []
    return enc(before), enc(after)


def chat_rows(n: int, share: float) -> np.ndarray:
    """[n] bool: an even spread of round(n · share) rows (row i when ⌊(i+1)·share⌋ > ⌊i·share⌋)."""
    i = np.arange(n)
    return np.floor((i + 1) * share + 1e-9) > np.floor(i * share + 1e-9)


def make_prompts(windows: np.ndarray, P: int, share: float, wrap: tuple[list[int], list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[n, P] prompts from windows [n, ≥P]: the first P tokens, or (a `share` of rows, when the
    chat wrapper leaves at least half of P) the first tokens put in a user turn. -> (prompts, chat [n])."""
    n = len(windows)
    out = np.ascontiguousarray(windows[:, :P], dtype=np.int64)
    a, b = wrap
    m = P - len(a) - len(b)
    if share <= 0 or (not a and not b) or m < P // 2:
        return out, np.zeros(n, dtype=bool)
    chat = chat_rows(n, share)
    out[chat] = np.concatenate([np.broadcast_to(np.asarray(a, np.int64), (int(chat.sum()), len(a))), windows[chat, :m],
                                np.broadcast_to(np.asarray(b, np.int64), (int(chat.sum()), len(b)))], 1)
    return out, chat


def gen_digest(tkey: str, prompts: np.ndarray, window: int, temperature: float, seed: int, eos: list[int]) -> str:
    h = hashlib.sha256(np.ascontiguousarray(prompts, dtype=np.int64).tobytes()).hexdigest()[:32]
    settings = {"window": int(window), "temperature": float(temperature), "seed": int(seed) if temperature > 0 else None,
                "eos": [int(e) for e in eos]}
    return store.digest(STAGE, VERSION, settings, [tkey, h])


def default_cache(s) -> Path:
    if s.gen_cache:
        return Path(s.gen_cache)
    if s.trunk_cache:
        return Path(s.trunk_cache)
    return store.home() / "cache" / "mtp-gen"


def _write(d: Path, ids: torch.Tensor, lens: torch.Tensor, held: np.ndarray, chat: np.ndarray, meta: dict) -> None:
    N, T = ids.shape
    table = pa.table({
        "ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.numpy().astype(np.uint32).reshape(-1), pa.uint32()), T),
        "length": pa.array(lens.numpy().astype(np.int32), pa.int32()),
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
    held = t.column("held").to_numpy(zero_copy_only=False).astype(bool)
    chat = t.column("chat").to_numpy(zero_copy_only=False).astype(bool)
    return ids, lens, held, chat


def generated_sets(model, f, packed: list, s, cache: str | os.PathLike | None = None, say=None) -> tuple[list, list[dict]]:
    """For each packed data set (cortiq.data.windows.Packed) the model's continuations of its
    windows' first `s.gen_prompt` tokens to `s.window` tokens, as a Packed set `NAME.gen` with
    the same held-out windows; cached under `cache` (see default_cache). -> (sets of
    Generated, per-set info)."""
    from tqdm import tqdm

    from .trunk import trunk_key

    P, T = s.gen_prompt, s.window
    eos = sorted({int(e) for e in ((f.tokenizer or {}).get("eos_ids") or [f.eos_id])})
    root = Path(cache) if cache is not None else default_cache(s)
    tkey = trunk_key(f)
    wrap = chat_wrapper(f) if s.gen_chat > 0 else ([], [])
    dev = model.model.embed_tokens.weight.device
    out, info = [], []
    for p in packed:
        keep = np.asarray(p.lengths) > P  # windows long enough to cut a prompt from
        prompts, chat = make_prompts(np.asarray(p.ids)[keep], P, s.gen_chat, wrap)
        held = np.asarray(p.held)[keep]
        if len(prompts) == 0:
            raise CortiqError(f"mtp generate: no window of data set {p.name} is longer than gen_prompt {P}")
        dg = gen_digest(tkey, prompts, T, s.gen_temperature, s.seed, eos)
        d = root / f"{p.name}-gen-{dg[:16]}"
        name = f"{p.name}.gen"
        if store.is_complete(d) and store.read_meta(d).get("digest") == dg:
            ids, lens, held, chat = _read(d)
            out.append(Generated(name, ids, lens, held, chat, P))
            info.append({"set": name, "windows": len(ids), "cache": str(d), "read_back": True})
            continue
        g = torch.Generator(device=dev).manual_seed(s.seed) if s.gen_temperature > 0 else None
        pr = torch.as_tensor(prompts, dtype=torch.int64)
        bar = tqdm(total=len(pr) * (T - P), desc=f"mtp generate {p.name}", unit="tok", unit_scale=True,
                   file=sys.stderr, dynamic_ncols=True, disable=False)
        rows = []
        for a in range(0, len(pr), s.gen_batch):
            rows.append(continue_batch(model, pr[a : a + s.gen_batch], T - P, s.gen_temperature, g))
            bar.update(rows[-1].shape[0] * (T - P))
        bar.close()
        ids, lens = end_at_eos(torch.cat(rows), P, eos, f.eos_id)
        meta = {"stage": STAGE, "version": VERSION, "digest": dg, "set": p.name, "windows": len(ids), "window": T,
                "prompt": P, "chat_prompts": int(chat.sum()), "temperature": s.gen_temperature, "seed": s.seed, "eos": eos, "trunk": tkey,
                "tokens": int(lens.sum()), "model": str(f.path)}
        _write(d, ids, lens, held, chat, meta)
        if say is not None:
            say(f"mtp heal: generated {len(ids)} windows of {T} from {p.name} ({int(chat.sum())} of them answers to "
                f"chat questions; {int(lens.sum())} tokens, {int((lens < T).sum())} ended early) into {d}")
        out.append(Generated(name, ids.numpy(), lens.numpy(), held, chat, P))
        info.append({"set": name, "windows": len(ids), "cache": str(d), "read_back": False})
    return out, info
