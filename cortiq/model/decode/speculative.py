"""A speculative round's pieces: the draft tree's tables, a round's verdict (the drafts kept,
the winning branch), and the in-place buffer updates that end a step or a round."""

from __future__ import annotations

from typing import NamedTuple

import torch


class _Tree(NamedTuple):
    """The fixed shape of a draft tree of nb = `branches` branches at the root, each a chain of
    k = `draft` drafts (`_tree_tables`): the tables its verify blocks and chain steps index with."""

    verify: dict  # depth d -> (rope offsets [T], ancestry [T, T] bool, paths [nb, d+1]); T = 1 + nb·d
    chain: dict  # chain step j (1..k-1) -> (block rows [nb], rope offsets [nb], ancestry rows [nb, nb·(k-1)])


def _tree_tables(branches: int, draft: int, dev) -> _Tree:
    """A root-branching draft tree: the draft's top nb = `branches` guesses for the first token,
    each continued greedily to a chain of k = `draft` (EAGLE-2's tree, cut to its widest level: on a SmolLM2
    draft, measured offline, `nb` chains of the top `nb` first guesses kept more drafts per
    verified row than trees that branch deeper, and four of them twice the chain's drafts a
    round; bench/DECODE.md, "A draft tree"). One verify block holds the pending token
    (row 0) and branch b's drafts 1..d at rows 1 + b·d ..; each row sees row 0 and its own
    branch up to itself, at position pending + its depth. The chain's rows of steps 1..k-1
    lie in a block of nb·(k-1) rows past the chain's first position, branch b's at b·(k-1) ..;
    each sees its own branch's earlier rows."""
    nb, k = branches, draft
    verify = {}
    for d in range(1, k + 1):
        T = 1 + nb * d
        br = torch.cat([torch.tensor([-1]), torch.arange(nb).repeat_interleave(d)])  # [T] branch of a row
        dep = torch.cat([torch.tensor([0]), torch.arange(1, d + 1).repeat(nb)])  # [T] depth of a row
        anc = ((br[:, None] == br[None]) & (dep[None] <= dep[:, None])) | (torch.arange(T) == 0)[None]
        paths = torch.cat([torch.zeros(nb, 1, dtype=torch.long),
                           1 + torch.arange(nb)[:, None] * d + torch.arange(d)[None]], 1)  # [nb, d+1]
        verify[d] = (dep.to(dev), anc.to(dev), paths.to(dev))
    chain = {}
    if k > 1:
        C = k - 1
        br = torch.arange(nb).repeat_interleave(C)  # [nb·C]
        dep = torch.arange(C).repeat(nb)
        anc = (br[:, None] == br[None]) & (dep[None] <= dep[:, None])  # [nb·C, nb·C]
        for j in range(1, k):
            rows = torch.arange(nb) * C + (j - 1)
            chain[j] = (rows.to(dev), dep[rows].to(dev), anc[rows].to(dev))
    return _Tree(verify, chain)


def _kept(tok, pred):
    """Drafts kept along the last dim: tok [..., d+1] a verify block's tokens (the pending one,
    then the drafts), pred [..., d+1] the trunk's token after each -> [...] the length of the
    agreeing prefix."""
    return (tok[..., 1:] == pred[..., :-1]).long().cumprod(-1).sum(-1)


def _tree_choice(block, pred, paths, pos, ar_d, top: int):
    """A tree round's verdict, from the verify block's tokens block [S, T], the trunk's token
    after each pred [S, T] and each branch's block rows paths [nb, d+1] in order: the branch
    keeping the most drafts (the first of equals) -> (its rows path [S, d+1], its trunk tokens
    [S, d+1], its drafts kept [S], and the cache positions its keys and values move from and
    to, src and dst [S, d+1], after the pending positions pos [S]; ar_d = arange(d+1); clamped
    to top, as an inactive slot may point anywhere)."""
    tok_b, pred_b = block[:, paths], pred[:, paths]  # [S, nb, d+1]: each branch's rows in order
    kept = _kept(tok_b, pred_b)  # [S, nb]
    best = kept.argmax(-1)  # [S]
    path = paths[best]  # [S, d+1]
    pred_k = pred_b.gather(1, best[:, None, None].expand(-1, 1, pred_b.shape[-1]))[:, 0]  # [S, d+1]
    return (path, pred_k, kept.gather(1, best[:, None])[:, 0], (pos[:, None] + path).clamp(max=top),
            (pos[:, None] + ar_d).clamp(max=top))


def _plain_end(pend, pos, out_tok, act, nxt):
    """The end of a plain step, on the engine's buffers in place: an active slot's pending
    token pend [S] and output out_tok [S] become nxt [S] (an inactive slot's output -1), its
    position pos [S] moves on by one."""
    pend.copy_(torch.where(act, nxt, pend))
    pos.add_(act.long())
    out_tok.copy_(torch.where(act, nxt, -1))


def _round_end(pend, pos, out_pred, out_n, mtp_last, act, pred, a, row):
    """The end of a round, on the engine's buffers in place, from the verified block's trunk
    tokens pred [S, d+1], the drafts kept a [S] and the draft's row after the last kept one,
    row [S, 1, H] (the next chain's step 0, kept in mtp_last): an active slot's pending token
    becomes the trunk's token after its last kept row, its position moves on by a+1;
    out_pred[:, :d+1] and out_n [S] (0 where inactive) say what the round decided."""
    n = (a + 1) * act.long()
    mtp_last.copy_(row)
    pend.copy_(torch.where(act, pred.gather(1, a[:, None])[:, 0], pend))
    pos.add_(n)
    out_pred[:, : pred.shape[1]].copy_(pred)
    out_n.copy_(n)


def _put_drafts(drafts, act, new):
    """A chain's drafts, the list new of [S, nb] per chain step, into drafts [S, nb·k] in place
    (branch b's chain at b·k..), an active slot's only."""
    S = drafts.shape[0]
    drafts.copy_(torch.where(act[:, None], torch.stack(new, 2).reshape(S, -1), drafts))
