"""The draft's vocabulary: the tokens a serving engine's draft picks among.

At a large vocabulary the output head is most of what a draft step reads (bench/DECODE.md, "What a
round costs at 8B"), yet a draft is accepted only where it is the token the trunk itself emits, and
a minority of the vocabulary carries nearly all of what a trunk emits ("A narrower draft head"). `mtp heal` ranks the vocabulary by how often
the trunk's greedy choice is each token on the windows it trains on (the held-out ones left out),
ties by the windows' own token counts, then by id, and stores the ranking in the model's document
under `draft_vocab`. `cortiq serve` and `cortiq generate` give the decode engine its first N
(`--draft-vocab N`): the trunk still verifies every draft, so a narrower head changes which drafts
are guessed and what a round costs, never the output.

Stored as {"ids": base64 of the ranked ids as little-endian int32, "counted": what was counted};
read back with every id checked (a file is untrusted input).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from ..errors import CortiqError

#: the model document's key
KEY = "draft_vocab"
#: `--draft-vocab 0` (auto): the first AUTO_ROWS of the ranking for a vocabulary of more than
#: AUTO_ABOVE tokens, those of the large model families, whose decode steps are bound by the bytes they
#: read and whose draft reads its head more than its layer (bench/DECODE.md, "What a round costs at
#: 8B"); the whole head below it, where a small model's step is bound by its launches instead
#: ("A narrower draft head")
AUTO_ROWS, AUTO_ABOVE = 32768, 65536


def ranking(t1: np.ndarray, ids: np.ndarray, lens: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids [vocab] ranked: by how often each is the trunk's greedy choice t1 [N, T] on the
    rows below each window's length lens [N], then by its count among the windows' tokens ids
    [N, T], then by id (smaller first)."""
    T = t1.shape[1]
    valid = np.arange(T)[None, :] < np.asarray(lens)[:, None]  # [N, T]
    greedy = np.bincount(np.asarray(t1)[valid], minlength=vocab)[:vocab]
    text = np.bincount(np.asarray(ids)[valid], minlength=vocab)[:vocab]
    # lexsort sorts by its last key first: the greedy counts, then the text's, then the id
    return np.lexsort((np.arange(vocab), -text, -greedy)).astype(np.int32)


def entry(ranked: np.ndarray, counted: str) -> dict:
    """The document's entry for a ranking."""
    return {"ids": base64.b64encode(np.ascontiguousarray(ranked, dtype="<i4").tobytes()).decode("ascii"),
            "counted": counted}


def stored(f) -> np.ndarray | None:
    """The ranking `f` (a CmfFile) stores, checked (`parse`); None if none."""
    e = f.doc.get(KEY)
    return None if e is None else parse(e, f.arch.vocab_size, f.path)


def parse(e: dict, vocab: int, where) -> np.ndarray:
    """A document entry's ranking, checked: a permutation of the `vocab` token ids, else one line
    naming `where`."""
    try:
        ranked = np.frombuffer(base64.b64decode(e["ids"], validate=True), dtype="<i4")
    except (TypeError, KeyError, ValueError) as err:
        raise CortiqError(f"{where}: its draft_vocab entry is not a base64 list of token ids ({err})") from None
    if len(ranked) != vocab or ranked.min(initial=0) < 0 or ranked.max(initial=0) >= vocab \
            or np.bincount(ranked.clip(0, vocab - 1), minlength=vocab).max(initial=0) != 1:
        raise CortiqError(f"{where}: its draft_vocab entry is not a ranking of its {vocab} tokens; "
                          "run `cortiq mtp heal` again to write a new one")
    return ranked


def engine_ids(f, n: int) -> torch.Tensor | None:
    """The decode engine's `draft_vocab` for the setting n of `f`'s draft: 0 (auto) the first AUTO_ROWS
    of its ranking where its vocabulary has more than AUTO_ABOVE tokens and it stores one, else every
    token (None); n > 0: `draft_ids`."""
    if n == 0:
        if f.arch.vocab_size <= AUTO_ABOVE or f.doc.get(KEY) is None:
            return None
        n = AUTO_ROWS
    return draft_ids(f, n)


def draft_ids(f, n: int) -> torch.Tensor | None:
    """The first n tokens of `f`'s ranking, for the decode engine's `draft_vocab`: None where n is 0
    or covers the vocabulary (the whole head). A model without a ranking and n > 0: one line that
    says how to get one."""
    V = f.arch.vocab_size
    if n < 0:
        raise CortiqError(f"--draft-vocab {n}: give 0 (every token) or a count of tokens")
    if n == 0 or n >= V:
        return None
    ranked = stored(f)
    if ranked is None:
        raise CortiqError(f"{f.path}: --draft-vocab {n} needs the draft's token ranking, which `cortiq mtp heal` "
                          "writes; this model has none (heal its draft, or give --draft-vocab 0)")
    return torch.from_numpy(ranked[:n].astype(np.int64))
