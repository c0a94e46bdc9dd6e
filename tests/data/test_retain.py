"""Retain data: the mix's exact counts per source, its even spread over every batch, the held-out
parts never in training, and the sources (corpus, tdata directory, self)."""

from __future__ import annotations


import numpy as np
import pytest

from cortiq.data import Tdata, build, windows
from cortiq.data.retain import other_sources, resolve_sources
from cortiq.data.stages import cli_runner, with_retain
from cortiq.data.windowing import interleave, mix_counts
from cortiq.data.settings import BuildSettings, RetainSettings
from cortiq.errors import CortiqError

T = 16


def _text(tmp_path, name, word, n=120):
    p = tmp_path / f"{name}.txt"
    p.write_text("\n\n".join(f"{word} {i} " * (3 + i % 5) for i in range(n)))
    return p


@pytest.fixture
def mixed(tmp_path, tok_cmf):
    user = build([str(_text(tmp_path, "user", "alpha"))], tok_cmf, tmp_path / "user.tdata",
                 BuildSettings(record_tokens=40, fractions=(0.8, 0.1, 0.1)))
    other = build([str(_text(tmp_path, "other", "beta", 200))], tok_cmf, tmp_path / "other.tdata",
                  BuildSettings(record_tokens=40, fractions=(0.8, 0.1, 0.1)))

    def make(share=0.4, seed=0, sources=None, weights=()):
        rs = RetainSettings(sources=sources or ["corpus:pydoc", str(other.path)], share=share, tokens=6000, seed=seed,
                            weights=list(weights))
        return user, with_retain(user.path, tok_cmf, rs, cli_runner(tmp_path / "work", progress=False), tmp_path / "work",
                                 progress=False)
    return make


def test_counts_per_source_are_exact_over_an_epoch_and_every_batch_holds_the_share(mixed):
    user, (mix_dir, panel) = mixed(share=0.4)
    assert list(panel) == ["pydoc", "other"]
    w = windows(Tdata.open(mix_dir), "train", T)
    u = windows(user, "train", T)
    want = mix_counts(len(u), [len(windows(Tdata.open(panel[k]), "train", T)) for k in panel], 0.4, True)
    assert want[1] + want[2] == round(len(u) * 0.4 / 0.6) and abs(want[1] - want[2]) <= 1
    assert np.bincount(w.source, minlength=3).tolist() == want
    assert w.names == ("data", "pydoc", "other")
    # the user's windows are all there, once each, in their own order
    assert np.array_equal(w.ids[w.source == 0], u.ids) and np.array_equal(w.weight[w.source == 0], u.weight)
    # any batch of B consecutive windows holds each source's share of B to within one window
    N = len(w)
    for B in (4, 7, 16):
        runs = np.lib.stride_tricks.sliding_window_view(w.source, B)
        for k, c in enumerate(want):
            got = (runs == k).sum(1)
            assert got.min() >= np.floor(c * B / N) - 1 and got.max() <= np.ceil(c * B / N) + 1


def test_weights_split_the_share_in_proportion(mixed):
    # by the largest remainders, ties to the first: the even split of before where every weight is 1
    assert mix_counts(100, [50, 50, 50], 0.5, True, [1, 2, 1]) == [100, 25, 50, 25]
    assert mix_counts(100, [50, 50, 50], 0.5, True, [1, 1, 1]) == mix_counts(100, [50] * 3, 0.5, True) == [100, 34, 33, 33]
    assert mix_counts(10, [9, 9], 0.5, True, [2, 1]) == [10, 7, 3]
    assert mix_counts(10, [4, 9], 0.5, False, [2, 1]) == [10, 4, 3]  # a held-out split is capped at its pool
    user, (mix_dir, panel) = mixed(share=0.4, weights=["other=3"])
    w = windows(Tdata.open(mix_dir), "train", T)
    u = windows(user, "train", T)
    got = np.bincount(w.source, minlength=3).tolist()
    pools = [len(windows(Tdata.open(panel[k]), "train", T)) for k in panel]
    assert got == mix_counts(len(u), pools, 0.4, True, [1, 3]) and abs(3 * got[1] - got[2]) <= 3
    # a weight's own mix: the even one is another stage output
    assert mixed(share=0.4)[1][0] != mix_dir


def test_bad_weights_say_so(mixed):
    for bad in ("knowledge", "knowledge=0", "knowledge=x", "=2"):
        with pytest.raises(CortiqError, match="a weight must be NAME=W"):
            RetainSettings(weights=[bad])
    with pytest.raises(CortiqError, match="each name once"):
        RetainSettings(weights=["self=2", "self=3"])
    with pytest.raises(CortiqError, match="a weight for shakespeare, which is not a retain source here"):
        mixed(weights=["shakespeare=2"])


def test_retain_windows_are_drawn_by_seed_and_the_panel_is_never_mixed_in(mixed):
    user, (a, panel) = mixed(seed=0)
    _, (b, _) = mixed(seed=0)
    _, (c, _) = mixed(seed=1)
    assert a == b and c != a
    wa, wc = windows(Tdata.open(a), "train", T), windows(Tdata.open(c), "train", T)
    assert np.array_equal(wa.source, wc.source) and not np.array_equal(wa.ids, wc.ids)
    td = Tdata.open(a)
    # the mix's test split is the user's alone: the retain sources' test records are the panel
    assert sorted(r.rid for r in td.records("test")) == sorted(r.rid for r in user.records("test"))
    mixed_rids = {r.rid for r in td.records()}
    for name, p in panel.items():
        for r in Tdata.open(p).records():
            assert (f"retain/{name}/{r.rid}" in mixed_rids) == (r.split != "test")
    # held-out loss sees the mix: retain val windows are in the val split, at most once each
    v = windows(td, "val", T)
    assert set(np.unique(v.source)) == {0, 1, 2}
    for k, name in enumerate(panel, 1):
        pool = windows(Tdata.open(panel[name]), "val", T)
        mine = v.ids[v.source == k]
        assert len(mine) <= len(pool) and len({x.tobytes() for x in mine}) == len(mine)


def test_interleave_spreads_every_source_evenly():
    lab = interleave([5, 3, 2])
    assert np.bincount(lab).tolist() == [5, 3, 2]
    assert interleave([4, 4]).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert mix_counts(10, [100, 1], 0.5, True) == [10, 5, 5] and mix_counts(10, [100, 1], 0.5, False) == [10, 5, 1]


def test_auto_is_self_knowledge_and_pydoc_on_a_gpu_and_pydoc_alone_elsewhere(monkeypatch):
    assert RetainSettings().sources == ["auto"]
    assert resolve_sources(["auto"], cuda=True) == ["self", "knowledge", "corpus:pydoc"]
    assert resolve_sources(["auto"], cuda=False) == ["corpus:pydoc"]
    # in place, each source once, and the others as they are
    assert resolve_sources(["x.tdata", "auto", "corpus:pydoc"], cuda=True) == ["x.tdata", "self", "knowledge",
                                                                                "corpus:pydoc"]
    assert resolve_sources(["corpus:pydoc", "auto"], cuda=False) == ["corpus:pydoc"]
    assert resolve_sources(["self"]) == ["self"] and resolve_sources([]) == []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert resolve_sources(["auto"]) == ["self", "knowledge", "corpus:pydoc"]  # this machine's answer where none is given


def test_a_corpus_the_data_is_built_from_is_left_out(tmp_path, tok_cmf, capsys, monkeypatch):
    """The default retain source, pydoc, is the flows' default data too: a mix of a corpus with
    itself is no other text, and would train on the data's test split cut another way."""
    user = build(["corpus:pydoc"], tok_cmf, tmp_path / "user.tdata", BuildSettings(record_tokens=40, max_total_tokens=2000))
    other = build([str(_text(tmp_path, "other", "beta"))], tok_cmf, tmp_path / "other.tdata", BuildSettings(record_tokens=40))
    assert other_sources(user.path, ["corpus:pydoc", "corpus:shakespeare", str(other.path)]) == \
        ["corpus:shakespeare", str(other.path)]
    assert capsys.readouterr().err == f"retain: corpus:pydoc left out: {user.path} is built from it\n"
    assert other_sources(other.path, ["corpus:pydoc"]) == ["corpus:pydoc"]
    # with the default alone nothing is mixed (on a CPU, where auto is pydoc alone): the data itself,
    # no panel, no stage run
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    work = tmp_path / "work"
    assert with_retain(user.path, tok_cmf, RetainSettings(), cli_runner(work, progress=False), work) == (str(user.path), {})
    assert not work.exists() or not any(work.iterdir())


def test_bad_retain_sources_say_so(tmp_path, mixed):
    with pytest.raises(CortiqError, match="not corpus:NAME, self, knowledge or a tdata directory"):
        mixed(sources=[str(tmp_path / "nowhere")])
    with pytest.raises(CortiqError, match="named twice"):
        RetainSettings(sources=["corpus:pydoc", "corpus:pydoc"])
    with pytest.raises(CortiqError, match="share"):
        RetainSettings(share=1.0)


def test_self_retain_is_a_cached_tdata_of_the_source_model(tmp_path):
    from data_helpers import tiny_model_cmf

    model = tiny_model_cmf(tmp_path / "m.cmf")
    user = build([str(_text(tmp_path, "user", "alpha"))], model, tmp_path / "user.tdata", BuildSettings(record_tokens=40))
    rs = RetainSettings(sources=["self"], tokens=2000)
    run = cli_runner(tmp_path / "work", progress=False)
    mix, panel = with_retain(user.path, model, rs, run, tmp_path / "work", progress=False)
    again, panel2 = with_retain(user.path, model, rs, run, tmp_path / "work", progress=False)
    assert mix == again and panel == panel2
    assert "self" in Tdata.open(mix).meta["mix"]["names"]
    # self_tokens sizes the self source alone (a corpus keeps `tokens`); 0 leaves it at `tokens`
    from cortiq.data.stages import retain_tdata

    sized = Tdata.open(retain_tdata("self", model, RetainSettings(sources=["self"], tokens=2000, self_tokens=300),
                                    run, tmp_path / "work", progress=False))
    assert sized.meta["settings"]["tokens"] == 300 and sum(len(r.ids) - r.first for r in sized.records()) == 300
    assert Tdata.open(retain_tdata("self", model, rs, run, tmp_path / "work", progress=False)).meta["settings"]["tokens"] == 2000


def test_the_knowledge_sources_size_travels_from_the_retain_settings_to_its_stage():
    from cortiq.data import knowledge
    from cortiq.data.stages import KNOWLEDGE, retain_tdata

    seen = {}

    def run(stage, key=None, **params):
        seen[key] = (stage, params["settings"])
        return {"path": "x"}

    retain_tdata("knowledge", "m.cmf", RetainSettings(sources=["knowledge"], seed=3), run, None)
    stage, default = seen.pop("retain.knowledge")
    assert stage is KNOWLEDGE and default == knowledge.KnowledgeSettings(seed=3)
    retain_tdata("knowledge", "m.cmf", RetainSettings(sources=["knowledge"], seed=3, knowledge_lists=2,
                                                       knowledge_entities=9), run, None)
    _, small = seen.pop("retain.knowledge")
    assert small == knowledge.KnowledgeSettings(seed=3, lists=2, entities=9)
