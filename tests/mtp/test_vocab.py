"""The draft's vocabulary (cortiq.mtp.vocab): the ranking against a plain sort, its entry read back
and refused when damaged, the serving side's choice of rows, and `cortiq generate` narrowing a draft
without changing the answer."""

import base64
import re
import types

import numpy as np
import pytest
from cortiq.errors import CortiqError
from cortiq.mtp import vocab as V


def _plain_ranking(t1, ids, lens, vocab):
    """The ranking by a Python sort: greedy count, then text count (both descending), then id."""
    greedy, text = [0] * vocab, [0] * vocab
    for row_t1, row_ids, n in zip(t1.tolist(), ids.tolist(), lens.tolist()):
        for a, b in zip(row_t1[:n], row_ids[:n]):
            greedy[a] += 1
            text[b] += 1
    return sorted(range(vocab), key=lambda t: (-greedy[t], -text[t], t))


@pytest.mark.parametrize("vocab,seed", [(37, 0), (259, 1), (1000, 2)])
def test_ranking_equals_a_plain_sort(vocab, seed):
    g = np.random.default_rng(seed)
    N, T = 7, 23
    # few distinct greedy tokens (ties broken by the text's counts, then by id), padding past each length
    t1 = g.integers(0, min(vocab, 9), (N, T))
    ids = g.integers(0, vocab, (N, T))
    lens = g.integers(1, T + 1, N)
    t1[0, lens[0]:] = vocab - 1  # rows past a window's length never count
    got = V.ranking(t1, ids, lens, vocab)
    assert got.dtype == np.int32 and got.tolist() == _plain_ranking(t1, ids, lens, vocab)


def _file(vocab: int, entry=None, path="m.cmf"):
    doc = {} if entry is None else {V.KEY: entry}
    return types.SimpleNamespace(doc=doc, path=path, arch=types.SimpleNamespace(vocab_size=vocab))


def test_an_entry_reads_back_and_the_first_n_are_the_engines_ids():
    r = np.random.default_rng(3).permutation(100).astype(np.int32)
    f = _file(100, V.entry(r, "counted here"))
    assert V.stored(f).tolist() == r.tolist()
    assert V.draft_ids(f, 10).tolist() == r[:10].tolist()
    assert V.draft_ids(f, 0) is None and V.draft_ids(f, 100) is None and V.draft_ids(f, 5000) is None


@pytest.mark.parametrize("ids,why", [
    ("not base64!", "is not a base64 list of token ids"),
    (base64.b64encode(np.arange(99, dtype="<i4").tobytes()).decode(), "is not a ranking of its 100 tokens"),
    (base64.b64encode(np.r_[np.arange(99), 5].astype("<i4").tobytes()).decode(), "is not a ranking of its 100 tokens"),
    (base64.b64encode(np.r_[np.arange(99), 100].astype("<i4").tobytes()).decode(), "is not a ranking of its 100 tokens"),
    (base64.b64encode(np.r_[np.arange(1, 100), -1].astype("<i4").tobytes()).decode(), "is not a ranking of its 100 tokens"),
])
def test_a_damaged_entry_is_one_line_naming_the_file(ids, why):
    with pytest.raises(CortiqError, match=f"^m.cmf: its draft_vocab entry {why}"):
        V.stored(_file(100, {"ids": ids, "counted": "x"}))


def test_auto_narrows_only_large_vocabularies_with_a_ranking():
    big = V.AUTO_ABOVE + 10
    r = np.arange(big, dtype=np.int32)[::-1].copy()
    assert V.engine_ids(_file(big, V.entry(r, "x")), 0).tolist() == r[: V.AUTO_ROWS].tolist()
    assert V.engine_ids(_file(big), 0) is None  # no ranking: the whole head
    assert V.engine_ids(_file(1000, V.entry(np.arange(1000, dtype=np.int32), "x")), 0) is None  # small: whole
    assert V.engine_ids(_file(big, V.entry(r, "x")), 12).tolist() == r[:12].tolist()
    with pytest.raises(CortiqError, match=r"^m.cmf: --draft-vocab 12 needs the draft's token ranking, which "
                                          r"`cortiq mtp heal` writes; this model has none"):
        V.engine_ids(_file(big), 12)


def test_generate_with_a_narrow_draft_answers_as_plain(tiny, tmp_path, capsys):
    # a draft among 40 tokens of mtp heal's ranking: the static-cache engine's speculative answer is plain
    # greedy's, token for token (f32 on the CPU), and a model without a ranking is refused in one line
    from cortiq.cli import main
    from cortiq.mtp import MtpSettings, mtp_heal

    model, data = tiny
    out = tmp_path / "healed.cmf"
    mtp_heal(model, str(data), MtpSettings(window=32, topk=8, batch=2, chain=2, epochs=0.0, device="cpu",
                                           head_chunk=64), out)
    assert main(["inspect", str(out)]) == 0
    # (the windows mtp heal trained on: nine in ten of them)
    line = rf"draft      tokens ranked by the trunk's greedy tokens on \d+ windows of {re.escape(str(data))} \(--draft-vocab N\)"
    assert re.search(line, capsys.readouterr().out, re.M)
    args = ["generate", str(out), "ab", "--max-new", "12", "--speculative", "--draft", "2", "--device", "cpu"]
    assert main(args + ["--draft-vocab", "40"]) == 0
    assert "output identical to plain greedy" in capsys.readouterr().err
    assert main(["generate", str(model), "ab", "--max-new", "4", "--speculative", "--device", "cpu",
                 "--draft-vocab", "40"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"cortiq: {model}: --draft-vocab 40 needs the draft's token ranking, which `cortiq mtp heal` writes; this "
        "model has none (heal its draft, or give --draft-vocab 0)")
