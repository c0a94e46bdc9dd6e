"""Batched next-token choice for the server: greedy rows, temperature and
nucleus (top-p) sampling rows, in one pass over the batch.

Each request draws its own uniform number per token from its own seeded
generator (on the host), and the row is sampled by inverting its CDF with
that number: a request's tokens depend on its seed and its logits only, not
on which other requests share the batch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: the smallest temperature other than 0 (greedy) a request may ask for: the sampler divides
#: the logits by at least this (a smaller divisor leaves float32's range), so a smaller one would
#: not be the temperature asked for
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 2.0  # OpenAI's
#: the smallest top_p: a smaller one is 0 or a subnormal in float32 (1e-300 and 5e-324 are 0
#: there), and from it on the top token alone is kept anyway (for any vocabulary under a
#: million, the top token holds more than this mass)
MIN_TOP_P = 1e-6


def temperature_error(t: float) -> str | None:
    """Why a request cannot sample at temperature `t` (None: it can)."""
    if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        return f"{t:g} is outside [0, {MAX_TEMPERATURE:g}]"
    if 0 < t < MIN_TEMPERATURE:
        return f"{t:g} is neither 0 (greedy) nor at least {MIN_TEMPERATURE:g}"
    return None


def top_p_error(p: float) -> str | None:
    """Why a request cannot sample with nucleus mass `p` (None: it can)."""
    if not (math.isfinite(p) and MIN_TOP_P <= p <= 1):
        small = " (a smaller top_p keeps no token in float32; temperature 0 is greedy)" if 0 <= p < MIN_TOP_P else ""
        return f"{p:g} is outside [{MIN_TOP_P:g}, 1]{small}"
    return None


def sample_ids(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float],
           u: Sequence[float], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V]; per row a temperature (<= 0: argmax), a top-p in (0, 1]
    and a uniform u in [0, 1) -> token ids int64 [B] (on the logits' device).
    `greedy` [B]: the argmax rows' tokens where the caller has them already.

    Sampling row b: p = softmax(logits_b / T_b); tokens sorted by p, the
    smallest head whose mass reaches top_p kept (the first token always),
    renormalised; the token whose cumulative mass first exceeds u_b·mass.
    (A request's parameters are checked before it joins a batch: `temperature_error`,
    `top_p_error`; the first token is kept here whatever they are, so that no row can
    fail the batch's choice.)"""
    dev = logits.device
    B = logits.shape[0]
    greedy = logits.argmax(-1) if greedy is None else greedy.to(dev)  # [B]
    if all(x <= 0 for x in temperature):  # decided on the host: no wait for the device
        return greedy
    t = torch.tensor(list(temperature), dtype=torch.float32, device=dev)  # [B]
    tp = torch.tensor(list(top_p), dtype=torch.float32, device=dev)[:, None]  # [B, 1]
    uu = torch.tensor(list(u), dtype=torch.float32, device=dev)[:, None]
    p = torch.softmax(logits.float() / t.clamp_min(MIN_TEMPERATURE)[:, None], -1)  # [B, V]
    ps, order = p.sort(-1, descending=True)  # [B, V]
    cum = ps.cumsum(-1)
    keep = (cum - ps) < tp  # the mass before a token is still short of top_p
    keep[:, 0] = True  # (a top_p of 0 in float32, or a row of NaN, keeps nothing by the rule above)
    ps = ps * keep
    cum = ps.cumsum(-1)  # [B, V], last column = kept mass
    target = uu * cum[:, -1:]
    idx = torch.searchsorted(cum, target, right=True).clamp_max(keep.sum(-1, keepdim=True) - 1)  # [B, 1]
    sampled = order.gather(1, idx)[:, 0]
    return torch.where(t <= 0, greedy, sampled)


def sample_ids_reference(logits: torch.Tensor, temperature, top_p, u) -> list[int]:
    """The plain per-row reference of `sample_ids` (tests compare the two)."""
    out = []
    for row, T, P, uu in zip(logits.float().cpu(), temperature, top_p, u):
        if T <= 0:
            out.append(int(row.argmax()))
            continue
        p = torch.softmax(row / T, -1).tolist()
        ranked = sorted(range(len(p)), key=lambda i: (-p[i], i))
        kept, mass = [], 0.0
        for i in ranked:
            if mass >= P:
                break
            kept.append(i)
            mass += p[i]
        acc, pick = 0.0, kept[-1]
        for i in kept:
            acc += p[i]
            if acc > uu * mass:
                pick = i
                break
        out.append(pick)
    return out
