"""MTP heal across ranks (two gloo processes on the CPU): the trunk pass's
shards read back as one rank's rows (with a cache and without one), and the
draft trained on two ranks, each taking half of every batch, is the one a
single process trains."""

import pytest
import torch

from cortiq.cmf import open_cmf
from cortiq.model import load_model
from cortiq.mtp import MtpSettings, mtp_heal
from cortiq.mtp.trunk import trunk_sets

from mtp_helpers import EOS
from ranks import run_ranks


def small(**kw):
    base = dict(window=32, tokens=100000, topk=8, batch=2, chain=2, refresh=10, eval_every=10, patience=0,
                lr=3e-3, epochs=2.0, device="cpu", head_chunk=64, gen_prompt=8, trunk_batch=3)
    base.update(kw)
    return MtpSettings(**base)


def _packed(data):
    from cortiq.data.windowing import packed_windows

    return packed_windows(str(data), 32, 100000, min_len=18, pad_id=EOS)


def _trunk(rank, model, data, cache, out):
    f = open_cmf(model)
    sets, info = trunk_sets(load_model(f), f, _packed(data), 32, 8, cache, batch=3)
    if rank == 1:  # a rank other than 0 gets the whole set too
        s = sets[0]
        torch.save({"ids": s.ids, "lens": s.lens, **_rows(s), "info": info}, out)


def _rows(s) -> dict:
    every = range(len(s))
    return {k: torch.from_numpy(getattr(s, k).take(every)).to(torch.int64 if k == "ti" else torch.float32)
            for k in ("ti", "tp", "h")}


def _heal(rank, model, data, out):
    mtp_heal(model, str(data), small(), out)


#: the trunk pass's cache on two ranks: a folder, then none
CACHES = ("cache", None)


def _all_jobs(rank, model, data, root):
    for i, cache in enumerate(CACHES):
        _trunk(rank, model, data, cache and root / cache, root / f"trunk-{i}.pt")
    _heal(rank, model, data, root / "two.cmf")


@pytest.fixture(scope="module")
def ranks(tiny, tmp_path_factory):
    """The rank jobs of the tests below, run once in the same two processes and group (each pair of
    rank processes costs two interpreters, torch's import and the group's set-up): the trunk pass
    with a cache and without one, then the whole MTP heal. The folder they wrote to."""
    model, data = tiny
    root = tmp_path_factory.mktemp("ranks")
    # conftest's temp home is a test's, set after a module's fixtures: this one gets its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORTIQ_HOME", str(root / "cortiq-home"))
        run_ranks(_all_jobs, 2, model, data, root, tmp=root)
    return root


def test_trunk_pass_shards_read_back_as_one_ranks_rows(tiny, ranks):
    model, data = tiny
    f = open_cmf(model)
    ref = trunk_sets(load_model(f), f, _packed(data), 32, 8, None, batch=3)[0][0]
    for i, _ in enumerate(CACHES):
        got = torch.load(ranks / f"trunk-{i}.pt", weights_only=True)
        assert len(ref) == len(got["ids"]) > 6
        want = {"ids": ref.ids, "lens": ref.lens, **_rows(ref)}
        for k in ("ids", "lens", "ti", "tp", "h"):
            assert torch.equal(got[k], want[k]), k
        assert got["info"][0]["read_back"] is False
    d = next((ranks / "cache").iterdir())
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "trunk-000-of-002.arrow", "trunk-001-of-002.arrow"]
    # and read back by one process as the one set
    back = trunk_sets(load_model(f), f, _packed(data), 32, 8, ranks / "cache", batch=3)
    assert back[1][0]["read_back"] is True and torch.equal(_rows(back[0][0])["h"], want["h"])


def test_two_ranks_train_the_draft_one_process_trains(tiny, ranks, tmp_path):
    model, data = tiny
    mtp_heal(model, str(data), small(), tmp_path / "one.cmf")
    one, two = open_cmf(tmp_path / "one.cmf"), open_cmf(ranks / "two.cmf")
    p1, p2 = one.provenance["mtp_heal"], two.provenance["mtp_heal"]
    assert p1["steps"] == p2["steps"] > 10 and p1["best_step"] == p2["best_step"]
    names = [n for n in one.infos if n.startswith("model.mtp.")]
    moved = 0
    src = open_cmf(model)
    for n in names:
        torch.testing.assert_close(one.tensor(n), two.tensor(n), rtol=1e-4, atol=1e-5, msg=n)
        moved += not torch.equal(one.tensor(n), src.tensor(n))
    assert moved > 0  # the draft trained
