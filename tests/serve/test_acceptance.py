"""The server's speculative rounds keep exactly the drafts the offline measure
(`cortiq.mtp.measure_text`, what `mtp heal` judges a draft by) counts on the same
prompts and the same greedy text: same rounds, same drafts kept, in f32, with
requests joining and leaving, prompts prefilled in chunks and the next step
launched before the last one's tokens are handled."""

from __future__ import annotations

import threading

import pytest
import torch

from cortiq.model.generate import generate
from cortiq.mtp import measure_text
from cortiq.serve.engine import DecodeAdapter, LoopEngine
from cortiq.serve.scheduler import Request, Scheduler, collect

from serve_helpers import arch, random_model, stand_in_graphs
from test_pipeline import PROMPTS, _tok

NEW = 20


def _serve_all(eng, prompts, max_tokens: int, **kw) -> dict:
    """Every prompt at once from its own thread (more prompts than slots: later ones wait for a
    free slot) -> the scheduler's counters."""
    sched = Scheduler(eng, _tok(), (), speculative=True, **kw).start()
    try:
        ts = [threading.Thread(target=collect, args=(sched, Request(ids=list(p), max_tokens=max_tokens)))
              for p in prompts]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
    finally:
        sched.stop()
    return sched.stats


def _offline(m, prompts, depth: int, branches: int = 1) -> tuple[int, int]:
    """(rounds, drafts kept) the offline measure walks over each prompt's greedy continuation.
    The continuation runs past the answer's NEW tokens, so the last round's drafts lie in the
    text; the server decides an answer's first token at prefill, so its rounds are the walk's
    over NEW - 1 tokens."""
    seqs = [p + generate(m, p, max_new=NEW + depth + 1).tokens for p in prompts]
    r = measure_text(m, seqs, [len(p) for p in prompts], chain=depth, span=NEW - 1, branches=branches)["walk"]
    kept = sum(round(h * c) for h, c in zip(r["hold"], r["counted"]))  # a round keeps its leading held drafts
    return r["counted"][0], kept


@pytest.mark.parametrize("kind,depth,engine", [("llama", 3, "decode"), ("llama", 1, "decode"),
                                                ("hybrid", 2, "decode"), ("llama", 3, "loop")])
def test_the_server_keeps_the_drafts_the_offline_measure_counts(kind, depth, engine):
    m = random_model(arch(kind), mix=0.5, seed=2)
    rounds, kept = _offline(m, PROMPTS, depth)
    assert 0 < kept < depth * rounds  # neither no draft nor every draft right: the comparison can fail
    eng = (DecodeAdapter if engine == "decode" else LoopEngine)(m, 4, 96, draft=depth)
    st = _serve_all(eng, PROMPTS, NEW, prefill_chunk=3)
    assert st["tokens"] == NEW * len(PROMPTS) and st["steps"] == 0  # every step was a round
    assert (st["rounds"], st["round_tokens"] - st["rounds"]) == (rounds, kept)


@pytest.mark.parametrize("depth,branches", [(3, 3), (1, 4)])
def test_a_tree_keeps_what_the_offline_tree_measure_counts(depth, branches):
    # the measure's tree: step 1 holds where the trunk's token is among the draft's top `branches`
    m = random_model(arch("llama"), mix=0.5, seed=2)
    rounds, kept = _offline(m, PROMPTS, depth, branches)
    chain_rounds, chain_kept = _offline(m, PROMPTS, depth)
    assert kept / rounds > chain_kept / chain_rounds  # the other first guesses add drafts: the test can fail
    assert kept < depth * rounds
    st = _serve_all(DecodeAdapter(m, 4, 96, draft=depth, branches=branches), PROMPTS, NEW, prefill_chunk=3)
    assert st["tokens"] == NEW * len(PROMPTS) and st["steps"] == 0
    assert (st["rounds"], st["round_tokens"] - st["rounds"]) == (rounds, kept)


@pytest.mark.parametrize("depth,branches,chunk", [(3, 1, 5), (1, 1, 0), (3, 3, 5)])
def test_the_captured_graph_path_keeps_what_the_offline_measure_counts(depth, branches, chunk, monkeypatch):
    # the server's CUDA path (bucket graphs, staged prefill graphs), CPU-tested with stand-in
    # graphs: answers alone would not show a draft row written wrong, its count of drafts kept does
    m = random_model(arch("llama"), mix=0.5, seed=2)
    rounds, kept = _offline(m, PROMPTS, depth, branches)
    eng, graphs = stand_in_graphs(m, 4, 96, monkeypatch, draft=depth, branches=branches)
    st = _serve_all(eng, PROMPTS, NEW, prefill_chunk=chunk)
    assert sum(g.replays for g in graphs) > 0
    assert st["tokens"] == NEW * len(PROMPTS) and st["steps"] == 0
    assert (st["rounds"], st["round_tokens"] - st["rounds"]) == (rounds, kept)


def _tree_walk(m, x, P: int, new: int, widths: tuple[int, ...], k: int) -> tuple[int, int]:
    """The reference for a static draft tree (every node at step j has the draft's top w_j as its
    children), one round at a time from scratch with the model's own trunk and MTP forwards:
    greedy decoding of x's prompt (x[:P]; x is that prompt's greedy continuation), the first token
    decided at prefill, each round keeping the longest tree path the trunk agrees with. Sibling
    tokens differ, so that path is the one along the trunk's own tokens: its node at step j holds
    where the trunk's token is among the draft's top w_j there. A round's drafts count up to x's
    end, past the answer's `new` tokens too (as the engine counts its last round's). -> (rounds,
    drafts kept)"""
    from cortiq.model.decoder import KVState

    pos, rounds, kept = P, 0, 0  # x[pos] is the pending token: the trunk has seen x[:pos]
    while pos - P + 1 < new:
        t = torch.tensor([x[:pos]])
        H, _ = m.forward_hidden(t)
        st = KVState()
        if pos > 1:
            m.mtp_forward(H[:, :-1], t[:, 1:], 0, st)
        xh = m.mtp_forward(H[:, -1:], torch.tensor([[x[pos]]]), pos - 1, st)
        a = 0
        for j in range(1, k + 1):
            w = widths[j - 1] if j <= len(widths) else 1
            if pos + j >= len(x) or x[pos + j] not in m.logits(xh[0, -1]).topk(w).indices.tolist():
                break
            a = j
            xh = m.mtp_forward(xh, torch.tensor([[x[pos + j]]]), pos - 1 + j, st)
        rounds, kept, pos = rounds + 1, kept + a, pos + a + 1
    return rounds, kept


def test_the_offline_measure_of_a_static_tree_is_what_that_tree_keeps():
    """measure_text with per-step widths (`branches=(w1, w2, ...)`: a tree no engine runs yet,
    measured to choose which to build) counts the rounds and drafts such a tree keeps, against
    `_tree_walk`; widths (N,) are the engine's tree of N first guesses (tested above)."""
    m = random_model(arch("llama"), mix=0.5, seed=2)
    depth = 3
    seqs = [p + generate(m, p, max_new=NEW + depth + 1).tokens for p in PROMPTS]
    got = {}
    with torch.no_grad():
        for widths in [(1,), (3,), (3, 3, 3), (1, 3, 2)]:
            ref = [_tree_walk(m, x, len(p), NEW, widths, depth) for x, p in zip(seqs, PROMPTS)]
            rounds, kept = sum(r for r, _ in ref), sum(a for _, a in ref)
            off = measure_text(m, seqs, [len(p) for p in PROMPTS], chain=depth, span=NEW - 1, branches=widths)["walk"]
            assert off["counted"][0] == rounds
            assert off["drafts_per_round"] == pytest.approx(kept / rounds, abs=1e-12)
            got[widths] = kept / rounds
    # every step's width adds drafts where the chain misses: the comparisons above can fail
    assert got[(1,)] < got[(3,)] < got[(3, 3, 3)] < depth and got[(1,)] < got[(1, 3, 2)]
