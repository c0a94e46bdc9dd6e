"""The server's speculative rounds keep exactly the drafts the offline measure
(`cortiq.mtp.measure_text`, what `mtp heal` judges a draft by) counts on the same
prompts and the same greedy text: same rounds, same drafts kept, in f32, with
requests joining and leaving, prompts prefilled in chunks and the next step
launched before the last one's tokens are handled."""

from __future__ import annotations

import threading

import pytest

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
