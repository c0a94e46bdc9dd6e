"""Teacher-forced NLL of the scored tokens of records (the heal's test-split score).

A record's token j+1 is scored (predicted from tokens 0..j) when j+1 ≥ first,
where first = the record's first scored position with loss_on="answer", 1 with
"all" (every token but the first, which has no context). Records run in
batches of similar length, right-padded (padding never reaches an earlier
position under the causal mask), and logits exist for `chunk` rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import CortiqError


@dataclass
class TextRecord:
    """A window of a plain text: every token after the first is scored."""

    ids: np.ndarray
    first: int = 1


def text_windows(ids: Sequence[int], window: int) -> list[TextRecord]:
    """Consecutive non-overlapping windows of `window` tokens (the tail one
    shorter; a tail of one token has nothing to score and is dropped)."""
    if window < 2:
        raise CortiqError(f"window {window}: a window needs at least 2 tokens")
    a = np.asarray(ids, dtype=np.int64)
    return [TextRecord(a[s : s + window]) for s in range(0, len(a), window) if len(a[s : s + window]) >= 2]


def windowed(records, window: int, loss_on: str = "answer") -> list[TextRecord]:
    """Records cut into consecutive windows of at most `window` tokens (one
    model pass each); a window keeps the positions its record scores (a window
    past a record's start loses the context before it). Windows with nothing
    scored are dropped."""
    out = []
    for r in records:
        ids, f = np.asarray(r.ids), _first(r, loss_on)
        for a in range(0, len(ids), window):
            w = ids[a : a + window]
            first = max(f - a, 1)
            if first < len(w):
                out.append(TextRecord(w, first))
    return out


def first_tokens(records, max_tokens: int, loss_on: str = "answer") -> list:
    """The leading records that hold at least `max_tokens` scored tokens (all when 0)."""
    if not max_tokens:
        return list(records)
    n, out = 0, []
    for r in records:
        out.append(r)
        n += max(len(r.ids) - _first(r, loss_on), 0)
        if n >= max_tokens:
            break
    return out


def _first(rec, loss_on: str) -> int:
    if loss_on == "all":
        return 1
    if loss_on == "answer":
        return max(int(rec.first), 1)
    raise CortiqError(f"loss_on {loss_on!r} is neither 'answer' nor 'all'")


@torch.no_grad()
def score_records(model, records, loss_on: str = "answer", batch_tokens: int = 8192, chunk: int = 1024,
                  pad_id: int = 0, progress: Callable[[int], None] | None = None) -> tuple[float, int]:
    """(sum of NLL over scored tokens, number of scored tokens)."""
    if not records:
        raise CortiqError("no records to score")
    dev = model.model.embed_tokens.weight.device
    order = sorted(range(len(records)), key=lambda i: len(records[i].ids))
    total, count = 0.0, 0
    i = 0
    while i < len(order):
        # a batch of similar lengths within the token budget
        j = i + 1
        while j < len(order) and (j - i + 1) * len(records[order[j]].ids) <= batch_tokens:
            j += 1
        group = [records[k] for k in order[i:j]]
        T = max(len(r.ids) for r in group)
        ids = torch.full((len(group), T), pad_id, dtype=torch.long)
        weight = torch.zeros(len(group), T)  # weight[b, t]: target ids[b, t+1] is scored
        for b, r in enumerate(group):
            n = len(r.ids)
            ids[b, :n] = torch.from_numpy(np.asarray(r.ids, dtype=np.int64))
            f = _first(r, loss_on)
            weight[b, max(f - 1, 0) : n - 1] = 1.0
        ids, weight = ids.to(dev), weight.to(dev)
        h, _ = model.forward_hidden(ids)  # [B, T, H]
        rows = h[:, :-1].reshape(-1, h.shape[-1])
        tgt = ids[:, 1:].reshape(-1)
        w = weight[:, :-1].reshape(-1)
        keep = w.nonzero().squeeze(1)  # only scored rows reach the head
        for s in range(0, keep.numel(), chunk):
            sel = keep[s : s + chunk]
            lg = model.logits(rows[sel]).float()  # [chunk, V]
            total += float(F.cross_entropy(lg, tgt[sel], reduction="sum"))
        count += int(keep.numel())
        if progress:
            progress(len(group))
        i = j
    return total, count
