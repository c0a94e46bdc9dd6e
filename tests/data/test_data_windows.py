"""Windows reproduce the seed's rules (heal_gpu.rs `windows`, `batch_of`; mtp_heal.rs `packed_windows`, `held_out`)."""

import json

import numpy as np
import pytest

from cortiq.data import BuildSettings, Tdata, build, cut_windows, fnv1a64, held_out, packed_windows, windows
from cortiq.data.windowing import cut_windows_reference, xorshift_order
from cortiq.store import parse_data_spec
from cortiq.errors import CortiqError
from cortiq.tokenizer import load_tokenizer

from data_helpers import EOS


@pytest.mark.parametrize("n,T", [(0, 4), (1, 4), (7, 3), (37, 5), (64, 8), (101, 16), (250, 1)])
def test_cut_windows_matches_the_seed_loop(n, T):
    rng = np.random.default_rng(n * 31 + T)
    ids = rng.integers(0, 259, n)
    # long unscored runs so that some windows have no scored row and are skipped
    weight = (rng.random(n) < 0.3).astype(np.float32) * (np.arange(n) % 40 < 15)
    fast, ref = cut_windows(ids, weight, T, EOS), cut_windows_reference(ids, weight, T, EOS)
    assert fast.ids.shape == ref.ids.shape == (len(ref), T)
    np.testing.assert_array_equal(fast.ids, ref.ids)
    np.testing.assert_array_equal(fast.next, ref.next)
    np.testing.assert_array_equal(fast.weight, ref.weight)
    assert fast.ids.dtype == np.int64 and fast.weight.dtype == np.float32


def test_seed_rules_by_hand():
    ids = np.arange(10, 21)  # 11 tokens
    w = np.zeros(11, np.float32)
    w[[2, 9, 10]] = 1  # token 2 is in window 0; tokens 4..7 (window 1) are all unscored; 9, 10 in window 2
    out = cut_windows(ids, w, 4, pad_id=99)
    # window 1 covers tokens 4..7; its rows look at tokens 5..8: all 0, so it is skipped
    assert len(out) == 2
    np.testing.assert_array_equal(out.ids, [[10, 11, 12, 13], [18, 19, 20, 99]])
    # row j predicts token j+1: window 0's last row looks at the next window's first token (14)
    np.testing.assert_array_equal(out.next, [[11, 12, 13, 14], [19, 20, 99, 99]])
    np.testing.assert_array_equal(out.weight, [[0, 1, 0, 0], [1, 1, 0, 0]])


def test_batches_repeat_a_short_split():
    w = cut_windows(np.arange(30), np.ones(30, np.float32), 10, 0)  # 3 windows (the last has 2 scored rows)
    assert len(w) == 3
    assert w.n_batches(4) == 1
    np.testing.assert_array_equal(w.batch_indices(4), [[0, 1, 2, 0]])
    (b,) = list(w.batches(4))
    np.testing.assert_array_equal(b.ids, w.ids[[0, 1, 2, 0]])
    assert w.n_batches(2) == 1 and w.n_batches(1) == 3
    w9 = cut_windows(np.arange(90), np.ones(90, np.float32), 10, 0)
    np.testing.assert_array_equal(w9.batch_indices(4), [[0, 1, 2, 3], [4, 5, 6, 7]])  # N // batch, the tail dropped
    empty = cut_windows(np.arange(5), np.zeros(5, np.float32), 4, 0)
    assert len(empty) == 0 and empty.n_batches(4) == 0
    with pytest.raises(CortiqError):
        w.n_batches(0)


def _jsonl(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _pairs(n, split="train", prefix="r"):
    return [{"id": f"{prefix}{i}", "prompt": f"Q{i}? ", "answer": f"answer number {i}.", "split": split} for i in range(n)]


def test_windows_of_a_tdata_follow_the_rid_hash_and_the_first_answer_token(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, _pairs(12) + _pairs(3, "val", "v"))
    td = build([str(src)], tok_cmf, tmp_path / "td", BuildSettings())
    recs = {r.rid: r for r in td.records("train")}
    order = sorted(recs, key=fnv1a64)
    stream = np.concatenate([recs[k].ids for k in order]).astype(np.int64)
    weight = np.concatenate([(np.arange(len(recs[k].ids)) >= recs[k].first) for k in order]).astype(np.float32)
    for T in (5, 16, 64):
        w = windows(td, "train", T, EOS, loss_on="answer")
        ref = cut_windows_reference(stream, weight, T, EOS)
        np.testing.assert_array_equal(w.ids, ref.ids)
        np.testing.assert_array_equal(w.weight, ref.weight)
    # the prompt "Qi? " is 4 byte tokens: first = 4, and the answer's tokens are the scored ones
    r = recs["r3"]
    tok = load_tokenizer(tok_cmf)
    assert r.first == 4 and tok.decode(r.ids[:4].tolist()) == "Q3? "
    assert tok.decode(r.ids[4:-1].tolist()) == "answer number 3." and r.ids[-1] == EOS
    # `all` scores every token but a record's first
    wa = windows(td, "train", 10_000, EOS, loss_on="all")
    assert wa.weight.sum() == len(stream) - len(order)
    wv = windows(td, "val", 10_000, EOS)
    assert len(wv) == 1 and wv.n_batches(8) == 1
    with pytest.raises(CortiqError, match="loss_on"):
        windows(td, "train", 8, EOS, loss_on="prompt")


def test_xorshift_order_is_the_seeds_generator():
    def seed_order(n):  # the seed's loop, in numpy's wrapping u64
        recs = list(range(n))
        rng = np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            for i in range(n - 1, 0, -1):
                rng ^= rng << np.uint64(13)
                rng ^= rng >> np.uint64(7)
                rng ^= rng << np.uint64(17)
                j = int(rng % np.uint64(i + 1))
                recs[i], recs[j] = recs[j], recs[i]
        return recs

    for n in (0, 1, 2, 7, 50):
        assert xorshift_order(n).tolist() == seed_order(n)


def test_packed_windows(tmp_path, tok_cmf):
    src = _jsonl(tmp_path, _pairs(20) + _pairs(4, "val", "v"))
    td = build([str(src)], tok_cmf, tmp_path / "set.tdata", BuildSettings())
    train = td.records("train")
    stream = np.concatenate([train[i].ids for i in xorshift_order(len(train))]).astype(np.int64)
    T = 16
    (p,) = packed_windows(f"{tmp_path / 'set.tdata'}", T, min_len=1)
    assert p.name == "set"
    n = len(stream)
    assert len(p) == -(-n // T)
    np.testing.assert_array_equal(p.ids.reshape(-1)[:n], stream)  # records span windows; nothing lost or reordered
    assert p.lengths[-1] == n - (len(p) - 1) * T and (p.ids[-1, p.lengths[-1]:] == EOS).all()
    np.testing.assert_array_equal(p.held, np.arange(len(p)) % 10 == 9)
    # a cap per set, and a short last window dropped under the minimum
    cap = 5 * T + 3
    a, b = packed_windows(f"{tmp_path / 'set.tdata'}@{cap},{tmp_path / 'set.tdata'}", T, tokens=4 * T, min_len=4)
    assert len(a) == 5 and (a.lengths == T).all()
    np.testing.assert_array_equal(a.ids.reshape(-1), stream[:5 * T])
    assert len(b) == 4
    c, = packed_windows(f"{tmp_path / 'set.tdata'}@{cap}", T, min_len=3)
    assert len(c) == 6 and c.lengths[-1] == 3
    assert held_out(9) and not held_out(8) and held_out(3, hold_all=True)


def test_parse_data_spec():
    assert parse_data_spec("a.tdata@100,b") == [("a.tdata", 100), ("b", None)]
    assert parse_data_spec("v@2/td") == [("v@2/td", None)]  # an @ in a folder name is the path's
    with pytest.raises(CortiqError):
        parse_data_spec(" , ")
    for bad in ("td@-5", "td@lots", "td@0", "td@", "td@１２"):
        with pytest.raises(CortiqError, match=f"data spec '{bad}': the token count .* is not a positive integer"):
            parse_data_spec(bad)


def test_fnv1a64_known_values_and_the_vectorised_form():
    from cortiq.data.tdata import fnv1a64_many

    # published FNV-1a 64 test vectors
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a64("foobar") == 0x85944171F73967E8
    rids = ["", "a", "foobar", "book:12", "pydoc/assert:0", "ünï:3", "x" * 70]
    np.testing.assert_array_equal(fnv1a64_many(rids), np.array([fnv1a64(r) for r in rids], dtype=np.uint64))
