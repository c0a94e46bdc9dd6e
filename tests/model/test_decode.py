"""The static-cache decoding engine against the reference loop: plain greedy,
speculative greedy (with drafts steered to be right or wrong at chosen places,
so rounds accept 0, some or all drafts and the GDN state is rolled back),
batches of different prompt lengths, slots joining and leaving mid-decode."""

import pytest
import torch
import torch.nn.functional as F

from cortiq.convert.hf import convert_hf_dir
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.model.decode import DecodeEngine, auto_branches
from cortiq.model.decode.picks import _argmax, _split, _topk
from cortiq.model.generate import decode, generate, generate_fast

from model_helpers import V, _perturb_norms, save_hf, tiny_llama, tiny_qwen3_next

PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [1, 2], [9, 250, 9, 31, 8, 8, 120, 64, 3, 77, 12, 6, 40]]


def _with_mtp(model, seed=1):
    from cortiq.model.decoder import MTPBlock

    torch.manual_seed(seed)
    model.arch.mtp_layers = 1
    model.model.mtp = MTPBlock(model.arch).eval()
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    hf = {"llama": tiny_llama, "qwen3_next": tiny_qwen3_next}[request.param]()
    _perturb_norms(hf)
    return _with_mtp(load_model(convert_hf_dir(save_hf(hf, tmp / "hf"), tmp / "m.cmf")))


_REF: dict = {}


def greedy(model, prompt, n):
    """The reference loop's greedy tokens (computed once per model and prompt, 24 long: greedy prefixes agree)."""
    key = (id(model), tuple(prompt))
    if key not in _REF:
        _REF[key] = generate(model, prompt, max_new=24).tokens
    assert n <= 24
    return _REF[key][:n]


class Steered(DecodeEngine):
    """Drafts the reference's own greedy tokens, except where a fixed pattern of
    (position, chain step) makes it guess wrong: rounds then accept 0, some or
    all of their drafts, deterministically."""

    def __init__(self, model, truth, **kw):
        self.truth = truth  # [S, L] prompt + greedy continuation per slot
        super().__init__(model, **kw)

    def _draft_pick(self, xh, j, base, slots):
        L = self.truth.shape[1]
        p = (base + 1 + j).clamp(max=L - 1)  # draft j guesses the token at base+1+j
        right = self.truth[slots, p]
        bad = (p * p * 3 + j * 2) % 5 < 2
        return torch.where(bad, (right + 1) % V, right)[:, None]


def _truth(model, prompts, n):
    seqs = [p + greedy(model, p, n) for p in prompts]
    L = max(len(s) for s in seqs)
    return torch.tensor([s + [0] * (L - len(s)) for s in seqs]), [s[len(p):] for s, p in zip(seqs, prompts)]


def test_plain_equals_reference_loop(model):
    for p in PROMPTS:
        assert generate_fast(model, p, max_new=17, graphs=False).tokens == greedy(model, p, 17)


@pytest.mark.parametrize("draft", [1, 2, 3])
def test_speculative_equals_greedy_with_rollback(model, draft):
    truth, greedy = _truth(model, PROMPTS[:1], 24)
    eng = Steered(model, truth, slots=1, max_len=64, draft=draft, graphs=False)
    r = decode(model, PROMPTS[:1], max_new=24, draft=draft, engine=eng)[0]
    assert r.tokens == greedy[0]
    seen = set(r.per_round)
    assert 0 in seen and draft in seen  # rounds that rejected the first draft, rounds that kept every one
    if draft >= 2:
        assert seen & set(range(1, draft))  # a draft rejected after accepted ones: a mid-block rollback
    assert r.accepted == sum(r.per_round) and r.drafted == draft * r.rounds


@pytest.mark.parametrize("draft", [1, 3])
def test_speculative_with_the_models_own_draft(model, draft):
    # a random draft block: nearly every draft is wrong, and the output is still greedy's
    for p in PROMPTS[:2]:
        r = generate_fast(model, p, max_new=20, draft=draft, graphs=False)
        assert r.tokens == greedy(model, p, 20)
        assert r.drafted == draft * r.rounds


def _reference_tree(model, seq, k, nb, vocab=None):
    """The drafts the reference loop's MTP block makes from the state after seq (the trunk has
    seen seq[:-1], seq[-1] pending): its top nb first guesses, each chained greedily. [nb·k]
    With `vocab` (token ids), every other token's logit is -inf."""
    from cortiq.model.decoder import KVState

    def logits(x):
        lg = model.logits(x)
        if vocab is None:
            return lg
        return torch.full_like(lg, float("-inf")).index_copy(-1, vocab, lg.index_select(-1, vocab))

    with torch.no_grad():
        t = torch.tensor([seq[:-1]])
        n = t.shape[1]
        H, _ = model.forward_hidden(t)
        ms = KVState()
        if n > 1:
            model.mtp_forward(H[:, :-1], t[:, 1:], 0, ms)
        x0 = model.mtp_forward(H[:, -1:], torch.tensor([[seq[-1]]]), n - 1, ms)
        out = []
        for first in logits(x0[0, -1]).topk(nb).indices.tolist():
            st = KVState()
            st.k, st.v = ms.k, ms.v
            xh, xt, chain = x0, first, [first]
            for j in range(1, k):
                xh = model.mtp_forward(xh, torch.tensor([[xt]]), n - 1 + j, st)
                xt = int(logits(xh[0, -1]).argmax())
                chain.append(xt)
            out += chain
    return out


def _reference_drafts(model, seq, k):
    """The draft chain the reference loop would run next: the trunk has seen seq[:-1],
    seq[-1] is the pending token; the draft's rows come from the trunk's own rows."""
    return _reference_tree(model, seq, k, 1)


def _held_drafts_follow(eng, model, turns: int, ref) -> None:
    """Slot 1 prefilled with PROMPTS[0], then `turns` turns (every third a plain step, else a round):
    after the prefill and every turn the drafts the engine holds are ref(seq), seq the prompt and the
    tokens so far; the tokens stay greedy's."""
    p = PROMPTS[0]
    seq = p + [eng.prefill(1, p)]
    assert eng.drafts[1].tolist() == ref(seq)
    for r in range(turns):
        if r % 3 == 2:
            seq.append(eng.step().tolist()[1])
        else:
            pred, n = eng.spec_step()
            seq += pred[1, : n[1]].tolist()
        assert eng.drafts[1].tolist() == ref(seq)
    assert seq[len(p):] == greedy(model, p, len(seq) - len(p))


@pytest.mark.parametrize("draft", [1, 3])
def test_drafts_held_between_rounds_are_the_reference_chain(model, draft):
    # after prefill, after each speculative round and after plain steps mixed in, the drafts the
    # engine holds for its next round are the chain the reference loop would draft from that state
    eng = DecodeEngine(model, slots=2, max_len=64, draft=draft, graphs=False)
    _held_drafts_follow(eng, model, 6, lambda seq: _reference_drafts(model, seq, draft))


@pytest.mark.parametrize("draft", [0, 2])
def test_batch_equals_each_prompt_alone(model, draft):
    out = decode(model, PROMPTS, max_new=15, draft=draft, graphs=False)
    for r, p in zip(out, PROMPTS):
        assert r.tokens == greedy(model, p, 15)


def test_batched_steered_speculation(model):
    truth, greedy = _truth(model, PROMPTS, 18)
    eng = Steered(model, truth, slots=len(PROMPTS), max_len=64, draft=3, graphs=False)
    out = decode(model, PROMPTS, max_new=18, draft=3, engine=eng)
    assert [r.tokens for r in out] == greedy
    assert len({a for r in out for a in r.per_round}) >= 3


def test_prefill_many_and_step_blocks_equal_the_reference(model):
    """Slots prefilled together from prompts of different lengths (two of one length: the GDN model
    prefills those two in one forward), then blocks of steps with no host sync between them."""
    prompts = PROMPTS + [[4, 4, 60, 2, 9, 1, 250]]  # as long as the first
    slots = [4, 0, 2, 1]
    eng = DecodeEngine(model, slots=5, max_len=64)
    first = eng.prefill_many(slots, prompts)
    toks = torch.cat([eng.steps(3), eng.steps(4)])  # [7, 5]
    assert toks.shape == (7, 5) and toks[:, 3].eq(-1).all()
    for s, p, t in zip(slots, prompts, first):
        assert [t] + toks[:, s].tolist() == greedy(model, p, 8)
    assert eng.lengths() == [len(prompts[1]) + 7, len(prompts[3]) + 7, len(prompts[2]) + 7, 0, len(prompts[0]) + 7]
    with pytest.raises(CortiqError, match=r"^decode engine: slots \[1, 1\] for 2 prompts \(one distinct slot each\)$"):
        eng.prefill_many([1, 1], [[1], [2]])
    with pytest.raises(CortiqError, match=r"^decode engine: slot 3 is full"):
        eng.prefill_many([3], [[1] * 40])
        eng.steps(30)


def test_slots_join_and_leave(model):
    # slot 1 joins after slot 0 has run 5 steps; slot 0 then leaves and is reused for a new prompt
    eng = DecodeEngine(model, slots=2, max_len=64, graphs=False)
    a, b, c = PROMPTS[0], PROMPTS[2], PROMPTS[1]
    got = {0: [eng.prefill(0, a)], 1: []}
    for _ in range(5):
        got[0].append(eng.step().tolist()[0])
    got[1].append(eng.prefill(1, b))
    for _ in range(6):
        t = eng.step().tolist()
        got[0].append(t[0])
        got[1].append(t[1])
    eng.release(0)
    assert eng.free_slots() == [0]
    got[2] = [eng.prefill(0, c)]
    for _ in range(4):
        t = eng.step().tolist()
        got[2].append(t[0])
        got[1].append(t[1])
    assert got[0] == greedy(model, a, 12)
    assert got[1] == greedy(model, b, 11)
    assert got[2] == greedy(model, c, 5)
    assert eng.lengths() == [len(c) + 4, len(b) + 10]
    eng.release(0)
    eng.release(1)
    assert eng.step().tolist() == [-1, -1]  # nothing active: nothing advances
    assert eng.lengths() == [len(c) + 4, len(b) + 10]


def test_engine_leaves_the_model_unchanged(model):
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        before = model(ids)
        DecodeEngine(model, slots=1, max_len=32, draft=1, graphs=False)
        DecodeEngine(model, slots=1, max_len=32, graphs=False)  # fusing twice reuses the fused storage
        assert torch.equal(model(ids), before)


def test_eos_and_sampling(model):
    g = greedy(model, PROMPTS[0], 10)
    stop = generate_fast(model, PROMPTS[0], max_new=10, eos_ids=[g[3]], graphs=False).tokens
    assert stop == g[: g.index(g[3]) + 1]
    s1 = generate_fast(model, PROMPTS[0], max_new=10, temperature=1.0, seed=3, graphs=False).tokens
    s2 = generate_fast(model, PROMPTS[0], max_new=10, temperature=1.0, seed=3, graphs=False).tokens
    assert s1 == s2 and len(s1) == 10 and all(0 <= t < V for t in s1)
    cold = generate_fast(model, PROMPTS[0], max_new=10, temperature=1e-6, seed=3, graphs=False).tokens
    assert cold == g  # a vanishing temperature is greedy


def test_bad_use_is_a_clear_error(model):
    eng = DecodeEngine(model, slots=1, max_len=20, graphs=False)
    with pytest.raises(CortiqError, match="no room"):
        eng.prefill(0, list(range(25)))
    with pytest.raises(CortiqError, match="draft"):
        eng.spec_step()
    with pytest.raises(CortiqError, match="sampling=True"):
        eng.prefill(0, [1, 2], temperature=0.5)
    with pytest.raises(CortiqError, match="slot 3"):
        eng.prefill(3, [1, 2])
    eng.prefill(0, list(range(10)))
    with pytest.raises(CortiqError, match="slot 0 is full"):
        for _ in range(20):
            eng.step()
    with pytest.raises(CortiqError, match="verifies greedily"):
        decode(model, [[1, 2]], max_new=4, draft=1, temperature=0.7)


def test_without_a_draft_block_speculation_is_refused(tmp_path):
    m = load_model(convert_hf_dir(save_hf(tiny_llama(), tmp_path / "hf"), tmp_path / "m.cmf"))
    with pytest.raises(CortiqError, match="MTP"):
        DecodeEngine(m, slots=1, max_len=16, draft=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_and_reference(model):
    m = model.to("cuda")
    try:
        for p in PROMPTS[:2]:
            ref = generate(m, p, max_new=16).tokens
            assert generate_fast(m, p, max_new=16, graphs=True).tokens == ref
            assert generate_fast(m, p, max_new=16, graphs=True, draft=2).tokens == ref
        seqs = [p + generate(m, p, max_new=16).tokens for p in PROMPTS]
        L = max(len(x) for x in seqs)
        truth = torch.tensor([x + [0] * (L - len(x)) for x in seqs], device="cuda")
        greedy = [x[len(p):] for x, p in zip(seqs, PROMPTS)]
        eng = Steered(m, truth, slots=len(PROMPTS), max_len=64, draft=3, graphs=True)
        out = decode(m, PROMPTS, max_new=16, draft=3, engine=eng)
        assert [r.tokens for r in out] == greedy
        assert len({a for r in out for a in r.per_round}) >= 3
        plain = decode(m, PROMPTS, max_new=16, graphs=True)
        assert [r.tokens for r in plain] == greedy
        # a narrow draft head (`draft_vocab`): the captured rounds draft as the eager engine does
        vocab = torch.arange(1, V, 7, device="cuda")
        ge, ee = (DecodeEngine(m, slots=2, max_len=64, draft=3, graphs=g, draft_vocab=vocab) for g in (True, False))
        for e in (ge, ee):
            e.prefill(1, PROMPTS[0])
            for _ in range(4):
                e.spec_step()
        assert ge.drafts.tolist() == ee.drafts.tolist() and ge.lengths() == ee.lengths()
        ge = DecodeEngine(m, slots=2, max_len=64, draft=3, graphs=True, draft_vocab=vocab)
        out = decode(m, PROMPTS[:2], max_new=16, draft=3, engine=ge)
        assert [r.tokens for r in out] == greedy[:2]
        # sampling draws inside the captured graph from the seeded CUDA generator
        s1 = generate_fast(m, PROMPTS[0], max_new=8, temperature=0.8, seed=1, graphs=True).tokens
        s2 = generate_fast(m, PROMPTS[0], max_new=8, temperature=0.8, seed=1, graphs=True).tokens
        assert s1 == s2 and len(s1) == 8 and all(0 <= t < V for t in s1)
    finally:
        model.to("cpu")


def test_cli_generate_fast_reference_and_speculative(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from tiny import llama_arch, write_random

    from cortiq.cli import main
    from cortiq.commands.generate import _differ

    arch = llama_arch()
    arch.mtp_layers = 1
    path = write_random(tmp_path / "m.cmf", arch)
    args = [str(path), "The quick", "--max-new", "12", "--device", "cpu"]
    assert main(["generate", *args]) == 0
    fast = capsys.readouterr().out
    assert main(["generate", *args, "--reference"]) == 0
    assert capsys.readouterr().out == fast
    assert main(["generate", *args, "--speculative", "--draft", "2"]) == 0
    cap = capsys.readouterr()
    assert cap.out == fast
    assert "output identical to plain greedy" in cap.err
    assert main(["generate", *args, "--speculative"]) == 0  # its defaults: 3 drafts, a chain on a CPU
    cap = capsys.readouterr()
    assert cap.out == fast and "of 3 drafts accepted" in cap.err and "output identical to plain greedy" in cap.err
    assert main(["generate", *args, "--speculative", "--draft", "2", "--draft-branches", "3"]) == 0
    cap = capsys.readouterr()
    assert cap.out == fast and "output identical to plain greedy" in cap.err
    assert main(["generate", *args, "--speculative", "--draft-branches", "3", "--reference"]) == 1
    assert capsys.readouterr().err.strip().endswith("(not with --reference)")
    assert auto_branches(arch, "cpu") == 1 and auto_branches(arch, "cuda") == 4
    assert _differ([1, 2, 3, 4], [1, 2, 5, 4]) == (1, 2)
    assert _differ([1, 2], [1, 2, 3]) == (1, 2)
    assert _differ([7], [7]) == (0, None)


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_stage_picks_equal_the_plain_reductions(dtype, device):
    # rows of 7 chunks of 37 with ties: bf16 values of a few levels tie within a chunk and across
    # chunks, and the row's largest is planted in a late chunk and again in an earlier one
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 8, (3, 5, 259), generator=g).to(dtype) if dtype == torch.bfloat16 else \
        torch.randn(3, 5, 259, generator=g)
    x[0, 0, 200] = x[0, 0, 40] = 50.0
    x = x.to(device)
    assert _split(49152) == 1024 and _split(151936) == 1187 and _split(259) == 0
    assert _argmax(x, 37).tolist() == x.argmax(-1).tolist()
    assert _argmax(x, 37)[0, 0].item() == 40  # the first of equals
    assert _argmax(x, 0).tolist() == x.argmax(-1).tolist()
    for k in (1, 4):
        i = _topk(x, k, 37)
        assert i.shape == (3, 5, k)
        # the same values, largest first, at distinct indices (which of equals is unspecified, as topk's)
        assert x.gather(-1, i).tolist() == x.topk(k, -1).values.tolist()
        assert (i.sort(-1).values.diff(dim=-1) > 0).all()
    cf, ct = torch.compile(_argmax, fullgraph=True), torch.compile(_topk, fullgraph=True)  # (the fused path's picks)
    assert cf(x, 37).tolist() == x.argmax(-1).tolist()
    assert x.gather(-1, ct(x, 4, 37)).tolist() == x.topk(4, -1).values.tolist()


# ── the fused path (torch.compile'd layer halves) against the eager engine ──
# Tiny models of awkward sizes, each compiled once per process (the compiled functions are
# shared by every engine of one geometry): "plain" is SmolLM2's Llama layout (no bias, full
# rotary, weight-style norms), "gated" every variant at once (q/k norms, output gate, partial
# rotary, offset norms, qkv bias, MLP widths that differ per layer, neuron gates).
FUSED_PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [9, 250, 9, 31, 8]]


@pytest.fixture(scope="module", params=["plain", "gated"])
def fmodel(request, tmp_path_factory):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from tiny import write_random

    from cortiq.arch import Arch

    kw = dict(arch_name="llama", vocab_size=V, hidden_size=48, num_layers=2, intermediate_sizes=[75, 75],
              num_heads=3, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, mtp_layers=1, max_position_embeddings=256)
    if request.param == "gated":
        kw.update(arch_name="qwen3_next", intermediate_sizes=[75, 61], qk_norm=True, attn_output_gate=True,
                  partial_rotary_factor=0.5, norm_style="offset", attention_bias=True)
    path = write_random(tmp_path_factory.mktemp(request.param) / "m.cmf", Arch(**kw))
    m = load_model(path)
    if request.param == "gated":
        m.set_neuron_gates(True, init=0.5)
    return m


def _pair(model, **kw):
    # the picks in two stages over 7 chunks of 37 logits, as SmolLM2's 49152 run in 48 of 1024
    # (`_split` finds no chunk width for this vocabulary of 259)
    pair = DecodeEngine(model, fused=True, graphs=False, **kw), DecodeEngine(model, fused=False, graphs=False, **kw)
    for e in pair:
        e._pick_chunk = 37
    return pair


def _close_state(ef, ee):
    """The engines' caches and draft rows agree to f32 rounding; their host bounds exactly."""
    for name in ("k_cache", "v_cache", "mtp_k_cache", "mtp_v_cache", "mtp_last"):
        if hasattr(ee, name):
            torch.testing.assert_close(getattr(ef, name), getattr(ee, name), atol=1e-4, rtol=1e-4)
    assert ef.lengths() == ee.lengths() and ef.drafts.tolist() == ee.drafts.tolist()
    for name in ("pending", "pos", "out_tok", "out_n"):  # the bookkeeping buffers, inactive slots' too
        assert getattr(ef, name).tolist() == getattr(ee, name).tolist(), name


def test_fused_is_opt_in_off_cuda(fmodel):
    assert not DecodeEngine(fmodel, max_len=32, graphs=False).fused  # default: CUDA only
    ef, ee = _pair(fmodel, max_len=32)
    assert ef.fused and not ee.fused


def test_fused_steps_and_rounds_equal_eager(fmodel):
    ef, ee = _pair(fmodel, slots=2, max_len=64, draft=2)
    firsts = [[e.prefill(s, p) for s, p in enumerate(FUSED_PROMPTS)] for e in (ef, ee)]  # (the reference forward)
    assert firsts[0] == firsts[1]
    assert ef.step().tolist() == ee.step().tolist()
    assert ef.steps(3).tolist() == ee.steps(3).tolist()
    for _ in range(3):
        (pf, nf), (pe, ne) = ef.spec_step(), ee.spec_step()
        assert nf.tolist() == ne.tolist()
        assert [pf[s, : n].tolist() for s, n in enumerate(nf.tolist())] == [pe[s, : n].tolist() for s, n in enumerate(ne.tolist())]
    _close_state(ef, ee)
    with torch.no_grad():  # the final hidden rows and logits of one more verify block
        block = torch.cat([ee.pending[:, None], ee.drafts], 1)
        (hf, _), (he, _) = ef._trunk(block, ef.pos), ee._trunk(block, ee.pos)
        torch.testing.assert_close(hf, he, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(F.linear(hf, ef.head), F.linear(he, ee.head), atol=1e-4, rtol=1e-4)


def test_fused_buckets_equal_eager(fmodel):
    # bucketed steps over slot 0 alone (batch 1) and over both, at key lengths 16 and 32 and the
    # whole cache, rounds of each depth and a round after a step that skipped the chain
    ef, ee = _pair(fmodel, slots=2, max_len=64, draft=2, buckets=[1, 2], kv_buckets=[16, 32])

    def both(fn):
        rf, re = fn(ef), fn(ee)
        if isinstance(re, tuple):  # a round: pred [S, k+1] (columns past n stale), n [S]
            (pf, nf), (pe, ne) = rf, re
            assert nf.tolist() == ne.tolist()
            return [pf[s, :n].tolist() for s, n in enumerate(nf.tolist())] == [pe[s, :n].tolist() for s, n in enumerate(ne.tolist())]
        return rf == re

    assert both(lambda e: e.prefill(0, FUSED_PROMPTS[0]))
    assert ef._kv_for(1, 1) == 16  # the next steps attend over a bucket of the key length, not the whole cache
    for fn in (lambda e: e.step_on(1).tolist(), lambda e: e.spec_on(1, 1), lambda e: e.spec_on(1),
               lambda e: e.step_on(1, chain=False).tolist(), lambda e: e.spec_on(1)):
        assert both(fn)
    assert both(lambda e: e.prefill(1, FUSED_PROMPTS[1]))
    for _ in range(3):
        assert both(lambda e: e.step_on(2).tolist()) and both(lambda e: e.spec_on(2))
    _close_state(ef, ee)
    for e in (ef, ee):  # an inactive slot in the bucket: its buffers stay, its output is -1
        e.release(0)
    assert both(lambda e: e.step_on(2).tolist()) and both(lambda e: e.spec_on(2))
    assert ef.out_tok[0].item() == -1 and ef.out_n[0].item() == 0
    _close_state(ef, ee)


# ── a draft tree: the draft's top guesses for the first token, each chained ──
class SteeredTree(Steered):
    """Steered's drafts in a tree: of 3 first guesses the right one is guess p % 3 (p the
    position it guesses; wrong where Steered's pattern says so), the others wrong; an engine of
    `branches` branches gets the first that many. Every branch's later steps guess right. So the
    chain alone (branch 0) keeps a round's drafts only where p % 3 == 0, a tree of 3 wherever
    Steered's pattern lets it."""

    def _draft_pick(self, xh, j, base, slots):
        return super()._draft_pick(xh, j, base, slots).expand(-1, xh.shape[1])

    def _draft_first(self, xh, base, slots):
        right = super()._draft_pick(xh, 0, base, slots)  # [S', 1]
        p = (base + 1).clamp(max=self.truth.shape[1] - 1)
        b = torch.arange(self.branches, device=right.device)[None]
        return torch.where(b == (p % 3)[:, None], right, (right + 1 + b) % V)  # [S', nb]


@pytest.mark.parametrize("draft", [1, 3])
def test_tree_equals_greedy_and_keeps_every_branchs_drafts(model, draft):
    truth, greedy = _truth(model, PROMPTS, 24)
    kw = dict(slots=len(PROMPTS), max_len=64, draft=draft, graphs=False)
    if model.arch.layer_types.count("linear_attention"):
        with pytest.raises(CortiqError, match=r"^decode engine: a draft tree \(branches > 1\) runs attention-only"):
            DecodeEngine(model, branches=3, **kw)
        return
    tree = decode(model, PROMPTS, max_new=24, draft=draft, engine=SteeredTree(model, truth, branches=3, **kw))
    chain = decode(model, PROMPTS, max_new=24, draft=draft, engine=SteeredTree(model, truth, branches=1, **kw))
    assert [r.tokens for r in tree] == [r.tokens for r in chain] == greedy
    # the tree keeps the right branch's drafts wherever it is: more a round than branch 0 alone
    assert sum(r.accepted for r in tree) / sum(r.rounds for r in tree) > \
        sum(r.accepted for r in chain) / sum(r.rounds for r in chain)
    assert draft in {a for r in tree for a in r.per_round} and 0 in {a for r in tree for a in r.per_round}


@pytest.mark.parametrize("draft", [1, 3])
def test_tree_drafts_held_between_rounds_are_the_reference_tree(model, draft):
    # the model's own (random) draft: the winning branch varies round to round, so rounds move
    # other branches' keys and values into place; the drafts held after prefill, rounds and plain
    # steps are the reference's tree from that state, and the tokens stay greedy's
    if model.arch.layer_types.count("linear_attention"):
        pytest.skip("a draft tree runs attention-only models")
    eng = DecodeEngine(model, slots=2, max_len=64, draft=draft, graphs=False, branches=3)
    _held_drafts_follow(eng, model, 7, lambda seq: _reference_tree(model, seq, draft, 3))


@pytest.mark.parametrize("branches", [1, 3])
def test_a_narrow_draft_head_drafts_the_masked_reference(model, branches):
    # the draft picks among 37 of the 259 tokens (`draft_vocab`): after prefill, rounds and plain
    # steps its drafts are the reference's with every other token's logit at -inf, and the output
    # stays greedy's
    if branches > 1 and model.arch.layer_types.count("linear_attention"):
        pytest.skip("a draft tree runs attention-only models")
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:37]
    eng = DecodeEngine(model, slots=2, max_len=64, draft=3, graphs=False, branches=branches, draft_vocab=vocab)
    assert eng.d_head.shape == (37, model.arch.hidden_size)
    _held_drafts_follow(eng, model, 7, lambda seq: _reference_tree(model, seq, 3, branches, vocab))
    assert set(eng.drafts[1].tolist()) <= set(vocab.tolist())


def test_a_draft_vocabulary_of_bad_ids_is_a_clear_error(model):
    kw = dict(slots=1, max_len=16, draft=1, graphs=False)
    for bad in ([3, 3, 4], [0, V], [-1, 2], [[1, 2]], [1.0, 2.0]):
        with pytest.raises(CortiqError, match=r"^decode engine: the draft's vocabulary needs "):
            DecodeEngine(model, draft_vocab=torch.tensor(bad), **kw)
    if not model.arch.layer_types.count("linear_attention"):  # (a tree runs attention-only models)
        with pytest.raises(CortiqError, match=r"needs token ids, at least 2 \(one a branch\)"):
            DecodeEngine(model, draft_vocab=torch.tensor([5]), branches=2, **kw)


@pytest.mark.parametrize("narrow", [False, True])
def test_fused_tree_rounds_equal_eager(fmodel, narrow):
    # rounds of a tree of 3 branches, bucketed, each depth, after a step that skipped the chain;
    # `narrow`: the draft picks among 41 of the tokens (`draft_vocab`)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:41] if narrow else None
    ef, ee = _pair(fmodel, slots=2, max_len=64, draft=2, buckets=[1, 2], kv_buckets=[16, 32], branches=3,
                   draft_vocab=vocab)
    for s, p in enumerate(FUSED_PROMPTS):
        assert ef.prefill(s, p) == ee.prefill(s, p)
    for fn in (lambda e: e.spec_on(2, 1), lambda e: e.spec_on(2), lambda e: e.step_on(2, chain=False),
               lambda e: e.spec_on(2), lambda e: e.step_on(2)):
        rf, re = fn(ef), fn(ee)
        if isinstance(re, tuple):
            (pf, nf), (pe, ne) = rf, re
            assert nf.tolist() == ne.tolist()
            assert all(pf[s, :n].tolist() == pe[s, :n].tolist() for s, n in enumerate(nf.tolist()))
        else:
            assert rf.tolist() == re.tolist()
    _close_state(ef, ee)
