"""The CMF commands through the CLI: convert (source dispatch), inspect,
verify, recode; and bad input: one line on stderr naming the file, exit 1,
no traceback, nothing left behind."""

import json
import re
import subprocess
import sys

import pytest
import torch

from cortiq import cmf, codecs
from cortiq.arch import Arch
from cortiq.cli import main
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

ARCH = Arch("llama", vocab_size=259, hidden_size=32, num_layers=2, intermediate_sizes=[64, 48],
            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
N_TENSORS = 2 + 9 * 2  # embedding and final norm; 4 attention, 3 MLP and 2 norm weights a layer


@pytest.fixture
def model(tmp_path):
    from cortiq.model import CausalLM

    g = torch.Generator().manual_seed(1)
    with torch.device("meta"):  # every tensor of the arch: verify and recode refuse what load refuses
        shapes = {n: tuple(p.shape) for n, p in CausalLM(ARCH).named_parameters()}
    ts = {n: torch.rand(s, generator=g) if len(s) == 1 else torch.randn(s, generator=g) for n, s in shapes.items()}
    doc = cmf.new_doc(ARCH, tokenizer_doc(byte_tokenizer_json(), eos_ids=[256]), {"convert": {"source": "test"}})
    path = tmp_path / "m.cmf"
    cmf.write_cmf(path, doc, cmf.specs_from_tensors(ts.items(), "f32"))
    return path


def fails(capsys, argv, pattern, folder):
    before = sorted(folder.iterdir())
    capsys.readouterr()
    assert main(argv) == 1
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("cortiq: ") and re.search(pattern, err), err
    assert sorted(folder.iterdir()) == before  # no output, no .partial
    return err


@pytest.mark.parametrize("cmd", ["convert", "inspect", "verify", "recode"])
def test_help(cmd):
    out = subprocess.run([sys.executable, "-m", "cortiq", cmd, "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(f"usage: cortiq {cmd}")


def test_help_imports_no_torch():
    code = ("import sys; from cortiq.cli import main\ntry: main(['recode', '--help'])\nexcept SystemExit: pass\n"
            "print([m for m in ('torch', 'prefect', 'mlflow', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("[]")


def test_inspect_text_and_json(model, capsys):
    assert main(["inspect", str(model)]) == 0
    text = capsys.readouterr().out
    assert "llama: 2 layers, hidden 32, MLP 48..64" in text and "f32" in text and "convert:" in text
    assert main(["inspect", str(model), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["arch"]["num_layers"] == 2 and s["arch"]["intermediate_sizes"] == [64, 48]
    assert s["tensors"] == N_TENSORS and s["codecs"]["f32"]["tensors"] == N_TENSORS
    assert s["bytes"] == s["codecs"]["f32"]["bytes"] == 4 * s["params"]
    assert s["tokenizer"]["eos_ids"] == [256] and s["provenance"] == {"convert": {"source": "test"}}


def test_recode_any_codec_to_any_codec(model, tmp_path, capsys):
    src = cmf.open_cmf(model)
    prev = model
    for codec in ["q4", "q8", "bf16", "q4_64", "fp8", "f16", "f32"]:
        out = tmp_path / f"{codec}.cmf"
        assert main(["recode", str(prev), str(out), "--codec", codec]) == 0
        a, b = cmf.open_cmf(prev), cmf.open_cmf(out)
        for name in src.names:
            # quantized codecs take matrices; vectors stay in their plain codec; 4-bit ones keep the embedding
            # and head at q8
            want = codec if (codecs.get(codec).plain or len(a.info(name).shape) >= 2) else a.info(name).codec
            if codec in ("q4", "q4_64") and name.startswith(("model.embed_tokens.", "lm_head.")):
                want = "q8"
            assert b.info(name).codec == want, (codec, name)
            x = a.tensor(name)
            assert bool(((b.tensor(name) - x).abs() <= codecs.get(want).bound(x)).all()), (codec, name)
        assert b.verify() == []
        prev = out
    capsys.readouterr()
    assert main(["inspect", str(prev), "--json"]) == 0
    prov = json.loads(capsys.readouterr().out)["provenance"]
    assert list(prov) == ["convert", "recode"] + [f"recode#{k}" for k in range(2, 8)]
    assert prov["recode#7"]["codec"] == "f32"


def test_verify_ok_and_flipped_byte(model, capsys):
    assert main(["verify", str(model)]) == 0
    assert f"ok, {N_TENSORS} tensors" in capsys.readouterr().out
    info = cmf.open_cmf(model).info("model.layers.1.mlp.up_proj.weight")
    data = bytearray(model.read_bytes())
    data[info.start + 3] ^= 0x80
    model.write_bytes(bytes(data))
    fails(capsys, ["verify", str(model)],
          rf"m\.cmf: 1 of {N_TENSORS} tensors fail their sha256: model\.layers\.1\.mlp\.up_proj\.weight$", model.parent)


@pytest.mark.parametrize("cmd", [["inspect"], ["verify"], ["recode", "--codec", "q8"]])
def test_truncated_file(model, capsys, cmd):
    model.write_bytes(model.read_bytes()[:-100])
    argv = [cmd[0], str(model)] + ([str(model.parent / "out.cmf")] + cmd[1:] if cmd[0] == "recode" else [])
    fails(capsys, argv, r"m\.cmf: truncated", model.parent)


@pytest.mark.parametrize("cmd", ["inspect", "verify", "recode"])
def test_not_a_cmf_file(tmp_path, capsys, cmd):
    bad = tmp_path / "notes.txt"
    bad.write_text("just some text, longer than eight bytes\n")
    argv = [cmd, str(bad)] + ([str(tmp_path / "out.cmf"), "--codec", "q8"] if cmd == "recode" else [])
    fails(capsys, argv, r"notes\.txt: not a CMF file", tmp_path)


def test_unknown_codec(model, capsys):
    fails(capsys, ["recode", str(model), str(model.parent / "o.cmf"), "--codec", "q3"],
          r"unknown codec 'q3' \(known: f32, f16, bf16, q8, q4, q4_64, fp8", model.parent)


def test_unknown_codec_inside_a_file(tmp_path, capsys):
    # a file written with a codec this cortiq does not know (a plugin's, say)
    path = tmp_path / "m.cmf"
    cmf.write_cmf(path, cmf.new_doc(ARCH, None), [cmf.Spec("w", "q8", (4, 32), lambda: torch.randn(4, 32))])
    raw = path.read_bytes()
    bad = raw.replace(b'\\"codec\\": \\"q8\\"', b'\\"codec\\": \\"zz\\"')  # same length: the header stays valid
    assert bad != raw
    path.write_bytes(bad)
    fails(capsys, ["inspect", str(path)], r"m\.cmf: tensor 'w': unknown codec 'zz'", tmp_path)


def test_convert_bad_sources(tmp_path, capsys):
    fails(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "o.cmf")],
          r"nope: no such file or directory \(SRC is a Hugging Face directory, a \.gguf file or one of: smollm2\)", tmp_path)
    text = tmp_path / "model.bin"
    text.write_bytes(b"\x00" * 64)
    fails(capsys, ["convert", str(text), str(tmp_path / "o.cmf")], r"model\.bin: cannot convert: not a GGUF file", tmp_path)
    d = tmp_path / "hfdir"
    d.mkdir()
    fails(capsys, ["convert", str(d), str(tmp_path / "o.cmf")], r"hfdir: a directory without config\.json", tmp_path)


def test_convert_unsupported_hf_architecture(tmp_path, capsys):
    """A HF directory goes to cortiq.convert.hf, whose errors reach the user as one line."""
    pytest.importorskip("cortiq.convert.hf")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "num_hidden_layers": 1}))
    fails(capsys, ["convert", str(d), str(tmp_path / "o.cmf")], r"unsupported architecture 'gpt_neox'; supported: ", tmp_path)


def test_recode_refuses_a_missing_input(tmp_path, capsys):
    fails(capsys, ["recode", str(tmp_path / "none.cmf"), str(tmp_path / "o.cmf"), "--codec", "q8"],
          r"none\.cmf: no such file", tmp_path)
