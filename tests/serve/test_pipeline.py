"""The pipelined scheduler (next step launched before the last one's tokens are handled),
bucketed steps, chunked prefill and speculation that decides per step give plain greedy
decoding's tokens, whatever joins and leaves; the pieces they are built of."""

from __future__ import annotations

import threading

import pytest
import torch

from cortiq.model.decode import DecodeEngine
from cortiq.model.generate import generate
from cortiq.serve.detok import IncrementalText
from cortiq.serve.engine import DecodeAdapter, LoopEngine, bucket_sizes
from cortiq.serve.policy import DepthPolicy
from cortiq.serve.scheduler import Event, Request, Scheduler, collect, merged
from cortiq.tokenizer import byte_tokenizer_json

from serve_helpers import EOS, arch, drive, random_model, stand_in_graphs

PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [1], [250, 251, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 33], [64, 65], [3, 1, 2],
           [0, 3, 1, 2, 2, 1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8], [2, 0], [9, 9, 8]]


def _tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_tokenizer_json())


def test_bucket_sizes():
    assert bucket_sizes(1) == [1] and bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_a_bucket_step_equals_the_full_step(kind):
    """Slots 0..b-1 stepped as a bucket give the tokens (and leave the state) of a step over every slot."""
    m = random_model(arch(kind), mix=0.5)
    a, b = (DecodeEngine(m, slots=8, max_len=48, draft=2, buckets=bucket_sizes(8)) for _ in range(2))
    for e in (a, b):
        for s, p in enumerate(PROMPTS[:3]):
            e.prefill(s, p)
    for i in range(6):
        if i % 3 == 2:
            pa, na = a.spec_on(4, 1 + i % 2)
            pb, nb = b.spec_on(8, 1 + i % 2)
            assert torch.equal(na[:3], nb[:3]) and all(pa[s, : na[s]].tolist() == pb[s, : nb[s]].tolist()
                                                      for s in range(3))
        else:
            assert a.step_on(4, chain=i % 2 == 0)[:3].tolist() == b.step_on(8, chain=i % 2 == 0)[:3].tolist()
    assert a.pos.tolist() == b.pos.tolist()
    with pytest.raises(Exception, match="active outside the first 2"):
        a.step_on(2)
    with pytest.raises(Exception, match="not a bucket"):
        a.step_on(3)


@pytest.mark.parametrize("kind,branches", [("llama", 1), ("hybrid", 1), ("llama", 3)])
def test_attention_over_a_key_length_bucket_equals_the_whole_cache(kind, branches):
    """Steps and rounds whose attention reads the caches only up to the shortest key length
    holding their slots give the tokens, caches and drafts of steps over the whole static
    cache (the plain reference), with slots at different lengths crossing the buckets' edges;
    a draft tree's rounds too (its verify block and chain rows reach further past a slot)."""
    m = random_model(arch(kind), mix=0.5)
    ref = DecodeEngine(m, slots=4, max_len=64, draft=2, buckets=[1, 2, 4], branches=branches)
    fast = DecodeEngine(m, slots=4, max_len=64, draft=2, buckets=[1, 2, 4], kv_buckets=[16, 24], branches=branches)
    M = ref.cache_len  # the whole cache: max_len, and a tree's overhang of rows past it
    assert (ref.kv_sizes, fast.kv_sizes) == ([M], [16, 32, M])  # 16-aligned, the whole cache last
    used = []
    kv_for = fast._kv_for
    fast._kv_for = lambda b, d: (used.append(kv_for(b, d)), used[-1])[1]
    for e in (ref, fast):
        for s, p in [(0, PROMPTS[0]), (1, PROMPTS[1]), (2, PROMPTS[2])]:
            e.prefill(s, p)
    for i in range(16):
        if i == 8:
            for e in (ref, fast):  # a slot leaves; a short prompt takes it while the others run on
                e.release(1)
                e.prefill(1, PROMPTS[3])
        if i % 3 == 1:
            (pa, na), (pb, nb) = ref.spec_on(4, 1 + i % 2), fast.spec_on(4, 1 + i % 2)
            assert torch.equal(na, nb) and all(pa[s, : na[s]].tolist() == pb[s, : nb[s]].tolist() for s in range(3))
        else:
            assert ref.step_on(4, chain=i % 4 != 0)[:3].tolist() == fast.step_on(4, chain=i % 4 != 0)[:3].tolist()
    assert ref.pos.tolist() == fast.pos.tolist() and ref.drafts.tolist() == fast.drafts.tolist()
    # lengths ran below, between and past the buckets' edges (a tree's rows past its slots need
    # more than 16 positions from the shortest prompt on)
    assert set(used) == ({32, M} if branches > 1 else {16, 32, M})
    for s, n in enumerate(ref.pos.tolist()[:3]):
        torch.testing.assert_close(fast.k_cache[:, s, :, :n], ref.k_cache[:, s, :, :n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fast.v_cache[:, s, :, :n], ref.v_cache[:, s, :, :n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fast.mtp_k_cache[s, :, :n], ref.mtp_k_cache[s, :, :n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("branches", [1, 3])
def test_every_kind_of_step_is_timed_before_any_slot_runs(branches):
    """The start-up times the depth policy is seeded with: every batch bucket, key length and kind
    of step (the plain step that skips the chain, a chain round of each depth, and a tree's), taken
    while every slot is free; they leave the engine as it was, and once a slot runs, none are taken."""
    m = random_model(arch("llama"), mix=0.5)
    eng = DecodeEngine(m, slots=4, max_len=48, draft=2, buckets=[1, 2, 4], kv_buckets=[16], branches=branches)
    ref = DecodeEngine(m, slots=4, max_len=48, draft=2, buckets=[1, 2, 4], kv_buckets=[16], branches=branches)
    times = eng.time_steps(reps=1)
    kinds = [(0, False)] + [(d, t) for d in (1, 2) for t in ((False, True) if branches > 1 else (False,))]
    assert sorted(times) == sorted((b, n, *k) for b in (1, 2, 4) for n in eng.kv_sizes for k in kinds)
    assert all(s > 0 for s in times.values())
    for e in (eng, ref):
        e.prefill(1, PROMPTS[0])
    for i in range(4):
        (pa, na), (pb, nb) = eng.spec_on(2, 1 + i % 2), ref.spec_on(2, 1 + i % 2)
        assert torch.equal(na, nb) and pa[1, : na[1]].tolist() == pb[1, : nb[1]].tolist()
    with pytest.raises(Exception, match="timed before any slot is active \\(slot 1 is\\)"):
        eng.time_steps()


def test_chunked_prefill_equals_the_whole_prompt():
    m = random_model(arch("llama"), mix=0.5)
    whole = DecodeEngine(m, slots=2, max_len=48, draft=2)
    parts = DecodeEngine(m, slots=2, max_len=48, draft=2)
    p = PROMPTS[5]
    first = whole.prefill(1, p)
    job = parts.prefill_job(1, p, chunk=4)
    runs = []
    while (got := job.run()) is None:
        runs.append(job.left)
        assert not parts.active[1]  # the slot is installed by the last chunk only
    assert got == first and runs == [15, 11, 7, 3]
    torch.testing.assert_close(parts.drafts[1], whole.drafts[1])
    n = len(p) + 1
    torch.testing.assert_close(parts.mtp_k_cache[1, :, :n], whole.mtp_k_cache[1, :, :n], rtol=1e-5, atol=1e-5)
    for _ in range(5):
        assert parts.spec_step()[0][1].tolist() == whole.spec_step()[0][1].tolist()


@pytest.mark.parametrize("chunk", [0, 5])
def test_staged_prefill_equals_the_reference_prefill(chunk):
    """A prompt through the staging slot's chunk steps (padded to a size), copied into a slot,
    leaves that slot as the reference prefill does: first token, drafts, caches, later rounds."""
    from cortiq.model.decode import StagedPrefill

    m = random_model(arch("qwen3"), mix=0.5)
    ref = DecodeEngine(m, slots=3, max_len=48, draft=2)
    eng = DecodeEngine(m, slots=3, max_len=48, draft=2)
    sp = StagedPrefill(eng, sizes=(4, 8))
    assert StagedPrefill(eng).sizes == [16, 32, 46]  # no chunk spans more positions than a prompt may have
    for slot, p in [(2, PROMPTS[5]), (0, PROMPTS[1]), (1, PROMPTS[2])]:
        first = ref.prefill(slot, p)
        job, runs = sp.job(slot, p, chunk), 1
        while (got := job.run()) is None:
            runs += 1
        assert int(got) == first and runs == -(-len(p) // (min(chunk, 8) if chunk else 8))
        n = len(p)
        torch.testing.assert_close(eng.k_cache[:, slot, :, :n], ref.k_cache[:, slot, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng.mtp_k_cache[slot, :, : n + 1], ref.mtp_k_cache[slot, :, : n + 1], rtol=1e-4,
                                   atol=1e-4)
        assert eng.drafts[slot].tolist() == ref.drafts[slot].tolist() and eng.pos.tolist() == ref.pos.tolist()
    for _ in range(6):
        a, b = eng.spec_step(), ref.spec_step()
        assert a[1].tolist() == b[1].tolist() and a[0].tolist() == b[0].tolist()


def test_adapter_runs_the_smallest_bucket_and_decodes_as_alone():
    m = random_model(arch("llama"))
    eng = DecodeAdapter(m, max_batch=8, max_len=64)
    seen = []
    step_on = eng.eng.step_on
    eng.eng.step_on = lambda b, chain=True: (seen.append(b), step_on(b, chain))[1]
    # prompts join into the lowest free slot and leave: live rows span 1 to 8 slots
    got, _ = drive(eng, PROMPTS, max_new=8, joins=[0, 0, 1, 3, 3, 3, 3, 9])
    for p, g in zip(PROMPTS, got):
        assert g == generate(m, p, max_new=8).tokens
    assert 1 in seen and 8 in seen and set(seen) <= {1, 2, 4, 8}


def _serve(sched, prompts, max_tokens, starts):
    """Each prompt submitted from its own thread after waiting for `starts[i]` other answers
    -> (text, end event, every event the request got)."""
    out = [None] * len(prompts)
    ends = threading.Semaphore(0)

    def one(i):
        for _ in range(starts[i]):
            ends.acquire()
        events = []
        req = Request(ids=list(prompts[i]), max_tokens=max_tokens[i])
        text, end = collect(sched, req, timeout=120)
        sink = req.sink
        req.sink = lambda ev: (events.append(ev), sink(ev))
        out[i] = (text, end, events)
        for _ in range(len(prompts)):
            ends.release()

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    return out


def _answers_greedy(m, eng, tok, **kw):
    """Eight requests through a scheduler on `eng`, joining and leaving: each answer (text, end,
    token count) is plain greedy decoding's, and nothing reaches a request after its end."""
    sched = Scheduler(eng, tok, [EOS], **kw).start()
    try:
        max_tokens = [12, 5, 20, 9, 1, 16, 7, 11]
        got = _serve(sched, PROMPTS, max_tokens, starts=[0, 0, 0, 1, 1, 2, 4, 4])
    finally:
        sched.stop()
    for p, n, (text, end, late) in zip(PROMPTS, max_tokens, got):
        assert late == []  # a step in flight for an ended request is dropped
        want = generate(m, p, max_new=n, eos_ids=[EOS]).tokens
        assert text == tok.decode(want, skip_special_tokens=True)
        assert end.tokens == len(want) and end.finish == ("stop" if want[-1] == EOS else "length")
    return sched


@pytest.mark.parametrize("mode,engine", [("plain", "decode"), ("speculative", "decode"), ("auto", "decode"),
                                         ("auto", "loop"), ("plain-sync", "decode"), ("tree", "decode"),
                                         ("auto-tree", "decode")])
def test_the_scheduler_answers_plain_greedy_decoding(mode, engine):
    """Concurrent requests joining and leaving, prompts prefilled 3 tokens a turn: every answer is
    plain greedy decoding's, token for token, in plain, speculative and auto modes, on a chain or
    a draft tree of 3 first guesses (auto-tree: the policy chooses tree or chain rounds too)."""
    m = random_model(arch("llama"), mix=0.5, seed=2)
    draft = 0 if mode.startswith("plain") else 3
    kw = {"branches": 3} if "tree" in mode else {}
    eng = (DecodeAdapter if engine == "decode" else LoopEngine)(m, 4, 64, draft=draft, **kw)
    sched = _answers_greedy(m, eng, _tok(), speculative=bool(draft), prefill_chunk=3, overlap=mode != "plain-sync",
                            policy=_mixing(eng) if mode.startswith("auto") else None)
    if mode == "auto-tree":  # both kinds of round ran
        assert {t for (d, t), n in sched.policy.chosen.items() if d and n} == {False, True}
    if draft:
        assert sched.stats["rounds"] > 0
    if mode.startswith("auto"):
        pol = sched.profile()["policy"]
        assert all(sched.policy.chosen.values()) and pol["step_ms"] and pol["turn_ms"]  # every kind ran
        assert pol["seeded"] == (len(eng.eng.buckets) * len(eng.eng.kv_sizes) * len(sched.policy.actions)
                                 if engine == "decode" else 0)  # the decode engine timed every kind at start-up


class _Cycling(DepthPolicy):
    """The policy with its choice taken in turn from every kind of step, whatever the times: every
    kind, and a change between two kinds at every step, in a short run, on any machine's clock
    (whatever it chooses, the answers are plain greedy decoding's; its choices on a fake clock:
    tests/serve/test_policy.py)."""

    def _choose(self, key, n, slots):
        return self.actions[sum(self.chosen.values()) % len(self.actions)]


def _mixing(eng) -> DepthPolicy:
    return _Cycling(eng.draft, eng.max_batch, tree=eng.branches > 1)


def test_add_many_equals_add_and_events_merge():
    tok = _tok()
    texts = ["héllo wörld ✓", "plain ascii", "日本語のテキスト", "stop here: END no"]
    ids = [tok.encode(t).ids for t in texts]
    one = [IncrementalText(tok, ["END"] if i == 3 else []) for i in range(4)]
    many = [IncrementalText(tok, ["END"] if i == 3 else []) for i in range(4)]
    a, b = [[] for _ in texts], [[] for _ in texts]
    for j in range(max(map(len, ids))):
        rows = [i for i in range(4) if j < len(ids[i])]
        for i in rows:
            a[i].append(one[i].add(ids[i][j]))
        for i, piece in zip(rows, IncrementalText.add_many([many[i] for i in rows], [ids[i][j] for i in rows])):
            b[i].append(piece)
    assert a == b and ["".join(x) + y.finish() for x, y in zip(b, many)] == texts[:3] + ["stop here: "]
    ev = merged(Event(text="a", tokens=1), iter([Event(text="b", tokens=2), Event(text="c", finish="stop", tokens=3),
                                                 Event(text="never")]))
    assert (ev.text, ev.finish, ev.tokens) == ("abc", "stop", 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["plain", "auto", "tree"])
def test_the_pipelined_scheduler_with_captured_graphs_answers_greedy(mode):
    """On CUDA (f32): bucket graphs, staged prefill graphs, steps launched ahead of the host."""
    m = random_model(arch("llama"), mix=0.5, seed=2).to("cuda")
    draft = 0 if mode == "plain" else 3
    eng = DecodeAdapter(m, 4, 64, draft=draft, branches=3 if mode == "tree" else 1)
    assert eng.eng.graphs and eng.staged.graphs
    _answers_greedy(m, eng, _tok(), speculative=bool(draft), prefill_chunk=5, policy=_mixing(eng) if draft else None)


@pytest.mark.parametrize("mode", ["plain", "auto", "tree"])
def test_graph_capture_warm_ups_on_fresh_buffers_then_replays_answer_greedy(mode, monkeypatch):
    """A graph's capture first runs its body eagerly on the buffers as construction left them
    (no prompt staged, every slot inactive): on CUDA an index out of range there is a
    device-side assert that poisons the process. Here the bucket and staged prefill graphs are
    'captured' on a CPU by the same warm-up calls (then replayed by re-running the body): the
    warm-ups index in range and the adapter still answers as plain greedy decoding."""
    m = random_model(arch("llama"), mix=0.5, seed=2)
    draft = 0 if mode == "plain" else 3
    eng, graphs = stand_in_graphs(m, 4, 64, monkeypatch, draft=draft, branches=3 if mode == "tree" else 1)
    # plain (with and without the chain), the chain alone, a round of each depth (a tree engine: a tree's and a chain's)
    kinds = 1 + bool(draft) * (2 + draft * (2 if mode == "tree" else 1))
    # a graph per batch bucket, key length and kind (a drafting engine's whole cache holds a round
    # past max_len, a tree's its overhang too: 80)
    assert eng.eng.kv_sizes == ([32, 80] if draft else [32, 64])
    assert len(eng.staged.graphs) == 3 and len(eng.eng._bucket_graphs) == 3 * len(eng.eng.kv_sizes) * kinds
    _answers_greedy(m, eng, _tok(), speculative=bool(draft), prefill_chunk=5, policy=_mixing(eng) if draft else None)
    staged = list(eng.staged.graphs.values())
    assert sum(g.replays for g in staged) > 0 and sum(g.replays for g in graphs if g not in staged) > 0
    if draft:  # auto's rounds after plain steps that skipped the chain run the chain's own graph
        chains = [g for k, g in eng.eng._bucket_graphs.items() if k[0] == "chain"]
        assert sum(g.replays for g in chains) > 0


def test_a_prompts_first_token_is_taken_with_the_step_after_its_prefill():
    """The prefill leaves a prompt's first token on the device (reading it would wait for the step
    in flight): the turn that prefills sends nothing, the next turn sends the first token's text
    and then the launched step's, in order, and the answer is plain greedy decoding's."""
    m = random_model(arch("llama"), mix=0.5, seed=2)
    tok = _tok()
    sched = Scheduler(DecodeAdapter(m, 2, 64), tok, [])
    got = []
    req = Request(ids=PROMPTS[0], max_tokens=3, sink=got.append)
    sched.submit(req)
    flight = sched._turn([sched.waiting.popleft()], None)  # prefill, then the first step is launched
    assert got == [] and [f[0] for f in sched.firsts] == [req]
    flight = sched._turn([], flight)  # the step after the prefill ends: the first token, then its token
    assert [e.tokens for e in got] == [1, 2] and sched.firsts == []
    sched._turn([], flight)
    want = generate(m, PROMPTS[0], max_new=3).tokens
    assert "".join(e.text for e in got) == tok.decode(want) and got[-1].finish == "length"


@pytest.mark.parametrize("mode", ["plain", "speculative", "tree", "auto-tree"])
def test_answers_that_fill_the_context_end_at_its_last_position(mode):
    """Requests that never stop by themselves run to the end of the context, several at once: each
    ends "length" with its last position filled, the same in every mode (a round's tokens count
    one by one, and a round that would pass the end is a plain step instead; a tree's rows past
    max_len are never written into a neighbour's slot), and its tokens are plain greedy decoding's."""
    m = random_model(arch("llama"), mix=0.5, seed=2)
    draft = 0 if mode == "plain" else 3
    eng = DecodeAdapter(m, 3, 40, draft=draft, branches=3 if "tree" in mode else 1)
    tok = _tok()
    sched = Scheduler(eng, tok, [], speculative=bool(draft), prefill_chunk=5,
                      policy=_mixing(eng) if mode.startswith("auto") else None)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[1]]
    sched.start()
    try:
        got = _serve(sched, prompts, [1000] * len(prompts), starts=[0, 0, 0, 1])
    finally:
        sched.stop()
    for p, (text, end, late) in zip(prompts, got):
        n = 40 - len(p) + 1  # the last token decided is pending and takes no position
        assert late == [] and end.finish == "length" and end.tokens == n
        assert text == tok.decode(generate(m, p, max_new=n).tokens)
