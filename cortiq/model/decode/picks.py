"""The picks: a row of logits reduced to its argmax or its top k, in two stages over chunks; the
token ids a draft picks among, checked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import CortiqError


def _split(V: int) -> int:
    """The chunk width of `_argmax` and `_topk` over a vocabulary of V: its smallest divisor in
    1024..4096, or 0 (one reduction over the row) where it has none."""
    return next((c for c in range(1024, 4097) if V % c == 0), 0)


def _argmax(x, c: int):
    """x [..., V] -> [...] the index of the largest, the first of equals (as argmax), in two
    stages over chunks of c (`_split`: c divides V): each chunk's maximum, then the first chunk
    holding the largest. One reduction over a long row runs as one CUDA block per row, and
    every pick of a step waits for it (bench/DECODE.md, "The engine's design notes")."""
    if not c:
        return x.argmax(-1)
    v, i = x.unflatten(-1, (-1, c)).max(-1)  # [..., V/c]: each chunk's maximum, first of equals
    j = v.argmax(-1, keepdim=True)  # [..., 1]
    return (j * c + i.gather(-1, j))[..., 0]


def _topk(x, k: int, c: int):
    """x [..., V] -> [..., k] the indices of the k largest, largest first (as topk), in two
    stages as `_argmax`: each chunk's top k, then the top k of those candidates."""
    if not c:
        return x.topk(k, -1).indices
    v, i = x.unflatten(-1, (-1, c)).topk(k, -1)  # [..., V/c, k]
    i = i + torch.arange(0, x.shape[-1], c, device=x.device)[:, None]  # indices into the row
    j = v.flatten(-2).topk(k, -1).indices  # [..., k] into the candidates
    return i.flatten(-2).gather(-1, j)


def _pick_greedy(h, head, c: int):
    """h [S, T, H] -> the head's argmax [S, T] (`_argmax`)."""
    return _argmax(F.linear(h, head), c)


def _pick_top(h, head, k: int, c: int):
    """h [S, H] -> the head's top k [S, k], largest first (`_topk`)."""
    return _topk(F.linear(h, head), k, c)


def _check_draft_vocab(draft_vocab, V: int, branches: int) -> None:
    """The token ids a draft picks among (the engine's `draft_vocab`), refused unless they are
    distinct ids below V, at least one a branch."""
    ids = torch.as_tensor(draft_vocab)
    if ids.dim() != 1 or ids.numel() < branches or ids.dtype.is_floating_point:
        raise CortiqError(f"decode engine: the draft's vocabulary needs token ids, at least {branches} (one a branch)")
    if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != ids.numel():
        raise CortiqError(f"decode engine: the draft's vocabulary needs distinct token ids below {V}")
