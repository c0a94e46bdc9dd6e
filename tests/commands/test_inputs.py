"""No writer touches an input: every command that writes a file or a folder refuses, in one line and
before any work, an output that is one of its inputs or one of their files, under any spelling and
whether --force is given or not (store.check_output, the one rule)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from cortiq.cli import main

from tiny import EOS, llama_arch

RULE = "cortiq: {out}: {why}; give another output path\n"


def _sharded(path: Path, seed: int = 0) -> list[Path]:
    """A tiny random model written as several shards -> its files (the first one first)."""
    import torch

    from cortiq.cmf import new_doc, open_cmf, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    torch.manual_seed(seed)
    arch = llama_arch()
    m = CausalLM(arch)
    specs = specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32")
    write_cmf(path, new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [EOS])), specs, shard_bytes=20_000)
    paths = open_cmf(path).paths
    assert len(paths) > 2
    return paths


def _digests(folder: Path) -> dict:
    """Every file under `folder` (links as their targets' names) by its bytes' sha256."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[p] = "-> " + os.readlink(p)
        elif p.is_file():
            out[p] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _refused(argv: list, line: str, capsys, folder: Path) -> None:
    """`cortiq argv` exits 1 with `line` alone on stderr, and leaves every file under `folder` as it was."""
    before = _digests(folder)
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 1
    assert capsys.readouterr().err == line
    assert _digests(folder) == before


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return _sharded(d / "m.cmf")


# ── the writer's own .partial and .lock names ──

@pytest.mark.parametrize("suffix", [".partial", ".lock"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_recode_from_its_own_working_file(tmp_path, capsys, suffix, force):
    # the input is named as the output's .partial (which the writer fills, then renames) or its
    # .lock (which the writer removes as it lets go): either would be the input's end
    src = tmp_path / ("x.cmf" + suffix)
    _sharded(tmp_path / "x.cmf")
    os.rename(tmp_path / "x.cmf", src)  # its shards keep their names: the header names them
    out = tmp_path / "x.cmf"
    line = RULE.format(out=out, why=f"writing it uses x.cmf{suffix}, which is the input {src}")
    _refused(["recode", src, out, "--codec", "f16", *force], line, capsys, tmp_path)
    assert not out.exists()


# ── a shard of a sharded input ──

#: writer -> its argv given the model M (the first file of a sharded model) and the output O
SHARD_WRITERS = {
    "recode": lambda m, o: ["recode", m, o, "--codec", "f16"],
    "compress": lambda m, o: ["compress", m, "--data", m.parent / "td", "--out", o],
    "heal (the teacher's shard)": lambda m, o: ["heal", m.parent / "student.cmf", "--teacher", m, "--data",
                                                m.parent / "td", "--out", o],
    "export gguf": lambda m, o: ["export", m, "--to", "gguf", o],
    "mtp init": lambda m, o: ["mtp", "init", m, "--out", o],
}


@pytest.mark.parametrize("spelling", ["plain", "dot", "relative", "symlink", "hardlink"])
@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("writer", sorted(SHARD_WRITERS))
def test_a_shard_of_an_input_is_never_an_output(tmp_path, capsys, monkeypatch, model, writer, force, spelling):
    d = model[0].parent
    shard = model[1]
    out = {"plain": str(shard), "dot": f"{d}/./{shard.name}", "relative": f"./models/{shard.name}",
           "symlink": str(d / "alias.cmf"), "hardlink": str(d / "alias.cmf")}[spelling]
    if spelling == "symlink":
        os.symlink(shard.name, out)
    elif spelling == "hardlink":
        os.link(shard, out)
    monkeypatch.chdir(tmp_path)
    line = RULE.format(out=Path(out), why=f"the output is {shard.name}, a shard of the input {model[0]}")
    _refused(SHARD_WRITERS[writer](model[0], out) + force, line, capsys, tmp_path)


# ── an output inside an input folder, an input inside an output folder ──

@pytest.mark.parametrize("force", [[], ["--force"]])
def test_convert_into_its_own_source_folder(tmp_path, capsys, force):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"\0" * 64)
    for out in (hf / "model.safetensors", hf / "new.cmf", f"{tmp_path}/./hf/sub/../model.safetensors"):
        line = RULE.format(out=Path(out), why=f"the output is inside the input folder {hf}")
        _refused(["convert", hf, out, *force], line, capsys, tmp_path)
    # a trailing slash names the same folder
    line = RULE.format(out=hf / "model.safetensors", why=f"the output is inside the input folder {hf}")
    _refused(["convert", f"{hf}/", hf / "model.safetensors", *force], line, capsys, tmp_path)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_data_build_into_the_folder_of_its_answering_model(tmp_path, capsys, model, force):
    from tiny import write_corpus, write_random

    d = tmp_path / "out"
    d.mkdir()
    g = write_random(d / "g.cmf", llama_arch())
    text = write_corpus(tmp_path / "t.txt")
    line = RULE.format(out=d, why=f"the output folder holds the input {g}, which replacing the folder would delete")
    _refused(["data", "build", text, "--tokenizer", model[0], "--generate-with", g, "--out", d, *force], line,
             capsys, tmp_path)
