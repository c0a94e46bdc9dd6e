"""A path that cannot be what a command needs is one line naming it, before any work: a file given
as --work or standing where the output's folder should be, a data folder that does not exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.cli import main

from tiny import llama_arch, write_corpus, write_random


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny model and a tdata directory of its tokens."""
    d = tmp_path_factory.mktemp("built")
    write_random(d / "m.cmf", llama_arch())
    write_corpus(d / "t.txt", 300)
    assert main(["data", "build", str(d / "t.txt"), "--tokenizer", str(d / "m.cmf"), "--out", str(d / "td")]) == 0
    return d


#: command -> its argv given the built folder B and the output O (every command that takes --work)
WORKERS = {
    "compress": lambda b, o: ["compress", b / "m.cmf", "--data", b / "td", "--out", o, "--retain-sources", "none"],
    "heal": lambda b, o: ["heal", b / "m.cmf", "--teacher", b / "m.cmf", "--data", b / "td", "--out", o,
                          "--retain-sources", "none"],
    "recode": lambda b, o: ["recode", b / "m.cmf", o, "--codec", "q4", "--data", b / "td"],
    "mtp heal": lambda b, o: ["mtp", "heal", b / "m.cmf", "--data", b / "td", "--out", o],
    "data self": lambda b, o: ["data", "self", b / "m.cmf"],
}


def _run(argv, capsys) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize("below", [False, True])
@pytest.mark.parametrize("cmd", sorted(WORKERS))
def test_a_file_as_work_is_named(cmd, below, built, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    work = f / "sub" if below else f
    err = _run(WORKERS[cmd](built, tmp_path / "o.cmf") + ["--work", work], capsys)
    assert err == (f"cortiq: --work {work}: {f} is a file, not a folder\n" if below else
                   f"cortiq: --work {f} is a file, not a folder\n")
    assert f.read_text() == "mine" and not list(tmp_path.glob("o.cmf*"))


@pytest.mark.parametrize("cmd", sorted(set(WORKERS) - {"data self"}) + ["data build", "convert", "export"])
def test_a_file_where_the_outputs_folder_should_be_is_named(cmd, built, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    out = f / "deeper" / "o.cmf"
    argv = {"data build": ["data", "build", built / "t.txt", "--tokenizer", built / "m.cmf", "--out", out],
            "convert": ["convert", built / "m.cmf", out],  # (refused before the source is read)
            "export": ["export", built / "m.cmf", "--to", "gguf", out]}.get(cmd) or WORKERS[cmd](built, out)
    assert _run(argv, capsys) == f"cortiq: {out}: {f} is a file, not a folder\n"
    assert f.read_text() == "mine"


@pytest.mark.parametrize("argv", [
    ["data", "inspect", "{nope}"],
    ["heal", "{m}", "--teacher", "{m}", "--data", "{nope}", "--out", "{o}", "--retain-sources", "none"],
    ["nll", "{m}", "{nope}"],
])
def test_a_data_folder_that_does_not_exist_is_no_such_file(argv, built, tmp_path, capsys):
    # not "not a finished stage output ... an interrupted run?": nothing was ever there
    nope = tmp_path / "nope"
    names = {"nope": nope, "m": built / "m.cmf", "o": tmp_path / "o.cmf"}
    assert _run([a.format(**names) for a in argv], capsys) == f"cortiq: {nope}: no such file or directory\n"


def test_a_file_as_a_data_folder_is_named(built, capsys):
    assert _run(["data", "inspect", built / "t.txt"], capsys) == \
        f"cortiq: {built / 't.txt'}: a file, not a stage output (a directory)\n"


def test_the_work_folder_of_the_cortiq_home(built, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.write_text("mine")
    monkeypatch.setenv("CORTIQ_HOME", str(home))
    err = _run(["recode", built / "m.cmf", tmp_path / "o.cmf", "--codec", "q4", "--data", built / "td"], capsys)
    assert err == f"cortiq: the work folder {home / 'work'}: {home} is a file, not a folder\n"
    assert Path(home).read_text() == "mine"
