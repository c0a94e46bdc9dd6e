"""The heal's target kinds, one object each: what the targets stage stores per
row, how it builds those rows from the teacher, which loss the trainer scores
them with, whether the teacher runs there or online in the trainer, and what
the fused head + loss holds in memory.

- "topk": the teacher's k most likely ids, renormalised over them;
- "topk+rest": the same k entries unnormalised, and one last slot holding the
  mass on every other id (its id is `REST_ID`, never a token);
- "sampled": k draws from the teacher's distribution; each distinct id stored
  with weight count/k (unused slots weigh 0 and may repeat an id), so the
  stored row is an unbiased estimate of the teacher's whole distribution;
- "full": the teacher's whole distribution, the teacher run online in the
  trainer; the targets stage stores the data's next token and the row weight;
- "ce": plain cross-entropy on the data's next token, no teacher at all (the
  kind in effect whenever `ce` is 1, whatever `target` says).

Settings, targets, train and memory look a kind up by name once (`KINDS`);
the name is what the targets' meta.json and the targets digest carry. This
module imports torch only inside the methods that compute, so the settings
(the CLI's defaults) stay free of it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the kinds a user may name in `HealSettings.target` ("ce" follows from ce = 1)
CHOICES = ("topk", "topk+rest", "sampled", "full")
#: the `target` setting's default, and the kind a loss is scored as when none is named
DEFAULT = "sampled"
#: the id of the "topk+rest" rest slot: outside any vocabulary, so a slip that
#: gathers it fails loudly
REST_ID = (1 << 32) - 1


def mix_targets(ids, probs, nxt, weight, ce: float):
    """Targets of rows: teacher `ids`/`probs` [N, k], the data's next token `nxt` [N],
    row `weight` [N] -> (ids [N, k], probs [N, k]) = weight·(α·onehot(next) + (1−α)·topk).

    With 0 < α < 1 the hard target takes a slot: its own if the teacher ranked
    it, else the weakest entry's (ids stay distinct); the teacher part is
    renormalised over what is left. α = 0: the teacher alone; α = 1: the one-hot."""
    import torch

    ids = ids.clone()
    probs = probs.float().clone()
    nxt = nxt.to(ids.dtype)
    alpha = float(ce)
    if alpha >= 1.0:
        ids = nxt[:, None]
        probs = torch.ones_like(ids, dtype=torch.float32)
    elif alpha > 0.0:
        k = ids.shape[1]
        match = ids == nxt[:, None]  # [N, k]
        has = match.any(1)  # [N]
        slot = torch.where(has, match.to(torch.int8).argmax(1), torch.full_like(nxt, k - 1))  # [N]
        miss = ~has
        ids[miss, k - 1] = nxt[miss]
        probs[miss, k - 1] = 0.0
        s = probs.sum(1, keepdim=True).clamp_min(1e-12)
        probs = (1.0 - alpha) * probs / s
        probs.scatter_add_(1, slot[:, None], torch.full((len(slot), 1), alpha, dtype=probs.dtype, device=probs.device))
    return ids, probs * weight.float()[:, None]


@dataclass(frozen=True)
class TargetKind:
    """One target kind (see the module's docstring); the methods are its behaviour."""

    name: str
    #: the targets stage runs the teacher over the windows and stores its rows
    teacher_pass: bool
    #: the trainer runs the teacher at every step (its whole distribution is the target)
    online: bool = False
    #: the stored rows are random draws, seeded by `HealSettings.seed` (the seed enters the digest)
    seeded: bool = False
    #: one more stored slot per row for the rest of the vocabulary's mass
    rest_slot: bool = False
    #: bytes per [chunk, vocab] entry the fused head + loss holds (the memory estimate's
    #: head term): the top-k loss makes its gradient in the forward in compiled passes
    #: (bf16 logits and dL/dz, as measured from the peaks at two chunk sizes: bench/RESULTS.md,
    #: "Every plan in whole"); the rest-bucket and dense losses run f32 passes eager (f32 logits, their
    #: exp, the target or scatter copy)
    head_entry: int = 4

    @property
    def names_teacher(self) -> bool:
        """Whether the targets depend on a teacher (stored from it, or read by the trainer)."""
        return self.teacher_pass or self.online

    def slots(self, topk: int, ce: float) -> int:
        """Stored entries per row: the teacher's k, one more when the hard target is
        mixed in, one more for the rest bucket; 1 (the next token and the row weight)
        when no teacher output is stored."""
        if not self.teacher_pass:
            return 1
        return topk + (ce > 0.0) + self.rest_slot

    # ── the rows the targets stage stores ──
    def chunk_rows(self, z, nxt, weight, k: int, ce: float, generator=None):
        """One chunk of teacher logits `z` [c, V], the data's next token `nxt` [c] and row
        `weight` [c] -> stored (ids int64 [c, slots], probs f32 [c, slots])."""
        raise ValueError(f"target kind {self.name!r} stores no rows built from teacher logits")

    def teacher_rows(self, teacher, h, nxt, weight, k: int, ce: float, chunk: int, generator=None):
        """The stored rows of the teacher's final hidden rows `h` [B, T, H]: (ids [B·T, slots],
        probs [B·T, slots]); the head runs `chunk` rows at a time, so [B·T, V] logits never
        exist at once."""
        import torch

        rows = h.reshape(-1, h.shape[-1])
        parts = [self.chunk_rows(teacher.logits(rows[a : a + chunk]), nxt[a : a + chunk], weight[a : a + chunk],
                                 k, ce, generator)
                 for a in range(0, rows.shape[0], chunk)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    # ── the loss the trainer scores them with ──
    def loss(self, rows, head_weight, tid, tp, chunk: int, ids=None, teacher=None, ce: float = 0.0):
        """The summed loss of the student's normed rows `rows` [N, H] through `head_weight`
        against the stored targets `tid`/`tp` [N, slots] (`ids` [B, T], the windows' tokens,
        and `teacher` for a kind whose teacher runs online)."""
        from .loss import topk_kl

        return topk_kl(rows, head_weight, tid, tp, chunk=chunk)


class _TopK(TargetKind):
    def teacher_rows(self, teacher, h, nxt, weight, k: int, ce: float, chunk: int, generator=None):
        # the top k+1 when the hard target is mixed in: it takes the weakest slot when the teacher did not rank it
        n = self.slots(k, ce)
        tid, tp = teacher.topk_next(h, n, chunk=chunk)  # [B, T, n]
        return mix_targets(tid.reshape(-1, n), tp.reshape(-1, n), nxt, weight, ce)


class _TopKRest(TargetKind):
    def chunk_rows(self, z, nxt, weight, k: int, ce: float, generator=None):
        """k+1 listed ids with 0 < ce: the teacher's top k and the data's token (the
        (k+1)-th most likely id when the token is already among the k), so the hard
        target always has its own entry and the rest bucket stays disjoint from it;
        each listed id carries (1−ce)·p_teacher (+ ce on the token), the rest slot
        (1−ce)·(1 − Σ p_listed), taken as a logsumexp off the listed ids (1 − Σp
        cancels in f32 when the k hold nearly all of the mass)."""
        import torch

        zf = z.float()
        c = zf.shape[0]
        nxt = nxt.long()
        wt = weight.float()[:, None]
        extra = int(ce > 0.0)
        lse = torch.logsumexp(zf, -1, keepdim=True)  # [c, 1]
        top = zf.topk(k + extra, -1).indices  # [c, k(+1)]
        if extra:
            ranked = (top[:, :k] == nxt[:, None]).any(1)  # [c]
            top[:, k] = torch.where(ranked, top[:, k], nxt)
        pt = torch.exp(zf.gather(1, top) - lse)  # [c, k(+1)] the teacher's own probabilities
        rest = torch.exp(torch.logsumexp(zf.scatter(1, top, float("-inf")), -1, keepdim=True) - lse)  # [c, 1]
        probs = (1.0 - ce) * pt
        if extra:
            probs = probs + ce * (top == nxt[:, None])
        ids = torch.cat([top, torch.full((c, 1), REST_ID, dtype=top.dtype, device=top.device)], 1)
        return ids, torch.cat([probs, (1.0 - ce) * rest], 1) * wt

    def loss(self, rows, head_weight, tid, tp, chunk: int, ids=None, teacher=None, ce: float = 0.0):
        from .loss import topk_rest_kl

        # the last slot is the rest bucket
        return topk_rest_kl(rows, head_weight, tid[:, :-1], tp[:, :-1], tp[:, -1], chunk=chunk)


class _Sampled(TargetKind):
    def chunk_rows(self, z, nxt, weight, k: int, ce: float, generator=None):
        """k draws with replacement from softmax(z) (torch.multinomial on the chunk's
        rows, `generator` seeds it); each distinct id drawn holds one slot with weight
        count·(1−ce)/k (+ ce at the token), found by sorting the k draws (no [c, V]
        work beyond the softmax); slots beyond the distinct ids weigh 0 (their ids mean
        nothing). E[stored] = weight·((1−ce)·p + ce·onehot)."""
        import torch

        zf = z.float()
        c = zf.shape[0]
        nxt = nxt.long()
        wt = weight.float()[:, None]
        extra = int(ce > 0.0)
        p = torch.softmax(zf, -1)  # [c, V]
        draws = torch.multinomial(p, k, replacement=True, generator=generator).sort(-1).values  # [c, k]
        del p
        # equal draws are neighbours once sorted: each run of one id becomes one
        # slot (its first), weighted count·(1−ce)/k; the rest of the row weighs 0
        first = torch.ones_like(draws, dtype=torch.bool)
        first[:, 1:] = draws[:, 1:] != draws[:, :-1]
        run = first.long().cumsum(-1) - 1  # [c, k] the slot of each draw's run
        ids = torch.zeros(c, k + extra, dtype=torch.long, device=zf.device).scatter_(1, run, draws)
        probs = torch.zeros(c, k + extra, device=zf.device).scatter_add_(
            1, run, torch.full((c, k), (1.0 - ce) / k, device=zf.device))
        if extra:
            # the hard target: added to its own slot when drawn, else it takes the
            # last slot (k draws fill at most k, so that one is always free)
            hit = ids[:, :k] == nxt[:, None]  # [c, k]; slots past the runs weigh 0 and may repeat an id
            hit &= probs[:, :k] > 0
            drawn = hit.any(1)
            slot = torch.where(drawn, hit.to(torch.int8).argmax(1), torch.full_like(nxt, k))
            ids[:, k] = torch.where(drawn, ids[:, k], nxt)
            probs.scatter_add_(1, slot[:, None], torch.full((c, 1), ce, device=zf.device))
        return ids, probs * wt


class _Full(TargetKind):
    def loss(self, rows, head_weight, tid, tp, chunk: int, ids=None, teacher=None, ce: float = 0.0):
        import torch

        from .loss import dense_kl

        # stored: the next token and the row weight; the teacher runs here
        with torch.no_grad():
            th, _ = teacher.forward_hidden(ids)  # [B, T, H']
        return dense_kl(rows, head_weight, th.reshape(-1, th.shape[-1]), teacher.head_weight, tid[:, 0], tp[:, 0],
                        ce, chunk=chunk)


TOPK = _TopK("topk", teacher_pass=True)
TOPK_REST = _TopKRest("topk+rest", teacher_pass=True, rest_slot=True, head_entry=12)
SAMPLED = _Sampled("sampled", teacher_pass=True, seeded=True)
FULL = _Full("full", teacher_pass=False, online=True, head_entry=16)
CE = TargetKind("ce", teacher_pass=False)

KINDS: dict[str, TargetKind] = {k.name: k for k in (TOPK, TOPK_REST, SAMPLED, FULL, CE)}


def kind_in_effect(target: str, ce: float) -> TargetKind:
    """The kind a heal with `target` and hard-target weight `ce` runs: "ce" when ce is 1
    (no teacher takes part), else the named one."""
    return CE if ce >= 1.0 else KINDS[target]


def stored_kind(name: str, where) -> TargetKind:
    """The kind a targets stage directory's meta.json names (`where`: the directory)."""
    from ..errors import CortiqError

    try:
        return KINDS[name]
    except KeyError:
        raise CortiqError(f"{where}: targets of an unknown kind {name!r} (known: {', '.join(KINDS)})") from None
