"""What a draft is judged by: hold rates per chain step and drafts kept per round.

The chain, round and order walks and the drafts-held count of the original
GPU tool, vectorised over windows and rows: the only Python loop is over chain steps
(or, for the round-ordered walk, over log2(T) pointer doublings).

Conventions (every function): `ids` [N, T] the windows' tokens, `lens` [N]
their real lengths, `t1` [N, T] the trunk's own next token at each row (its
top-1: row p predicts token p+1). A draft row p at chain step j predicts token
p+j+1, so it holds when it equals `t1` at row p+j; it counts only where every
token the chain was fed is the trunk's own choice (what a greedy round feeds).

Counts are int64 tensors [chain, 2]: (rows counted, rows held) per step.
Each fast function has a plain loop beside it (`*_reference`) that the tests
compare it with.
"""

from __future__ import annotations

import torch


def shifted(x: torch.Tensor, s: int, fill: int) -> torch.Tensor:
    """x[:, p + s] at column p ([N, T]); `fill` past the end."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def rates(counts: torch.Tensor) -> list[float]:
    """Per step, held / counted (0 where nothing was counted)."""
    c = counts.to(torch.float64)
    return (c[:, 1] / c[:, 0].clamp(min=1)).tolist()


def drafts_per_round(counts_or_rates) -> float:
    """Drafts a round keeps, Σ_j Π_{i≤j} hold_i: what a checkpoint is chosen by."""
    r = counts_or_rates
    if isinstance(r, torch.Tensor) and r.dim() == 2:
        r = rates(r)
    r = torch.as_tensor(list(r), dtype=torch.float64)
    return float(torch.cumprod(r, 0).sum()) if r.numel() else 0.0


# ── every row starts a chain (stride 0) ────────────────────────────────────


def chain_counts(ids: torch.Tensor, lens: torch.Tensor, t1: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Seed `chain_pass`. `draft` [chain, N, T]: the draft's top-1 at step j
    (index j-1), row p (its guess for token p+j+1). -> counts [chain, 2]."""
    chain, N, T = draft.shape
    pos = torch.arange(T, device=ids.device)
    held = torch.ones(N, T, dtype=torch.bool, device=ids.device)
    on = torch.ones_like(held)
    out = torch.zeros(chain, 2, dtype=torch.int64)
    for j in range(1, chain + 1):
        valid = pos[None, :] < (lens[:, None] - j)  # [N, T] rows whose step-j target exists
        on &= shifted(ids, j, -1) == shifted(t1, j - 1, -2)  # token p+j fed to the chain is the trunk's own
        alive = valid & on & held
        hit = alive & (draft[j - 1] == shifted(t1, j, -3))
        out[j - 1, 0] = alive.sum()
        out[j - 1, 1] = hit.sum()
        held = hit
    return out


def chain_counts_reference(ids, lens, t1, draft) -> torch.Tensor:
    """The seed's loop, row by row (tests only)."""
    chain, N, T = draft.shape
    out = torch.zeros(chain, 2, dtype=torch.int64)
    for i in range(N):
        L = int(lens[i])
        held, on = [True] * T, [True] * T
        for j in range(1, chain + 1):
            rows = max(L - j, 0)
            for p in range(rows):
                on[p] = on[p] and int(ids[i, p + j]) == int(t1[i, p + j - 1])
                if not (on[p] and held[p]):
                    held[p] = False
                    continue
                hit = int(draft[j - 1, i, p]) == int(t1[i, p + j])
                out[j - 1, 0] += 1
                out[j - 1, 1] += int(hit)
                held[p] = hit
            for p in range(rows, T):
                held[p] = False
    return out


# ── chains laid out as decode rounds (stride > 0) ──────────────────────────


def chain_starts(lens: torch.Tensor, off: torch.Tensor, stride: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where chains start in each window: n = off + m·stride. -> (n [N, M], exists [N, M])."""
    M = -(-T // stride) + 1
    n = off[:, None] + torch.arange(M, device=lens.device)[None, :] * stride  # [N, M]
    return n, n < lens[:, None]


def splice(src: torch.Tensor, out: torch.Tensor, lens: torch.Tensor, off: torch.Tensor, stride: int, j: int) -> torch.Tensor:
    """Seed `splice`, one step: a chain starting at n reads at row q = n+j-1 the
    draft's previous output at row q-1 (`out`), where n + j < len; every other
    row of `src` stays. src/out [N, T, H]; off [N] -> new [N, T, H]."""
    N, T, H = src.shape
    n, _ = chain_starts(lens, off, stride, T)
    q = n + j - 1  # [N, M]
    ok = (n + j < lens[:, None]) & (q >= 1)
    w, m = ok.nonzero(as_tuple=True)
    rows = q[w, m]
    new = src.clone()
    new[w, rows] = out[w, rows - 1]
    return new


def splice_reference(src, out, lens, off, stride: int, j: int):
    """The seed's while-loop (tests only)."""
    new = src.clone()
    for i in range(src.shape[0]):
        n = int(off[i])
        while n + j < int(lens[i]):
            q = n + j - 1
            if q >= 1:
                new[i, q] = out[i, q - 1]
            n += stride
    return new


def _steps(ids, lens, t1, n: torch.Tensor, chain: int):
    """Row q = n+j-1 of step j for starts n [N, M]: (q [N, M, c], fed [N, M, c], tq1 [N, M, c]).
    fed: q+1 < len and the token at q+1 is the trunk's own; tq1: the trunk's token at q+1."""
    N, T = ids.shape
    q = n[..., None] + torch.arange(chain, device=ids.device)  # [N, M, c]
    inside = q + 1 < lens[:, None, None]
    qc = q.clamp(max=T - 1).reshape(N, -1)
    q1 = (q + 1).clamp(max=T - 1).reshape(N, -1)
    fed = inside & (ids.gather(1, q1) == t1.gather(1, qc)).view_as(q)
    tq1 = t1.gather(1, q1).view_as(q)
    return q, fed, tq1


def _tally(fed: torch.Tensor, hit: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Step j counts where every step before it was fed and held and step j is fed.
    fed/hit [..., c]; live [...] which starts count. -> [c, 2]."""
    ok = fed & hit
    before = torch.cumprod(torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], -1).to(torch.int8), -1).bool()
    counted = before & fed & live[..., None]
    c = counted.shape[-1]
    return torch.stack([counted.reshape(-1, c).sum(0), (counted & hit).reshape(-1, c).sum(0)], 1).to(torch.int64)


def round_counts(ids, lens, t1, draft, off: torch.Tensor, stride: int, chain: int) -> torch.Tensor:
    """Seed `round_pass` for one layout: chains start at off + m·stride, and
    `draft` [N, T] is the draft's top-1 on that layout (row q predicts token
    q+2 whatever its step). -> counts [chain, 2]."""
    n, exists = chain_starts(lens, off, stride, ids.shape[1])
    live = exists & (n + 1 < lens[:, None])
    q, fed, tq1 = _steps(ids, lens, t1, n, chain)
    N, T = ids.shape
    d = draft.gather(1, q.clamp(max=T - 1).reshape(N, -1)).view_as(q)
    return _tally(fed, d == tq1, live)


def round_counts_reference(ids, lens, t1, draft, off, stride: int, chain: int):
    out = torch.zeros(chain, 2, dtype=torch.int64)
    for i in range(ids.shape[0]):
        L = int(lens[i])
        n = int(off[i])
        while n + 1 < L:
            for j in range(1, chain + 1):
                q = n + j - 1
                if q + 1 >= L or int(ids[i, q + 1]) != int(t1[i, q]):
                    break
                hit = int(draft[i, q]) == int(t1[i, q + 1])
                out[j - 1, 0] += 1
                out[j - 1, 1] += int(hit)
                if not hit:
                    break
            n += stride
    return out


def order_counts(ids, lens, t1, top: torch.Tensor, stride: int, chain: int) -> torch.Tensor:
    """Seed `order_pass`: rounds as a decode has them. `top` [stride, N, T]:
    the draft's top-1 on the layout whose chains start at offset o (index o).
    A round at n keeps its leading held drafts; the next round starts after
    them (n + kept + 1). The walk from 0 is found by pointer doubling over every
    row's successor, so no loop runs over tokens. -> counts [chain, 2]."""
    N, T = ids.shape
    n = torch.arange(T, device=ids.device).expand(N, T)  # [N, T] a round could start anywhere
    q, fed, tq1 = _steps(ids, lens, t1, n, chain)
    flat = top.permute(1, 0, 2).reshape(N, stride * T)  # [N, stride·T]
    d = flat.gather(1, ((n % stride)[..., None] * T + q.clamp(max=T - 1)).reshape(N, -1)).view_as(q)
    return _walk(n, fed, d == tq1, lens, torch.zeros(N, dtype=torch.int64, device=ids.device), None)


def _walk(n: torch.Tensor, fed: torch.Tensor, hit: torch.Tensor, lens: torch.Tensor, start: torch.Tensor,
          span: int | None) -> torch.Tensor:
    """The rounds a decode walks, from row `start` [N] on: a round at n keeps its leading
    held drafts and the next starts after them (n + kept + 1). Rounds starting at or past
    start + `span` are not counted (None: to the window's end). n [N, T] every row's start;
    fed/hit [N, T, c] per start and step. The walk is found by pointer doubling over every
    row's successor (log2(T) gathers), so no loop runs over tokens. -> counts [c, 2]."""
    N, T = n.shape
    dev = n.device
    kept = torch.cumprod((fed & hit).to(torch.int8), -1).sum(-1)  # [N, T] leading held drafts
    # successor of every row; T is the sink past the end
    nxt = torch.cat([(n + kept + 1).clamp(max=T), torch.full((N, 1), T, device=dev)], 1)  # [N, T+1]
    seen = torch.zeros(N, T + 1, dtype=torch.bool, device=dev)
    seen[torch.arange(N, device=dev), start.to(dev).clamp(0, T)] = True
    jump = nxt
    # after k doublings `seen` holds the first 2^k rounds of the walk
    for _ in range(max(T, 1).bit_length() + 1):
        reach = torch.zeros(N, T + 1, dtype=torch.int32, device=dev)
        reach.scatter_add_(1, jump, seen.to(torch.int32))
        seen = seen | (reach > 0)
        jump = jump.gather(1, jump)
    live = seen[:, :T] & (n + 1 < lens[:, None])
    if span is not None:
        live &= n < start.to(dev)[:, None] + span
    return _tally(fed, hit, live)


def _walk_reference(ids, lens, t1, chain: int, guess, start=None, span=None) -> torch.Tensor:
    """Rounds walked one by one (tests only): each starts where the one before's kept drafts end,
    from `start[i]` (default 0) over rounds starting before start + `span` (None: the window's end);
    `guess(i, j, n, q)` is step j's draft for token q+1 of the round starting at row n."""
    out = torch.zeros(chain, 2, dtype=torch.int64)
    for i in range(ids.shape[0]):
        L = int(lens[i])
        n = 0 if start is None else int(start[i])
        end = L if span is None else min(L, n + span)
        while n + 1 < L and n < end:
            if int(ids[i, n + 1]) != int(t1[i, n]):
                n += 1
                continue
            kept = 0
            for j in range(1, chain + 1):
                q = n + j - 1
                if q + 1 >= L or int(ids[i, q + 1]) != int(t1[i, q]):
                    break
                hit = guess(i, j, n, q) == int(t1[i, q + 1])
                out[j - 1, 0] += 1
                out[j - 1, 1] += int(hit)
                if not hit:
                    break
                kept += 1
            n += kept + 1
    return out


def order_counts_reference(ids, lens, t1, top, stride: int, chain: int):
    return _walk_reference(ids, lens, t1, chain, lambda i, j, n, q: int(top[n % stride, i, q]))


# ── rounds as a decode walks them, from the prompt's end (stride 0) ────────


def walk_counts(ids, lens, t1, draft: torch.Tensor, start: torch.Tensor, span: int | None = None) -> torch.Tensor:
    """What speculative decoding accepts: rounds walked as a greedy decode walks them,
    the first at row `start` [N] (the prompt's last row: its trunk row and the first new
    token feed the first chain), each next one after the drafts the one before kept,
    over the rounds a decode of `span` new tokens runs (rounds starting before
    start + span; None: to the window's end). `draft` [chain, N, T] as in chain_counts:
    index p of step j is the chain starting at row p (what cortiq.mtp.rounds computes).
    On a window that is the trunk's own greedy continuation its drafts_per_round is
    exactly the drafts a round that decode accepts (a round's drafts past the window
    are not counted). -> counts [chain, 2]."""
    chain, N, T = draft.shape
    n = torch.arange(T, device=ids.device).expand(N, T)
    q, fed, tq1 = _steps(ids, lens, t1, n, chain)
    return _walk(n, fed, draft.permute(1, 2, 0) == tq1, lens, start, span)


def walk_counts_reference(ids, lens, t1, draft, start, span=None) -> torch.Tensor:
    """The walk round by round (tests only)."""
    return _walk_reference(ids, lens, t1, draft.shape[0], lambda i, j, n, q: int(draft[j - 1, i, n]), start, span)
