"""MTP heal on a tiny model: trunk cache, chain refresh, training raises drafts per round, outputs, bad input."""

import logging

import pytest
import torch

from cortiq.cmf import open_cmf
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.mtp import MtpSettings, mtp_heal, mtp_init, trunk_pass
from cortiq.mtp.draft import Chain
from cortiq.mtp.trunk import run_trunk, trunk_sets, trunk_key
from cortiq.tracking import MemoryLogger

from mtp_helpers import EOS, write_model


def small(**kw):
    base = dict(window=32, tokens=100000, topk=8, batch=2, chain=2, refresh=10, eval_every=10, patience=0,
                lr=3e-3, epochs=3.0, device="cpu", head_chunk=64, gen_prompt=8)
    base.update(kw)
    return MtpSettings(**base)


def test_trunk_cache_reads_back_a_fresh_pass(tiny, tmp_path):
    model, data = tiny
    s = small()
    cache = tmp_path / "cache"
    r1 = trunk_pass(model, str(data), s, cache)
    assert r1["sets"][0]["read_back"] is False
    r2 = trunk_pass(model, str(data), s, cache)
    assert r2["sets"][0]["read_back"] is True
    from cortiq.data.windowing import packed_windows

    f = open_cmf(model)
    m = load_model(f)
    packed = packed_windows(str(data), 32, 100000, min_len=18, pad_id=EOS)
    back, _ = trunk_sets(m, f, packed, 32, 8, cache)
    ti, tp, h = run_trunk(m, torch.as_tensor(packed[0].ids), 8)
    every = range(len(back[0]))
    assert torch.equal(torch.from_numpy(back[0].ti.take(every).astype("int64")), ti)
    assert torch.equal(torch.from_numpy(back[0].tp.take(every)), tp)
    assert torch.equal(torch.from_numpy(back[0].h.take(every)), h)
    assert torch.equal(back[0].ids, torch.as_tensor(packed[0].ids))


def test_trunk_cache_from_another_trunk_is_rebuilt(tiny, tmp_path, caplog):
    model, data = tiny
    other = write_model(tmp_path / "other.cmf", seed=5)
    s = small()
    cache = tmp_path / "cache"
    trunk_pass(other, str(data), s, cache)
    with caplog.at_level(logging.WARNING, logger="cortiq.mtp.trunk"):
        r = trunk_pass(model, str(data), s, cache)
    assert r["sets"][0]["read_back"] is False
    assert "another trunk" in caplog.text
    # the rebuilt cache now carries this trunk's key and is read back
    assert trunk_pass(model, str(data), s, cache)["sets"][0]["read_back"] is True


def test_trunk_key_ignores_the_draft(tiny, tmp_path):
    model, data = tiny
    out = tmp_path / "healed.cmf"
    mtp_heal(model, str(data), small(epochs=0), out)
    assert trunk_key(open_cmf(out)) == trunk_key(open_cmf(model))


def _chain(model, data, s):
    from cortiq.data.windowing import packed_windows

    f = open_cmf(model)
    m = load_model(f)
    packed = packed_windows(str(data), s.window, s.tokens, min_len=18, pad_id=EOS)
    sets, _ = trunk_sets(m, f, packed, s.window, s.topk)
    return m, Chain(m, sets, s.chain, s.stride, EOS, batch=s.batch, chunk=s.head_chunk)


def test_chain_steps_use_current_weights(tiny):
    """Stride 0: every step is computed from the weights now, as a decode round runs it (row by row through the KV cache)."""
    from cortiq.mtp.rounds import decode_steps_reference

    model, data = tiny
    s = small(chain=3)
    m, ch = _chain(model, data, s)
    b = torch.tensor([0, 5, 7])
    ref = decode_steps_reference(m, ch.hidden(b), ch.ids[b], 3, EOS)
    for o, r in zip(ch.steps(b, 3), ref):
        assert torch.allclose(o, r, atol=1e-5)
    with torch.no_grad():
        m.mtp.layers[0].mlp.down_proj.weight.mul_(1.5)
    ref2 = decode_steps_reference(m, ch.hidden(b), ch.ids[b], 3, EOS)
    assert not torch.allclose(ref2[2], ref[2])
    assert torch.allclose(ch.steps(b, 3)[2], ref2[2], atol=1e-5)


def test_chain_refresh_uses_current_weights(tiny):
    """Stride > 0: the spliced sources are rebuilt from the weights at each refresh."""
    model, data = tiny
    s = small(chain=3, stride=4)
    m, ch = _chain(model, data, s)
    every = torch.arange(len(ch))
    ch.refresh(0)
    old = ch.hidden(every, 1)
    off = (every * 5) % 4
    spliced = lambda: torch.cat([x for _, x in ch.spliced(every, off)])
    assert torch.equal(old, spliced())
    with torch.no_grad():
        m.mtp.layers[0].mlp.down_proj.weight.mul_(1.5)
    ch.refresh(0)
    assert not torch.allclose(ch.hidden(every, 1), old)
    assert torch.equal(ch.hidden(every, 1), spliced())


def test_chain_counts_agree_with_a_plain_decode_view(tiny):
    """Hold at step 1 recomputed by hand from the model: draft argmax at row p == trunk argmax at p+1."""
    model, data = tiny
    s = small(chain=1)
    m, ch = _chain(model, data, s)
    idx = ch.held.nonzero().flatten()
    c = ch.chain_counts(idx)
    with torch.no_grad():
        out = m.mtp_forward(ch.hidden(idx), torch.cat([ch.ids[idx, 1:], torch.full((len(idx), 1), EOS)], 1))
        d = m.logits(out).argmax(-1)  # [n, T]
    t1 = ch.t1[idx]
    T = t1.shape[1]
    lens = ch.lens[idx]
    p = torch.arange(T)
    valid = (p[None, :] < lens[:, None] - 1)
    fed = torch.zeros_like(valid)
    fed[:, : T - 1] = ch.ids[idx, 1:] == t1[:, : T - 1]
    counted = valid & fed
    hits = counted.clone()
    hits[:, : T - 1] &= d[:, : T - 1] == t1[:, 1:]
    assert c.tolist() == [[int(counted.sum()), int(hits.sum())]]
    assert c[0, 0] > 0


def test_measure_splits_the_walk_by_prompt_kind(tiny):
    """Chain.measure: the walk from each window's prompt end over the span, its split by kind
    (the two parts add up to it), and the chain from every row, all from one draft pass."""
    from cortiq.mtp import measures as M

    model, data = tiny
    s = small(chain=3)
    m, ch0 = _chain(model, data, s)
    n = len(ch0)
    start = torch.arange(n) % 5 + 2  # prompts of 3..7 tokens
    chat = torch.arange(n) % 3 == 0
    ch = Chain(m, [_set(ch0)], 3, 0, EOS, batch=2, chunk=64, start=start, chat=chat, span=11)
    idx = torch.arange(n)
    got = ch.measure(idx)
    d = ch.tops(idx)
    want = M.walk_counts_reference(ch.ids, ch.lens, ch.t1, d, start, 11)
    assert torch.equal(got["walk"], want) and want[0, 0] > 0
    assert torch.equal(got["data"] + got["chat"], got["walk"]) and got["chat"][0, 0] > 0
    assert torch.equal(got["chat"], M.walk_counts_reference(ch.ids[chat], ch.lens[chat], ch.t1[chat], d[:, chat], start[chat], 11))
    assert torch.equal(got["every_row"], M.chain_counts_reference(ch.ids, ch.lens, ch.t1, d))
    # the held-out default and the figure a checkpoint is chosen by
    assert torch.equal(ch.hold(), ch.measure()["walk"])
    with pytest.raises(ValueError, match="start"):
        Chain(m, [_set(ch0)], 3, 0, EOS, start=start[:-1])


def _set(ch):
    from cortiq.mtp.trunk import TrunkSet

    return TrunkSet("all", ch.ids, ch.lens, ch.ti, ch.tp, ch.h)


def _perturbed(tmp_path, model):
    m = load_model(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in m.mtp.layers.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    from cortiq.model import export_model

    return export_model(m, open_cmf(model), tmp_path / "perturbed.cmf")


@pytest.mark.parametrize("stride", [0, 4])
def test_training_raises_drafts_per_round(tiny, tmp_path, stride):
    model, data = tiny
    src = _perturbed(tmp_path, model)
    log = MemoryLogger()
    out = tmp_path / "healed.cmf"
    rep = mtp_heal(src, str(data), small(stride=stride, also=[f"q8:{tmp_path / 'q8.cmf'}"]), out, log)
    mt = rep["metrics"]
    assert mt["drafts_per_round_after"] > mt["drafts_per_round_before"] + 0.05
    # the written draft, re-opened, measures what training ended with
    assert rep["codecs"]["out:keep"]["drafts_per_round"] == pytest.approx(mt["drafts_per_round_after"], abs=1e-9)
    assert "q8" in rep["codecs"] and rep["codecs"]["q8"]["bytes"] < rep["codecs"]["out:keep"]["bytes"]
    f, g = open_cmf(src), open_cmf(out)
    # only the draft's layer and norm changed; the trunk and the draft's input side are copied as stored
    for n in f.names:
        same = bool((f.raw(n) == g.raw(n)).all())
        trained = n.startswith("model.mtp.layers.") or n == "model.mtp.norm.weight"
        assert same or trained, n
        if trained and n.endswith("_proj.weight"):
            assert not same, n
    assert "mtp_heal" in g.provenance
    # the draft's token ranking (cortiq.mtp.vocab), in every codec's file: the trunk's greedy tokens
    # counted on the training windows alone (the held-out tenth left out)
    from cortiq.mtp import vocab as V
    from cortiq.mtp.heal import _chain, resolve

    s = resolve(f, small(stride=stride))
    ch, _ = _chain(load_model(f), f, str(data), s)
    train = ~ch.held
    want = V.ranking(ch.t1[train].numpy(), ch.ids[train].numpy(), ch.lens[train].numpy(), f.arch.vocab_size)
    assert bool(ch.held.any()) and V.stored(g).tolist() == want.tolist()
    assert V.stored(open_cmf(tmp_path / "q8.cmf")).tolist() == want.tolist()
    assert V.stored(g).tolist() != V.ranking(ch.t1.numpy(), ch.ids.numpy(), ch.lens.numpy(), f.arch.vocab_size).tolist()
    # logged live at every evaluation: the checkpoint written is the best one evaluated, at its step
    evals = dict(log.series("drafts_per_round"))
    assert max(evals.values()) == pytest.approx(mt["drafts_per_round_after"], abs=1e-9)
    assert evals[int(mt["best_step"])] == max(evals.values())
    assert rep["history"][-1]["step"] == rep["metrics"]["steps"]


def test_model_without_draft_points_to_init(tmp_path, tiny):
    _, data = tiny
    bare = write_model(tmp_path / "bare.cmf", mtp=False)
    with pytest.raises(CortiqError, match="mtp init"):
        mtp_heal(bare, str(data), small(), tmp_path / "o.cmf")


def test_too_few_windows(tiny, tmp_path):
    model, data = tiny
    with pytest.raises(CortiqError, match=r"windows .* need 40 \(every tenth is held out"):
        mtp_heal(model, str(data), small(batch=4, window=64), tmp_path / "o.cmf")


def test_stride_shorter_than_chain():
    with pytest.raises(CortiqError, match="stride 2 is shorter than the chain \\(3\\)"):
        MtpSettings(chain=3, stride=2)


def test_mtp_init_gives_a_pass_through_block(tmp_path, tiny):
    _, data = tiny
    bare = write_model(tmp_path / "bare.cmf", mtp=False)
    out = tmp_path / "init.cmf"
    mtp_init(bare, out)
    f, g = open_cmf(bare), open_cmf(out)
    assert g.arch.mtp_layers == 1 and "mtp_init" in g.provenance
    for n in f.names:
        assert (f.raw(n) == g.raw(n)).all()
    for n in f.names:
        if n.startswith("model.layers.1."):
            assert torch.equal(g.tensor("model.mtp.layers.0." + n[len("model.layers.1."):]), f.tensor(n))
    m = load_model(out)
    h = torch.randn(2, 5, 32)
    x = m.mtp.eh_proj(torch.cat([m.mtp.enorm(torch.randn(2, 5, 32)), m.mtp.hnorm(h)], -1))
    assert torch.allclose(x, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5)
    with pytest.raises(CortiqError, match="already carries an MTP draft"):
        mtp_init(out, tmp_path / "again.cmf")
    # the fresh draft can be healed
    rep = mtp_heal(out, str(data), small(epochs=0), tmp_path / "h.cmf")
    assert len(rep["before"]["hold"]) == 2
