"""`cortiq data build|inspect` from the command line."""

import json

import pytest

from cortiq.cli import main
from cortiq.data import Tdata


def test_build_and_inspect(tmp_path, tok_cmf, capsys):
    (tmp_path / "a.txt").write_text("One paragraph.\n\nAnother one.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "q", "answer": "a", "split": "val", "category": "qa"}) + "\n")
    out = tmp_path / "td"
    rc = main(["data", "build", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--tokenizer", str(tok_cmf),
               "--out", str(out), "--fractions", "1,0,0", "--record-tokens", "20"])
    assert rc == 0
    td = Tdata.open(out)
    assert len(td.records("train")) == 2 and len(td.records("val")) == 1
    assert td.meta["settings"]["record_tokens"] == 20 and td.meta["settings"]["fractions"] == [1.0, 0.0, 0.0]
    capsys.readouterr()
    assert main(["data", "inspect", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["splits"]["val"] == {"records": 1, "tokens": 3, "scored": 2}
    assert got["categories"]["qa"]["records"] == 1 and got["tokens"] == td.counts()["tokens"]
    assert main(["data", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "train" in text and "qa" in text and "total" in text


def test_bad_input_is_one_line(tmp_path, tok_cmf, capsys):
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    rc = main(["data", "build", str(tmp_path / "b.jsonl"), "--tokenizer", str(tok_cmf), "--out", str(tmp_path / "td")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"cortiq: {tmp_path / 'b.jsonl'}:2: not JSON") and "Traceback" not in err
    assert main(["data", "inspect", str(tmp_path / "td")]) == 1  # nothing was written
    assert capsys.readouterr().err == f"cortiq: {tmp_path / 'td'}: no such file or directory\n"
    assert main(["data", "build", "--tokenizer", str(tok_cmf), "--out", str(tmp_path / "td")]) == 1
    assert "no sources" in capsys.readouterr().err


def test_self_generates_tdata_once_and_refuses_a_bad_mix(tmp_path, capsys):
    from data_helpers import tiny_model_cmf

    m = tiny_model_cmf(tmp_path / "m.cmf")
    argv = ["data", "self", str(m), "--tokens", "40", "--max-new", "8", "--slots", "4", "--device", "cpu",
            "--work", str(tmp_path / "work")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    d = out.split(":")[0]
    td = Tdata.open(d)
    assert td.counts()["scored"] == 40 and "40 generated" in out and td.meta["settings"]["max_new"] == 8
    assert main(argv) == 0 and capsys.readouterr().out == out  # the second time: the same directory, reused
    assert main(argv[:-2] + ["--mix", "0.5,0.5,0.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cortiq: selfgen settings: mix must be three non-negative numbers summing to 1") and "Traceback" not in err


@pytest.mark.parametrize("option, line", [
    (["--mix", "nan,0.5,0.5"], "selfgen settings: mix must be three non-negative numbers summing to 1, not (nan, 0.5, 0.5)"),
    (["--mix", "inf,0,0"], "selfgen settings: mix must be three non-negative numbers summing to 1, not (inf, 0.0, 0.0)"),
    (["--temperature", "inf"], "selfgen settings: temperature inf is not a finite number"),
    (["--temperature", "nan"], "selfgen settings: temperature nan is not a finite number"),
    (["--ask", "nan"], "selfgen settings: ask nan is not a finite number"),
])
def test_self_takes_finite_settings_only(tmp_path, capsys, option, line):
    # refused before the model is read or anything is generated: one line, nothing written
    from data_helpers import tiny_model_cmf

    m = tiny_model_cmf(tmp_path / "m.cmf")
    before = m.read_bytes()
    assert main(["data", "self", str(m), "--work", str(tmp_path / "work"), "--device", "cpu", *option]) == 1
    assert capsys.readouterr().err == f"cortiq: {line}\n"
    assert m.read_bytes() == before and not (tmp_path / "work").exists()
