"""`cortiq heal` end to end on tiny models, and its one-line errors."""

import json

from cortiq.cli import main
from cortiq.cmf import open_cmf

from heal_models import arch, perturbed, random_weights, save, tdata


def test_cli_heals_and_reports(tmp_path, capsys):
    a = arch()
    w = random_weights(a)
    teacher = save(tmp_path / "t.cmf", a, w)
    student = save(tmp_path / "s.cmf", a, perturbed(w))
    td = tdata(tmp_path, teacher, chars=4000)
    out = tmp_path / "h.cmf"
    rc = main(["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--out", str(out), "--window", "32",
               "--batch", "4", "--topk", "8", "--lr", "3e-3", "--ce", "0.25", "--train-from", "1", "--ffn-only",
               "--device", "cpu", "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "NLL on the test split of the heal data" in text and "gap recovered" in text
    prov = open_cmf(out).provenance["heal"]
    assert prov["ce"] == 0.25 and prov["settings"]["ffn_only"] and prov["prefix"] in ("f32", "f16")
    rep = json.loads((tmp_path / "h.cmf.report.json").read_text())
    assert rep["metrics"]["heldout_best"] <= rep["metrics"]["heldout_start"]


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    a = arch()
    teacher = save(tmp_path / "t.cmf", a, random_weights(a))
    td = tdata(tmp_path, teacher, chars=2000)
    rc = main(["heal", str(teacher), "--teacher", str(teacher), "--data", str(td), "--out", str(tmp_path / "h.cmf"),
               "--train-from", "5", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("cortiq: ") and "train_from 5 is beyond its 2 layers" in err and err.count("\n") == 1
    rc = main(["heal", str(teacher), "--data", str(td), "--out", str(tmp_path / "h.cmf"), "--quiet"])
    assert rc == 1 and "--teacher is needed" in capsys.readouterr().err
    rc = main(["heal", str(teacher), "--teacher", str(teacher), "--data", str(td), "--out", str(tmp_path / "h.cmf"),
               "--ce", "1.5", "--quiet"])
    assert rc == 1 and capsys.readouterr().err == "cortiq: heal settings: ce 1.5 is outside [0, 1]\n"
