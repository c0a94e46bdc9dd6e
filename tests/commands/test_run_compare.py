"""`cortiq compare` on two MLflow runs; `cortiq run` refuses a bad parameter file before prefect starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.cli import main


def _run(client, exp, name, nll, keep):
    from mlflow.entities import Metric, Param

    r = client.create_run(exp, run_name=name, tags={"cortiq.params": name})
    client.log_batch(r.info.run_id, metrics=[Metric("score.healed.nll", nll, 0, 0), Metric("score.healed.bytes", 1e6, 0, 0)],
                     params=[Param("compress.keep_frac", str(keep)), Param("source", "smollm2")])
    client.set_terminated(r.info.run_id)
    return r.info.run_id


def test_compare_prints_runs_side_by_side_and_writes_a_plot(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("cortiq", artifact_location=(tmp_path / "art").as_uri())
    a = _run(c, exp, "half", 2.5, 0.5)
    b = _run(c, exp, "most", 2.25, 0.75)
    png = tmp_path / "cmp.png"
    assert main(["compare", a, b, "--tracking-uri", uri, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["compress.keep_frac"] == ["0.5", "0.75"]
    assert rows["score.healed.nll"] == ["2.5", "2.25"]
    assert "source" not in rows  # equal params are left out unless --all-params
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_unknown_run_is_one_line(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert main(["compare", "abc", "def", "--tracking-uri", uri, "--plot", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"cortiq: {uri}: no MLflow run abc"


def test_run_names_the_bad_key_before_anything_starts(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("heal:\n  lrr: 0.1\n")
    assert main(["run", "compress-and-heal", "--params", str(p)]) == 1
    assert capsys.readouterr().err.strip() == f"cortiq: {p}: unknown key heal.lrr (did you mean heal.lr?)"
