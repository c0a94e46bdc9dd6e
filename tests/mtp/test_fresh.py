"""A fresh draft: the preset picked from provenance, training on the model's own continuations
(cached, deterministic), the progress bar, heal's non-finite policy, and a draft that learns."""

import numpy as np
import pytest
import torch

from cortiq.cmf import open_cmf
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.mtp import MtpSettings, mtp_heal, mtp_init, resolve
from cortiq.mtp.init import draft_is_fresh
from cortiq.mtp.selfgen import generated_sets, make_prompts

from mtp_helpers import EOS, greedy_records, write_model, write_tdata


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(a model with a draft fresh from mtp init, tdata of 60 windows of 48 the trunk wrote greedily)."""
    root = tmp_path_factory.mktemp("fresh")
    bare = write_model(root / "bare.cmf", mtp=False, seed=1)
    data = write_tdata(root / "g.tdata", greedy_records(bare, 60, 48, seed=1))
    init = root / "init.cmf"
    mtp_init(bare, init)
    return init, data


def tiny_settings(**kw):
    base = dict(window=48, tokens=100000, topk=8, chain=3, gen_prompt=8, head_chunk=64, device="cpu", batch=2,
                eval_every=20, gen_windows=0)
    base.update(kw)
    return MtpSettings(**base)


def test_preset_follows_provenance_and_explicit_values_win(fresh, tmp_path):
    init, data = fresh
    f = open_cmf(init)
    assert f.provenance["mtp_init"]["fresh"] is True and draft_is_fresh(f)
    s = resolve(f, MtpSettings())
    assert (s.preset, s.lr, s.train_input, s.generate, s.window, s.batch, s.gen_windows, s.gen_ask) == \
        ("fresh", 1e-3, True, True, 320, 8, 8192, 1.0)
    s = resolve(f, MtpSettings(lr=5e-4, generate=False))
    assert (s.preset, s.lr, s.generate, s.epochs) == ("fresh", 5e-4, False, 2.0)
    assert resolve(f, MtpSettings(preset="retrain")).gen_windows == 0
    assert resolve(f, MtpSettings(preset="retrain")).lr == 2e-5
    # a draft that came with the model (no mtp init in its provenance): retrain
    native = write_model(tmp_path / "native.cmf")
    assert resolve(open_cmf(native), MtpSettings()).preset == "retrain"
    # a measure-only heal leaves the draft fresh
    out = tmp_path / "measured.cmf"
    mtp_heal(init, str(data), tiny_settings(epochs=0), out)
    g = open_cmf(out)
    assert draft_is_fresh(g) and g.provenance["mtp_heal"]["preset"] == "fresh"


def test_fresh_draft_learns_the_trunks_language_and_decoding_accepts_it(fresh, tmp_path, capsys):
    """Defaults of the fresh preset (lr, warm-up, input side, self-generated data) on a low-entropy
    language: the trunk's own greedy text. The held-out hold rate climbs high, and real speculative
    decoding accepts what the offline measure predicts."""
    from cortiq.model.generate import generate, generate_speculative

    init, data = fresh
    out = tmp_path / "healed.cmf"
    rep = mtp_heal(init, str(data), tiny_settings(epochs=1.5, gen_cache=str(tmp_path / "gen")), out)
    err = capsys.readouterr().err
    m = rep["metrics"]
    assert rep["preset"] == "fresh" and m["steps"] > 0
    # the fresh block (a copy of the trunk's last layer reading h_p) guesses token p+1, not p+2:
    # right only where the text repeats; trained, it holds most drafts at every chain step
    assert min(rep["after"]["every_row"]["hold"]) > 0.8
    assert m["drafts_per_round_after"] > max(2.0, m["drafts_per_round_before"] + 1.0)
    g = open_cmf(out)
    assert not draft_is_fresh(g) and resolve(g, MtpSettings()).preset == "retrain"
    # the progress: the preset first, then the generation and training bars with the held-out hold rate
    assert err.index("mtp heal: preset fresh (the draft is fresh from mtp init)") < err.index("mtp generate")
    assert "mtp heal:" in err and "hold=" in err and "step 20: held-out hold" in err
    # real decoding on held-out prompts (the generated windows' first tokens)
    model = load_model(out)
    ids = np.asarray(greedy_records(init, 60, 48, seed=1))[9::10, :8]
    acc = rounds = 0
    for p in ids.tolist():
        r = generate_speculative(model, p, max_new=24, draft=2)
        assert r.tokens == generate(model, p, max_new=24).tokens
        acc, rounds = acc + r.accepted, rounds + r.rounds
    h = rep["after"]["hold"]
    predicted = h[0] + h[0] * h[1]
    assert acc / rounds >= 0.8 * predicted


def test_chat_requests_replace_an_even_share_of_the_prompts():
    w = np.arange(100, dtype=np.int64).reshape(10, 10)
    reqs = [[900, 901], [902, 903, 904], [905]]
    p, chat = make_prompts(w, 8, 0.25, reqs, seed=0)
    assert chat.tolist() == [False, False, False, True, False, False, False, True, False, False]
    assert all(p[i] in reqs for i in (3, 7)) and p[0] == list(range(8)) and p[4] == list(range(40, 48))
    assert make_prompts(w, 8, 0.25, reqs, seed=0)[0] == p  # the requests follow the seed
    # no requests (a model without a chat template): every prompt is cut from the data
    p2, chat2 = make_prompts(w, 4, 0.5, [], seed=0)
    assert not chat2.any() and p2 == w[:, :4].tolist()


def test_chat_windows_are_the_trunks_greedy_answers_in_its_template(tmp_path):
    """A model with a chat template: half the windows answer a request rendered in it (prompts of
    other lengths than the data's, in one batch), every window is its prompt and the plain
    decoder's greedy continuation, and the measure starts at each window's own prompt end."""
    from cortiq.cmf import open_cmf as _open
    from cortiq.data.selfgen import REQUESTS
    from cortiq.data.windowing import packed_windows
    from cortiq.model.generate import generate
    from cortiq.mtp.heal import _prompt_ends
    from cortiq.tokenizer import load_tokenizer

    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    path = write_model(tmp_path / "chat.cmf", seed=2, chat_template=tpl)
    data = write_tdata(tmp_path / "d.tdata", greedy_records(path, 8, 96, seed=2))
    f = _open(path)
    m = load_model(f)
    s = resolve(f, tiny_settings(window=96, gen_chat=0.5, gen_ask=0.0))
    packed = packed_windows(str(data), 96, 100000, min_len=19, pad_id=EOS)
    g = generated_sets(m, f, packed, s, tmp_path / "gen")[0][0]
    tok = load_tokenizer(path)
    assert g.chat.sum() == len(g) // 2
    for i in range(len(g)):
        P = int(g.prompt_lens[i])
        prompt = g.ids[i, :P].tolist()
        if g.chat[i]:
            text = tok.decode(prompt, skip_special_tokens=False)
            assert text.startswith("<user>") and text.endswith("<a>") and text[6:-3] in REQUESTS
        else:
            assert P == s.gen_prompt and prompt == packed[0].ids[i, :P].tolist()
        want = generate(m, prompt, max_new=96 - P, eos_ids=[EOS]).tokens
        assert g.ids[i, P: g.lengths[i]].tolist() == want
    start, chat = _prompt_ends([g], s)
    assert start.tolist() == (g.prompt_lens - 1).tolist() and chat.tolist() == g.chat.tolist()


def test_generated_windows_are_cached_and_deterministic(fresh, tmp_path):
    from cortiq.data.windowing import packed_windows

    init, data = fresh
    f = open_cmf(init)
    m = load_model(f)
    packed = packed_windows(str(data), 48, 100000, min_len=19, pad_id=EOS)
    s = resolve(f, tiny_settings(gen_temperature=0.9, seed=3))
    a, ia = generated_sets(m, f, packed, s, tmp_path / "a")
    again, ib = generated_sets(m, f, packed, s, tmp_path / "a")
    other, _ = generated_sets(m, f, packed, s, tmp_path / "b")
    assert not ia[0]["read_back"] and ib[0]["read_back"]
    assert np.array_equal(a[0].ids, again[0].ids) and np.array_equal(a[0].ids, other[0].ids)
    assert np.array_equal(a[0].lengths, other[0].lengths)
    assert a[0].name == "g.gen" and a[0].ids.shape == packed[0].ids.shape
    assert np.array_equal(a[0].ids[:, :8], packed[0].ids[:, :8])  # byte tokenizer, no template: no chat rows fit
    d = list((tmp_path / "a").iterdir())
    assert len(d) == 1 and (d[0] / "meta.json").exists() and (d[0] / "gen.arrow").exists()
    s4 = resolve(f, tiny_settings(gen_temperature=0.9, seed=4))
    c, _ = generated_sets(m, f, packed, s4, tmp_path / "a")
    assert not np.array_equal(c[0].ids, a[0].ids)
    assert len(list((tmp_path / "a").iterdir())) == 2


def test_non_finite_steps_are_skipped_then_abort(fresh, tmp_path, monkeypatch):
    from cortiq.mtp import draft as D

    init, data = fresh
    real_loss = D.Chain.loss
    calls = {"n": 0}

    def some_nan(self, b, kind, hard):
        calls["n"] += 1
        loss, n = real_loss(self, b, kind, hard)
        return (loss * float("nan") if calls["n"] % 4 == 0 else loss), n

    monkeypatch.setattr(D.Chain, "loss", some_nan)
    rep = mtp_heal(init, str(data), tiny_settings(epochs=0.5, generate=False), tmp_path / "a.cmf")
    assert rep["metrics"]["skipped"] == calls["n"] // 4 > 0
    assert rep["metrics"]["steps"] == calls["n"] - calls["n"] // 4

    def all_nan(self, b, kind, hard):
        loss, n = real_loss(self, b, kind, hard)
        return loss * float("inf"), n

    monkeypatch.setattr(D.Chain, "loss", all_nan)
    with pytest.raises(CortiqError, match=r"^mtp heal: 20 non-finite steps \(last at step 1\); lower lr"):
        mtp_heal(init, str(data), tiny_settings(epochs=0.5, generate=False), tmp_path / "b.cmf")
    assert not (tmp_path / "b.cmf").exists()


@pytest.fixture(scope="module")
def healed(fresh, tmp_path_factory):
    """A draft trained from fresh on the trunk's own continuations (measured over 30 new tokens)."""
    init, data = fresh
    root = tmp_path_factory.mktemp("healed")
    s = tiny_settings(epochs=1.5, span=30, gen_cache=str(root / "gen"))
    rep = mtp_heal(init, str(data), s, root / "healed.cmf")
    return root / "healed.cmf", s, rep


def test_offline_measure_is_what_speculative_decoding_accepts(healed):
    """The property the measure exists for: on the held-out windows (prompt + the trunk's greedy
    continuation) the round-ordered walk counts exactly the rounds and the accepted drafts of
    greedy speculative decoding from those prompts (f32), at every depth, on the reference loop
    and on the static-cache engine; and mtp heal's own figure is that walk."""
    from cortiq.model.generate import decode, generate_speculative
    from cortiq.mtp import heldout_windows, measure_text

    out, s, rep = healed
    f = open_cmf(out)
    model = load_model(f)
    hw = heldout_windows(model, f, cache=s.gen_cache)
    P, new = s.gen_prompt, s.span
    assert hw["span"] == new and hw["start"].tolist() == [P - 1] * len(hw["ids"]) and not hw["chat"].any()
    full = (hw["lens"] == hw["ids"].shape[1]).nonzero().flatten()  # windows that did not end at an EOS
    assert len(full) >= 4
    seqs = [hw["ids"][i].tolist() for i in full]
    prompts = [x[:P] for x in seqs]
    for k in (1, 2, 3):
        spec = [generate_speculative(model, p, max_new=new, draft=k) for p in prompts]
        eng = decode(model, prompts, max_new=new, draft=k)
        for r, x in zip(spec, seqs):
            assert r.tokens == x[P : P + new]  # the window is the decode's own text
        rounds, acc = sum(r.rounds for r in spec), sum(r.accepted for r in spec)
        assert 0 < acc < k * rounds  # neither nothing nor everything: the comparison can fail
        off = measure_text(model, seqs, [P] * len(seqs), chain=k, span=new)["walk"]
        assert off["counted"][0] == rounds
        assert off["drafts_per_round"] == pytest.approx(acc / rounds, abs=1e-12)
        # the engine emits the first new token at prefill, so its rounds are those of new - 1 tokens
        e_rounds, e_acc = sum(r.rounds for r in eng), sum(r.accepted for r in eng)
        assert all(r.tokens == x[P : P + new] for r, x in zip(eng, seqs))
        off = measure_text(model, seqs, [P] * len(seqs), chain=k, span=new - 1)["walk"]
        assert off["counted"][0] == e_rounds
        assert off["drafts_per_round"] == pytest.approx(e_acc / e_rounds, abs=1e-12)
    if len(full) == len(hw["ids"]):  # every held-out window is full: mtp heal's figure is the same walk
        assert rep["after"]["counted"][0] == rounds
        assert rep["after"]["drafts_per_round"] == pytest.approx(acc / rounds, abs=1e-12)
    # the chain from every row counts every row of the window: more rounds than a decode runs
    assert rep["after"]["every_row"]["counted"][0] > rep["after"]["counted"][0]


def test_generated_windows_keep_which_answer_a_chat(tmp_path):
    from cortiq.mtp.selfgen import _read, _write

    ids = np.arange(24).reshape(4, 6)
    lens, plens = np.array([6, 3, 6, 5]), np.array([2, 1, 4, 2])
    held, chat = np.array([0, 1, 0, 1], bool), np.array([1, 0, 0, 1], bool)
    _write(tmp_path / "g", ids, lens, plens, held, chat, {"windows": 4, "window": 6, "stage": "mtp-gen", "digest": "x"})
    i2, l2, p2, h2, c2 = _read(tmp_path / "g")
    assert np.array_equal(i2, ids) and np.array_equal(l2, lens) and np.array_equal(p2, plens)
    assert np.array_equal(h2, held) and np.array_equal(c2, chat)


def test_measure_text_and_heldout_windows_refuse_bad_input(fresh):
    from cortiq.mtp import heldout_windows, measure_text

    init, _ = fresh
    f = open_cmf(init)
    m = load_model(f)
    with pytest.raises(CortiqError, match=r"^measure_text: 2 sequences and 1 prompt lengths"):
        measure_text(m, [[1, 2, 3], [4, 5]], [2])
    with pytest.raises(CortiqError, match="no mtp heal in its provenance"):
        heldout_windows(m, f)


def test_retrain_trains_on_the_data_and_the_trunks_continuations_of_a_share_of_its_prompts(fresh, tmp_path):
    """generate off: the data's windows, and beside them (NAME.gen) the trunk's greedy continuations
    of an even gen_share of their prompts, each keeping its window's held-out flag."""
    from cortiq.model.generate import generate
    from cortiq.mtp.heal import _sets
    from cortiq.mtp.selfgen import chat_rows

    init, data = fresh
    f = open_cmf(init)
    m = load_model(f)
    s = resolve(f, tiny_settings(preset="retrain", gen_share=0.25, gen_cache=str(tmp_path / "gen")))
    assert not s.generate
    sets, info = _sets(m, f, str(data), s)
    assert [p.name for p in sets] == ["g", "g.gen"] and not info[0]["read_back"]
    src, gen = sets
    pick = chat_rows(len(src), 0.25)
    assert len(gen) == int(pick.sum()) == round(len(src) * 0.25) and np.array_equal(gen.held, src.held[pick])
    for w, g, n in list(zip(src.ids[pick], gen.ids, gen.lengths))[:3]:
        assert g[:8].tolist() == w[:8].tolist()
        assert g[8:n].tolist() == generate(m, w[:8].tolist(), max_new=40, eos_ids=[EOS]).tokens
    # off: the data alone
    assert [p.name for p in _sets(m, f, str(data), resolve(f, tiny_settings(preset="retrain", gen_share=0.0)))[0]] == ["g"]


def test_held_out_windows_answer_requests_no_train_window_answers():
    """A greedy answer is the same text wherever its request is drawn: held-out chat windows
    must draw from requests no train window draws, or the held-out measure reads training text."""
    w = np.arange(4000, dtype=np.int64).reshape(400, 10)
    reqs = [[1000 + i] for i in range(50)]
    held = np.zeros(400, dtype=bool)
    held[::5] = True
    p, chat = make_prompts(w, 8, 0.5, reqs, seed=1, held=held)
    train_q = {p[i][0] for i in np.flatnonzero(chat & ~held)}
    held_q = {p[i][0] for i in np.flatnonzero(chat & held)}
    assert held_q and train_q and not held_q & train_q
    assert len(held_q) <= 10 and len(train_q) > 30  # a fifth of the requests are the held-out side's
    assert make_prompts(w, 8, 0.5, reqs, seed=1, held=held)[0] == p


TPL = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def test_cut_prompts_takes_even_offsets_of_each_window_first_cuts_first():
    from cortiq.mtp.selfgen import cut_prompts

    ids = np.arange(3 * 20).reshape(3, 20)  # window w holds 20w, 20w+1, ...: a token says its offset
    lens = np.array([20, 12, 5])
    got, rows = cut_prompts(ids, lens, 4, 8)  # 3 cuts a window, 8 of the 9
    assert rows.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    offs = got[:, 0] - 20 * rows
    assert (got == got[:, :1] + np.arange(4)).all()  # contiguous slices of the window's text
    assert offs.tolist() == [0, 0, 0, 5, 2, 0, 10, 5]  # even steps of (length - 4) / 3
    assert (offs + 4 <= lens[rows]).all()


def test_make_prompts_gives_each_asked_request_to_one_chat_row():
    w = np.arange(120, dtype=np.int64).reshape(12, 10)
    reqs = [[900, 901], [902]]
    asked = [[800], [801, 802], [803]]
    p, chat = make_prompts(w, 8, 0.5, reqs, seed=0, asked=asked)
    rows = np.flatnonzero(chat)
    assert len(rows) == 6
    mine = [p[i] for i in rows if p[i] in asked]
    assert mine == asked  # each once, in order, on an even spread of the chat rows
    assert [p[i] for i in rows[1::2]] == asked  # (chat_rows' spread: the second of each pair)
    assert all(p[i] in reqs for i in rows[0::2])
    assert all(p[i] == list(range(10 * i, 10 * i + 8)) for i in np.flatnonzero(~chat))
    # no fixed list (only asked requests): only as many chat rows as there are asked requests
    p2, chat2 = make_prompts(w, 8, 0.5, [], seed=0, asked=asked)
    assert chat2.sum() == 3 and [p2[i] for i in np.flatnonzero(chat2)] == asked


def test_asked_openings_are_distinct_requests_the_model_wrote_in_its_template(tmp_path):
    """Magpie-style openings: the template's user turn opened, a request sampled to the end-of-turn
    token, the turn closed and the generation prompt after it; distinct, and reproducible by seed."""
    from cortiq.data.selfgen import asked_openings

    path = write_model(tmp_path / "chat.cmf", seed=2, chat_template=TPL)
    f = open_cmf(path)
    m = load_model(f)
    from cortiq.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    head, tail = (tok.encode(t, add_special_tokens=False).ids for t in ("<user>", "<a>"))
    a = asked_openings(m, f, 5, seed=1, longest=200, slots=8)
    assert len(a) == 5 and len({tuple(x) for x in a}) == 5
    for o in a:
        req = o[len(head): len(o) - len(tail)]
        assert o[: len(head)] == head and o[-len(tail):] == tail
        assert 1 <= len(req) < 200 and EOS not in req
    assert asked_openings(m, f, 5, seed=1, longest=200, slots=8) == a
    assert asked_openings(m, f, 5, seed=2, longest=200, slots=8) != a
    bare = open_cmf(write_model(tmp_path / "bare.cmf", seed=2))
    assert asked_openings(load_model(bare), bare, 5, seed=1) == []  # no template: no chat text to ask in


def test_gen_windows_and_gen_ask_grow_a_small_data_set(tmp_path):
    """gen_windows cuts more prompts from each window (each keeps its window's held-out flag);
    gen_ask makes the chat rows answer requests the model wrote, each answered once."""
    from cortiq.data.windowing import packed_windows

    path = write_model(tmp_path / "chat.cmf", seed=2, chat_template=TPL)
    data = write_tdata(tmp_path / "d.tdata", greedy_records(path, 8, 96, seed=2))
    f = open_cmf(path)
    m = load_model(f)
    packed = packed_windows(str(data), 96, 100000, min_len=19, pad_id=EOS)
    s = resolve(f, tiny_settings(window=96, gen_chat=0.5, gen_ask=1.0, gen_windows=20))
    g = generated_sets(m, f, packed, s, tmp_path / "gen")[0][0]
    n = len(packed[0])
    assert len(g) == 20 and g.chat.sum() == 10
    answers = [tuple(g.ids[i, : g.prompt_lens[i]]) for i in np.flatnonzero(g.chat)]
    assert len(set(answers)) == 10  # every asked request once
    data_rows = np.flatnonzero(~g.chat)
    from cortiq.mtp.selfgen import cut_prompts

    cuts, rows = cut_prompts(packed[0].ids, packed[0].lengths, s.gen_prompt, 20)
    assert all(g.ids[i, : s.gen_prompt].tolist() == cuts[i].tolist() for i in data_rows)
    assert g.held.tolist() == packed[0].held[rows].tolist() and n < 20


def test_tokens_bound_the_generated_windows(tmp_path):
    """mtp.tokens (or a data set's PATH@TOKENS) bounds the windows generated from it, as it bounds
    the data's own: tokens // window of them at most, whatever gen_windows asks."""
    from cortiq.mtp.heal import _sets

    path = write_model(tmp_path / "m.cmf", seed=2)
    data = write_tdata(tmp_path / "d.tdata", greedy_records(path, 10, 96, seed=2))
    f = open_cmf(path)
    m = load_model(f)
    for spec, tokens, want in ((str(data), 96 * 15, 15), (f"{data}@{96 * 12}", 96 * 15, 12),
                               (str(data), 96 * 100, 24)):
        s = resolve(f, tiny_settings(window=96, gen_chat=0.0, gen_windows=24, tokens=tokens, batch=1,
                                     generate=True))
        gen, info = _sets(m, f, spec, s, tmp_path / "gen")
        assert [len(g) for g in gen] == [want] and info[0]["windows"] == want, spec
    # the presets' own: the fresh preset's 8192 windows of 320 fit its tokens
    fresh = MtpSettings().resolved("fresh")
    assert fresh.tokens // fresh.window == fresh.gen_windows == 8192
    assert MtpSettings().resolved("retrain").tokens == 393216
