"""`cortiq heal` end to end on tiny models, and its one-line errors."""

import json

import pytest

from cortiq.cli import main
from cortiq.cmf import open_cmf

from heal_models import arch, healing_pair, random_weights, save, tdata


def test_cli_heals_and_reports(tmp_path, capsys):
    teacher, student, td = healing_pair(tmp_path)
    out = tmp_path / "h.cmf"
    rc = main(["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--out", str(out), "--window", "32",
               "--batch", "4", "--topk", "8", "--lr", "3e-3", "--ce", "0.25", "--train-from", "1", "--ffn-only",
               "--tokens", "1536", "--device", "cpu", "--retain-sources", "none", "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "NLL on the test split of the heal data" in text and "gap recovered" in text
    # no retain data and no --eval-data: the report says the other texts went unscored, last
    last = text.strip().splitlines()[-1]
    assert last.startswith("general panel: none (no retain source apart from your data's own corpus, no --eval-data)"), last
    prov = open_cmf(out).provenance["heal"]
    assert prov["ce"] == 0.25 and prov["settings"]["ffn_only"] and prov["prefix"] in ("f32", "f16")
    rep = json.loads((tmp_path / "h.cmf.report.json").read_text())
    assert rep["metrics"]["heldout_best"] <= rep["metrics"]["heldout_start"]
    # facts kept, named, in the printed report, the report file and the provenance
    from cortiq.facts import load_facts

    assert "facts kept (the fact probe's held part" in text
    assert set(rep["facts"]) == {"pruned", "healed"} and prov["facts"] == rep["facts"]
    assert rep["facts"]["healed"]["facts"] == len(load_facts("held"))
    assert rep["metrics"]["facts.healed.known"] == rep["facts"]["healed"]["known"]


def test_cli_with_retain_data_reports_the_data_and_the_general_panel_by_name(tmp_path, capsys):
    from cortiq.data import BuildSettings, build

    teacher, student, td = healing_pair(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i} + 1" for i in range(80)))
    retain = build([str(other)], teacher, tmp_path / "code.tdata", BuildSettings(record_tokens=64)).path
    out = tmp_path / "h.cmf"
    rc = main(["heal", str(student), "--teacher", str(teacher), "--data", str(td), "--out", str(out), "--window", "32",
               "--batch", "4", "--topk", "8", "--lr", "3e-3", "--tokens", "1536", "--eval-every", "4", "--device", "cpu",
               "--retain-sources", str(retain), "--retain-share", "0.5", "--work", str(tmp_path / "work"), "--quiet"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # the three measures, each named, last: the user's data, the general panel, the facts kept
    assert lines[-3].startswith("your data: gap recovered") and "excess NLL over the source" in lines[-3]
    assert lines[-2].startswith("general panel: ") and "code" in lines[-2] and "excess NLL over the source" in lines[-2]
    assert lines[-1].startswith("facts kept (the fact probe's held part, ")
    rep = json.loads((tmp_path / "h.cmf.report.json").read_text())
    panel = rep["texts"]["panel"]
    assert list(panel["parts"]) == ["code"]
    assert panel["excess"]["healed"] == panel["nll"]["healed"] - panel["nll"]["source"]
    assert all("heldout.code" in e and "heldout.data" in e for e in rep["evals"])
    assert open_cmf(out).provenance["heal"]["texts"]["panel"]["parts"]["code"]["nll"] == panel["parts"]["code"]["nll"]


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


@pytest.mark.parametrize("cmd", ["heal", "compress"])
@pytest.mark.parametrize("spelling", ["same", "dot", "slash", "symlink", "copy"])
def test_the_data_as_a_retain_source_is_refused(tmp_path, capsys, cmd, spelling):
    # its test split would be reported as a general panel of other text, never trained on
    import os
    import shutil

    a = arch()
    teacher = save(tmp_path / "t.cmf", a, random_weights(a))
    td = tdata(tmp_path, teacher, chars=2000)
    if spelling in ("symlink", "copy"):
        same = tmp_path / "again.tdata"
        os.symlink(td, same) if spelling == "symlink" else shutil.copytree(td, same)
    else:
        same = {"same": str(td), "dot": f"{td.parent}/./{td.name}", "slash": f"{td}/"}[spelling]
    head = ["heal", teacher, "--teacher", teacher] if cmd == "heal" else ["compress", teacher]
    argv = [*head, "--data", td, "--out", tmp_path / "o.cmf", "--retain-sources", same]
    capsys.readouterr()
    assert main([str(x) for x in argv]) == 1
    assert capsys.readouterr().err == (f"cortiq: retain source {same}: it is the data {td} itself, whose test split "
                                       "would be reported as a general panel never trained on; give a retain source "
                                       "of other text\n")
    assert not (tmp_path / "o.cmf").exists() and not (tmp_path / "cortiq-home" / "work").exists()
