"""Property tests of the readers in this process (fast, so many examples): whatever the bytes
or values, the outcome is a file that opens or one CortiqError, never another exception;
the checks that stop laundering (sha256 on read, NaN/Inf refused); the CLI's last resort."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortiq import cmf
from cortiq.arch import Arch, ArchError, from_hf_config
from cortiq.cmf import CmfError, open_cmf
from cortiq.errors import CortiqError
from fuzz_gen import ARCH, HF_CONFIG, NORM, join, mutated, split, write_valid_cmf

PROP = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    return write_valid_cmf(tmp_path_factory.mktemp("v") / "m.cmf").read_bytes()


def _open_or_refuse(path: Path):
    """Open `path` and touch everything a reader sizes from the header; a CortiqError is fine."""
    try:
        f = open_cmf(path)
    except CortiqError as e:
        assert "\n" not in str(e)
        return None
    from cortiq.commands.inspect import summary

    json.dumps(summary(f))
    return f


@PROP
@given(data=st.data())
def test_any_header_bytes(data, raw, tmp_path_factory):
    """Bytes of the header overwritten anywhere with anything."""
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    at = data.draw(st.integers(0, 8 + n - 1))
    junk = data.draw(st.binary(min_size=1, max_size=16))
    p = tmp_path_factory.mktemp("h") / "m.cmf"
    p.write_bytes(raw[:at] + junk + raw[at + len(junk):])
    _open_or_refuse(p)


_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=6)),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=6)


@PROP
@given(key=st.sampled_from(sorted(ARCH.to_dict())), value=_json)
def test_any_arch_value(key, value):
    d = ARCH.to_dict()
    d[key] = value
    try:
        a = Arch.from_dict(d)
    except ArchError as e:
        assert "\n" not in str(e)
        return
    # accepted: then it is a geometry whose lists match its counts and whose numbers are bounded
    assert len(a.layer_types) == len(a.intermediate_sizes) == a.num_layers <= 1024
    assert all(isinstance(x, int) for x in a.intermediate_sizes)


@PROP
@given(key=st.sampled_from(sorted(HF_CONFIG) + ["rope_scaling", "rope_parameters", "text_config", "layer_types"]),
       value=_json)
def test_any_hf_config_value(key, value):
    cfg = dict(HF_CONFIG, **{key: value})
    try:
        a = from_hf_config(cfg)
    except ArchError as e:
        assert "\n" not in str(e)
        return
    assert a.num_layers == len(a.layer_types) <= 1024


@PROP
@given(key=st.sampled_from(["version", "arch", "tokenizer", "codecs", "hashes", "provenance", "shards", "format"]),
       value=_json)
def test_any_document_value(key, value, raw, tmp_path_factory):
    header, data = split(raw)
    doc = json.loads(header["__metadata__"]["cmf"])
    doc[key] = value
    header["__metadata__"]["cmf"] = json.dumps(doc)
    p = tmp_path_factory.mktemp("d") / "m.cmf"
    p.write_bytes(join(header, data))
    _open_or_refuse(p)


# ── laundering ──────────────────────────────────────────────────────────


def _file(tmp_path, raw, case=None) -> Path:
    p = tmp_path / "m.cmf"
    p.write_bytes(mutated(raw, case) if case else raw)
    return p


def test_load_model_checks_each_hash_as_it_reads(raw, tmp_path):
    from cortiq.model import load_model

    with pytest.raises(CmfError, match=r"tensor 'model.norm.weight' does not match its recorded sha256"):
        load_model(_file(tmp_path, raw, "flipped data byte"))
    with pytest.raises(CmfError, match=r"tensor 'model.norm.weight' has no recorded sha256"):
        load_model(_file(tmp_path, raw, "hash missing"))
    m = load_model(_file(tmp_path, raw, "flipped data byte"), verify=False)  # asked for: read unchecked
    good = load_model(_file(tmp_path, raw))
    w, w0 = dict(m.named_parameters())[NORM], dict(good.named_parameters())[NORM]
    assert int((w != w0).sum()) == 1


def test_load_model_refuses_nonfinite_weights_unless_asked(raw, tmp_path):
    from cortiq.model import load_model

    with pytest.raises(CmfError, match=r"tensor 'model.norm.weight' holds 1 NaN or Inf values"):
        load_model(_file(tmp_path, raw, "NaN weight"))
    m = load_model(_file(tmp_path, raw, "NaN weight"), allow_nonfinite=True)
    assert int(torch.isnan(dict(m.named_parameters())[NORM]).sum()) == 1


@pytest.mark.parametrize("codec", ["f32", "q8"])  # copied as stored, and decoded and re-encoded
def test_copy_refuses_a_damaged_tensor_and_leaves_nothing(raw, tmp_path, codec):
    src = open_cmf(_file(tmp_path, raw, "flipped data byte"))
    out = tmp_path / "out.cmf"
    specs = cmf.copy_specs(src, lambda n, i: codec if n != NORM else "f32")
    with pytest.raises(CmfError, match="does not match its recorded sha256"):
        cmf.write_cmf(out, src.doc, specs)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_verify_names_nonfinite_tensors(raw, tmp_path):
    nonfinite: list[str] = []
    assert open_cmf(_file(tmp_path, raw, "NaN weight")).verify(nonfinite=nonfinite) == []
    assert nonfinite == [NORM]


# ── the CLI's last resort ───────────────────────────────────────────────


def test_a_bug_is_reported_as_one(monkeypatch, capsys):
    from cortiq import cli
    from cortiq.commands import inspect

    def boom(args):
        raise KeyError("surprise")

    monkeypatch.setattr(inspect, "run", boom)
    assert cli.main(["inspect", "x.cmf"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'surprise'" in err
    assert err.strip().splitlines()[-1].startswith("cortiq: this is a bug in cortiq, not a problem with your input")


def test_os_errors_and_multiline_messages_are_one_line(monkeypatch, capsys):
    from cortiq import cli
    from cortiq.commands import inspect

    monkeypatch.setattr(inspect, "run", lambda a: open("/nonexistent/dir/x"))
    assert cli.main(["inspect", "x.cmf"]) == 1
    assert capsys.readouterr().err == "cortiq: /nonexistent/dir/x: No such file or directory\n"

    def multi(args):
        raise CortiqError("first\nsecond")

    monkeypatch.setattr(inspect, "run", multi)
    assert cli.main(["inspect", "x.cmf"]) == 1
    assert capsys.readouterr().err == "cortiq: first second\n"


# ── a damaged training checkpoint ───────────────────────────────────────


def test_a_damaged_checkpoint_restarts_the_stage(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "heal"))
    from heal_toy import ToyLM, toy_split

    from cortiq.heal.settings import HealSettings
    from cortiq.heal.parallel import CHECKPOINT
    from cortiq.heal.train import StudentTail, fit

    def setup():
        teacher, student = ToyLM(seed=0), ToyLM(seed=1)
        tail = StudentTail(student, 0, False, drop_prefix=False)
        return tail, toy_split(teacher, 12, 8, 4, 5, seed=2), toy_split(teacher, 4, 8, 4, 5, seed=3, train=False)

    s = HealSettings(epochs=1.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=2, topk=5)
    cpu = torch.device("cpu")
    tail, tr, va = setup()
    ref = fit(tail, tr, va, s, tmp_path / "a", cpu, torch.float32, key="k", progress=False)
    ck = tmp_path / "a" / CHECKPOINT
    assert ck.exists()
    ck.write_bytes(ck.read_bytes()[:100])  # a checkpoint cut short (a full disk, a crash mid-copy)
    tail2, tr2, va2 = setup()
    rep = fit(tail2, tr2, va2, s, tmp_path / "a", cpu, torch.float32, key="k", progress=False)
    err = [line for line in capsys.readouterr().err.splitlines() if "damaged checkpoint" in line]
    assert len(err) == 1 and "the stage restarts from its beginning" in err[0]
    assert (tmp_path / "a" / (CHECKPOINT + ".damaged")).exists()
    # restarted from scratch: the same run as the first, step for step
    assert [h["loss"] for h in rep["history"]] == [h["loss"] for h in ref["history"]]
    for n, w in tail.state().items():
        assert torch.equal(w, tail2.state()[n]), n
