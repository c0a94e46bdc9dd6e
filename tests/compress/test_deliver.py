"""Putting a cached stage output at the user's path, again: a re-run over an existing output
leaves only the output (no `.partial` hard-linked to it and the cache entry)."""

import os

from cortiq.pipeline import deliver


def test_a_second_delivery_leaves_no_partial_link(tmp_path):
    entry = tmp_path / "cache" / "student.cmf"
    entry.parent.mkdir()
    entry.write_bytes(b"model")
    out = tmp_path / "cr.cmf"
    for _ in range(2):
        assert deliver({"path": str(entry)}, out) == out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "cr.cmf"]
    assert os.path.samefile(out, entry) and os.stat(entry).st_nlink == 2


def test_a_stale_output_is_replaced(tmp_path):
    entry = tmp_path / "new.cmf"
    entry.write_bytes(b"new")
    out = tmp_path / "cr.cmf"
    out.write_bytes(b"old")
    deliver({"path": str(entry)}, out)
    assert out.read_bytes() == b"new" and not (tmp_path / "cr.cmf.partial").exists()
