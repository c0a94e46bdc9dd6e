"""bench.mtp.draft_carry: a draft saved from one model and loaded into another of the same trunk
gives back the drafted model's tensors, byte for byte; mismatched files are refused."""

import pytest
import torch

from bench.common import tiny_cmf
from bench.mtp.draft_carry import PREFIX, load, main, save
from cortiq.cmf import open_cmf
from cortiq.errors import CortiqError


def test_a_draft_saved_and_loaded_is_the_drafted_model(tmp_path, monkeypatch):
    drafted = tiny_cmf(tmp_path / "drafted.cmf", mtp=True, seed=1)
    init = tiny_cmf(tmp_path / "init.cmf", mtp=True, seed=2)  # another draft on ...
    a, b = open_cmf(drafted), open_cmf(init)
    trunk = [n for n in a.names if not n.startswith(PREFIX)]
    # ... the same trunk: the drafted model's trunk tensors into init's file
    from cortiq.cmf import Stored, copy_specs, write_cmf

    specs = copy_specs(b)
    for s in specs:
        if s.name in trunk:
            s.get = lambda n=s.name: Stored(a.stored(n))
    write_cmf(tmp_path / "same-trunk.cmf", b.doc, specs)
    monkeypatch.setattr("bench.mtp.draft_carry.PART", 2000)   # several files
    files = save(str(drafted), str(tmp_path / "d"))
    assert len(files) > 1
    out = load(str(tmp_path / "same-trunk.cmf"), str(tmp_path / "d"), str(tmp_path / "out.cmf"))
    c = open_cmf(out)
    assert c.names == a.names and all(torch.equal(c.stored(n), a.stored(n)) for n in a.names)
    assert c.verify() == []


def test_mismatched_files_are_refused(tmp_path, capsys):
    small = tiny_cmf(tmp_path / "small.cmf", mtp=True, hidden=64)
    wide = tiny_cmf(tmp_path / "wide.cmf", mtp=True, hidden=96)
    save(str(small), str(tmp_path / "d"))
    with pytest.raises(CortiqError, match=r"model\.mtp\..* holds"):
        load(str(wide), str(tmp_path / "d"), str(tmp_path / "x.cmf"))
    assert not (tmp_path / "x.cmf").exists()
    assert main(["load", str(small), str(tmp_path / "nothing"), str(tmp_path / "y.cmf")]) == 2
    assert capsys.readouterr().err.strip().endswith("no draft-*.safetensors files (made by `python -m bench.mtp.draft_carry save`)")
    assert main(["save", str(tiny_cmf(tmp_path / "plain.cmf")), str(tmp_path / "e")]) == 2
