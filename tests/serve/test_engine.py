"""Serving engines: slots of different lengths decoded in one batch give each
sequence's own greedy output; speculative rounds give the greedy output."""

import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.model.generate import generate
from cortiq.serve.engine import DecodeAdapter, LoopEngine, make_engine

from serve_helpers import arch, drive, random_model

PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [1], [250, 251, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 33], [64, 65]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "hybrid"])
def test_prefill_and_step_logits_equal_the_full_forward(kind):
    m = random_model(arch(kind))
    eng = DecodeAdapter(m, max_batch=5, max_len=40)
    # slots 4, 0, 2: out of order and not contiguous; a released slot is reused
    eng.prefill(1, [7, 7, 7, 7, 7, 7, 7, 7, 7])
    eng.release(1)
    seqs = {4: list(PROMPTS[0]), 0: list(PROMPTS[1]), 1: list(PROMPTS[2])}
    for s, p in seqs.items():
        got = eng.prefill(s, p)
        torch.testing.assert_close(got, m(torch.tensor([p]))[0, -1], rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        slots = sorted(seqs)
        toks = torch.randint(0, 259, (len(slots),), generator=g).tolist()
        got = eng.step(slots, toks)
        assert eng.picked.tolist() == got.argmax(-1).tolist()  # the engine's own choice agrees
        for s, t, row in zip(slots, toks, got):
            seqs[s].append(t)
            torch.testing.assert_close(row, m(torch.tensor([seqs[s]]))[0, -1], rtol=1e-4, atol=1e-4)
            assert eng.length(s) == len(seqs[s])
    loop = LoopEngine(m, max_batch=5, max_len=40)
    for s, p in seqs.items():
        loop.prefill(s, p)
    torch.testing.assert_close(loop.step([0, 1, 4], [3, 4, 5]), eng.step([0, 1, 4], [3, 4, 5]), rtol=1e-4, atol=1e-4)
    with pytest.raises(CortiqError, match="every active slot"):  # the decode engine advances all of them
        eng.step([0, 4], [1, 2])


ENGINES = {"decode": DecodeAdapter, "loop": LoopEngine}


@pytest.mark.parametrize("kind,engine", [("llama", "decode"), ("qwen3", "decode"), ("hybrid", "decode"), ("hybrid", "loop")])
def test_batched_greedy_with_joins_equals_each_alone(kind, engine):
    m = random_model(arch(kind))
    eng = make_engine(m, max_batch=3, max_len=64, kind=engine)
    assert type(eng) is ENGINES[engine]
    got, _ = drive(eng, PROMPTS, max_new=10, joins=[0, 0, 2, 5])  # 4 prompts, 3 slots: one waits for a free slot
    for p, g in zip(PROMPTS, got):
        assert g == generate(m, p, max_new=10).tokens


@pytest.mark.parametrize("kind,engine,draft,how", [
    ("llama", "decode", 1, True), ("llama", "decode", 3, "alternate"), ("qwen3", "decode", 2, True),
    ("hybrid", "decode", 3, True), ("llama", "loop", 2, "alternate"), ("hybrid", "loop", 2, True)])
def test_speculative_rounds_equal_greedy(kind, engine, draft, how):
    m = random_model(arch(kind), mix=0.5)
    eng = make_engine(m, max_batch=4, max_len=64, draft=draft, kind=engine)
    prompts = [[1, 2, 3], [0, 3, 1, 2, 2, 1], [3], [2, 0]]
    got, rounds = drive(eng, prompts, max_new=12, speculative=how, joins=[0, 1, 1, 4])
    for p, g in zip(prompts, got):
        assert g == generate(m, p, max_new=12).tokens
    per_round = [r for rs in rounds for r in rs]
    # the rounds both accepted and rejected drafts (so the roll-back ran), never more than drafted
    assert max(per_round) >= 2 and min(per_round) == 1 and max(per_round) <= draft + 1
    if how == "alternate":  # plain steps between rounds keep the draft's rows: it still gets drafts right
        assert sum(r > 1 for r in per_round) >= len(per_round) // 4


def test_a_draft_tree_answers_greedy():
    # three first guesses a round, each chained: the branch keeping most wins, the answers stay greedy's
    m = random_model(arch("llama"), mix=0.5)
    prompts = [[1, 2, 3], [0, 3, 1, 2, 2, 1], [3], [2, 0]]
    got, rounds = drive(make_engine(m, 4, 64, draft=3, branches=3), prompts, max_new=12, speculative=True,
                        joins=[0, 1, 1, 4])
    for p, g in zip(prompts, got):
        assert g == generate(m, p, max_new=12).tokens
    per_round = [r for rs in rounds for r in rs]
    assert max(per_round) >= 2 and max(per_round) <= 4
    with pytest.raises(CortiqError, match=r"^engine loop: a draft tree \(draft_branches > 1\) needs the decode engine$"):
        make_engine(m, 2, 16, draft=1, kind="loop", branches=2)


def test_a_narrow_draft_serves_greedy_answers():
    # the draft guessing among 3 of the tokens (`draft_vocab`) in the server's engine, joins and all:
    # the answers stay greedy's; the loop engine drafts over the whole head alone
    m = random_model(arch("llama"), mix=0.5)
    prompts = [[1, 2, 3], [0, 3, 1, 2, 2, 1], [3], [2, 0]]
    eng = make_engine(m, 4, 64, draft=2, draft_vocab=torch.tensor([2, 0, 3]))
    assert eng.draft_rows == 3 and make_engine(m, 4, 64, draft=2).draft_rows == 0
    got, _ = drive(eng, prompts, max_new=12, speculative=True, joins=[0, 1, 1, 4])
    for p, g in zip(prompts, got):
        assert g == generate(m, p, max_new=12).tokens
    with pytest.raises(CortiqError, match=r"^engine loop: a draft among some tokens \(--draft-vocab\) needs the "
                                          r"decode engine$"):
        make_engine(m, 2, 16, draft=1, kind="loop", draft_vocab=torch.tensor([1, 2]))


def test_the_engines_speculate_the_same_rounds():
    m = random_model(arch("llama"), mix=0.5, seed=3)
    prompts = [[1, 2, 3], [0, 3, 1, 2, 2, 1], [3]]
    a = drive(LoopEngine(m, 3, 64, draft=2), prompts, max_new=12, speculative=True)
    b = drive(DecodeAdapter(m, 3, 64, draft=2), prompts, max_new=12, speculative=True)
    assert a == b


def test_bad_use_is_a_clear_error():
    m = random_model(arch("llama", mtp=False))
    with pytest.raises(CortiqError, match="MTP draft"):
        make_engine(m, 2, 16, draft=1)
    with pytest.raises(CortiqError, match="engine kind"):
        make_engine(m, 2, 16, kind="fast")
    for eng in (DecodeAdapter(m, 2, 8), LoopEngine(m, 2, 8)):
        with pytest.raises(CortiqError, match="prompt of 8 tokens"):
            eng.prefill(0, list(range(8)))
        with pytest.raises(CortiqError, match="slot 2"):
            eng.prefill(2, [1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_refresh_the_rows_the_server_reads():
    m = random_model(arch("llama"), mix=0.5).to("cuda")
    prompts = [[1, 2, 3], [0, 3, 1, 2, 2, 1], [3], [2, 0]]
    want = [generate(m, p, max_new=12).tokens for p in prompts]
    plain = DecodeAdapter(m, 3, 64)
    assert plain.eng.graphs  # the step is a replayed graph: logits come from the rows it refreshed
    assert drive(plain, prompts, max_new=12, joins=[0, 1, 1, 4])[0] == want
    spec = DecodeAdapter(m, 3, 64, draft=2)
    assert drive(spec, prompts, max_new=12, speculative="alternate", joins=[0, 1, 1, 4])[0] == want
