"""Every target kind, one object each (cortiq.heal.kinds): the rows it stores, scored by
its loss, equal the plain full-logits KL against the same target (values and gradients,
random inputs, awkward sizes); and no code outside the kinds branches on a kind's name."""

import re
from pathlib import Path

import pytest
import torch

from cortiq.heal.kinds import CE, DEFAULT, KINDS, kind_in_effect
from cortiq.heal.settings import HealSettings
from cortiq.heal.kinds import mix_targets
from cortiq.heal.train import Objective

B, T, H, HT, V, K, CHUNK = 3, 7, 10, 9, 53, 6, 8
ROOT = Path(__file__).resolve().parents[2]


class _Teacher:
    """A teacher as the kinds use one: hidden rows of ids, logits of rows, a top-k of rows."""

    def __init__(self, g):
        self.emb = torch.randn(V, HT, generator=g, dtype=torch.float64)
        self.head_weight = torch.randn(V, HT, generator=g, dtype=torch.float64) * 0.5

    def forward_hidden(self, ids):
        return self.emb[ids], None

    def logits(self, rows):
        return rows @ self.head_weight.t()

    def topk_next(self, h, k, chunk=1024):
        p = torch.softmax(self.logits(h).double(), -1)
        top = p.topk(k, -1)
        return top.indices, (top.values / top.values.sum(-1, keepdim=True)).float()


def _stored(kind, teacher, ids, nxt, wt, ce, g):
    """What the targets stage stores for `kind` (cortiq.heal.targets.teacher_targets)."""
    if kind.teacher_pass:
        h, _ = teacher.forward_hidden(ids)
        return kind.teacher_rows(teacher, h, nxt, wt, K, ce, 5, g)
    return mix_targets(nxt[:, None], torch.ones(len(nxt), 1), nxt, wt, 1.0)


def _reference(kind, hidden, w, tid, tp, ids, teacher, ce, wt):
    """The plain loss: full logits in f64, the target as a dense [N, V] picture where it is one."""
    logq = torch.log_softmax(hidden @ w.t(), -1)  # [N, V]
    if kind.online:
        t = (1 - ce) * torch.softmax(teacher.logits(teacher.forward_hidden(ids)[0].reshape(-1, HT)), -1)
        t = t + ce * torch.nn.functional.one_hot(tid[:, 0].long(), V).double()
        return (wt.double()[:, None] * (torch.xlogy(t, t) - t * logq)).sum()  # each row's KL times its weight
    p = tp.double()
    if kind.rest_slot:
        listed, rest = tid[:, :-1].long(), p[:, -1]
        p = p[:, :-1]
        q_listed = logq.gather(1, listed).exp().sum(1)
        return ((torch.xlogy(p, p) - p * logq.gather(1, listed)).sum()
                + (torch.xlogy(rest, rest) - rest * torch.log1p(-q_listed)).sum())
    # the listed entries as a dense row (a "sampled" row's unused slots weigh 0)
    t = torch.zeros(len(p), V, dtype=torch.float64).scatter_add_(1, tid.long(), p)
    return (torch.xlogy(t, t) - t * logq).sum()


@pytest.mark.parametrize("name,ce", [(n, c) for n in KINDS for c in ((1.0,) if n == "ce" else (0.0, 0.3))])
def test_every_kinds_loss_is_the_plain_kl_of_its_stored_rows(name, ce):
    g = torch.Generator().manual_seed(3)
    kind = KINDS[name]
    teacher = _Teacher(g)
    ids = torch.randint(0, V, (B, T), generator=g)
    nxt = torch.randint(0, V, (B * T,), generator=g)
    wt = torch.rand(B * T, generator=g, dtype=torch.float64) + 0.5
    wt[[2, 11]] = 0.0  # unscored rows
    tid, tp = _stored(kind, teacher, ids, nxt, wt, ce, torch.Generator().manual_seed(5))
    assert tid.shape == tp.shape == (B * T, kind.slots(K, ce))
    hidden = torch.randn(B * T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    h1, w1 = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    obj = Objective(name, teacher if kind.online else None, ce)
    fast = obj.kind.loss(h1, w1, tid, tp.double(), CHUNK, ids, obj.teacher, obj.ce)
    ref = _reference(kind, h2, w2, tid, tp, ids, teacher, ce, wt)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-6, atol=1e-6)
    (fast * 1.3).backward()
    (ref * 1.3).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)


def test_the_kind_in_effect_and_one_default():
    assert kind_in_effect("topk+rest", 1.0) is CE and not CE.names_teacher
    assert HealSettings(ce=1.0, target="full").target_kind is CE
    assert HealSettings(target="full").target_kind is KINDS["full"]
    # the setting, an Objective and the memory estimate default to one kind
    assert HealSettings().target == DEFAULT and Objective().kind is KINDS[DEFAULT]
    assert [HealSettings(target=n, topk=8, ce=0.25).slots for n in ("topk", "topk+rest", "sampled", "full")] == \
        [9, 10, 9, 1]


def test_nothing_outside_the_kinds_branches_on_a_kinds_name():
    names = "|".join(re.escape(n) for n in KINDS)
    branch = re.compile(rf'(==|!=|\bin)\s*\(?\s*"({names})"|"({names})"\s*(==|!=)')
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted((ROOT / "cortiq").rglob("*.py")) if p.name != "kinds.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert hits == []
