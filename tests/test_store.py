"""Stage outputs: digests, directories finished by meta.json, Arrow files."""

import json

import pyarrow as pa
import pytest

from cortiq import store
from cortiq.errors import CortiqError


def test_digest_depends_on_what_not_how_it_is_written():
    a = store.digest("heal", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"])
    assert a == store.digest("heal", "1", {"ce": float("inf"), "k": (1, 2), "lr": 1e-4}, ["x", "y"])
    assert len(a) == 32
    others = {store.digest("heal", 2, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"]),
              store.digest("heal", 1, {"lr": 2e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"]),
              store.digest("heal", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["y", "x"]),
              store.digest("masks", 1, {"lr": 1e-4, "k": [1, 2], "ce": float("inf")}, ["x", "y"])}
    assert a not in others and len(others) == 4


def test_stage_dir_writes_meta_last_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "s-1"
    with store.stage_dir(out, {"digest": "d1"}) as part:
        assert part.name == "s-1.partial" and not store.is_complete(part)
        store.write_arrow(part / "t.arrow", pa.table({"a": [1, 2, 3]}))
    assert store.is_complete(out) and store.read_meta(out)["digest"] == "d1"
    assert store.read_arrow(out / "t.arrow").column("a").to_pylist() == [1, 2, 3]
    assert store.file_digest(out) == "d1"
    with pytest.raises(RuntimeError):
        with store.stage_dir(tmp_path / "s-2", {"digest": "d2"}):
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-1"]


def test_an_unfinished_directory_is_named_as_such(tmp_path):
    (tmp_path / "half").mkdir()
    assert not store.is_complete(tmp_path / "half")
    with pytest.raises(CortiqError, match="half: not a finished stage output"):
        store.read_meta(tmp_path / "half")
    store.finish_dir(tmp_path / "half", {"digest": "d3"})
    assert json.loads((tmp_path / "half" / "meta.json").read_text())["digest"] == "d3"
    with pytest.raises(CortiqError, match="not an Arrow file"):
        (tmp_path / "x.arrow").write_bytes(b"nope")
        store.read_arrow(tmp_path / "x.arrow")
