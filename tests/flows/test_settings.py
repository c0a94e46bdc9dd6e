"""PipelineSettings from YAML: every key checked, a bad one named with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.errors import CortiqError
from cortiq.settings import PipelineSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("yaml_text, message", [
    ("heal:\n  lrr: 0.1\n", "unknown key heal.lrr (did you mean heal.lr?)"),
    ("compress:\n  masks:\n    keep_fra: 0.5\n", "unknown key compress.masks.keep_fra (did you mean compress.keep_frac?)"),
    # one share of neurons: the groups' own keep_frac is set by compress.keep_frac
    ("compress:\n  fold:\n    keep_frac: 0.5\n", "compress.fold.keep_frac is not set on its own: write compress.keep_frac"),
    ("compress:\n  keep_frac: 0.5\n  masks: {keep_frac: 0.5}\n", "compress.masks.keep_frac is not set on its own"),
    ("sorce: x.cmf\n", "unknown key sorce (did you mean source?)"),
    ("run:\n  retrys: 2\n", "unknown key run.retrys (did you mean run.retries?)"),
    ("run:\n  retries: -1\n", "run.retries -1 must be >= 0"),
    ("codecs: [q8, q3]\n", "q3"),
    ("data:\n  sources: []\n", "data.sources must be a non-empty list"),
    ("heal: 3\n", "heal must be a mapping"),
    ("- a\n- b\n", "a parameter set must be a mapping of groups"),
    ("heal: [\n", "not YAML"),
])
def test_bad_parameter_files_name_the_file_and_the_key(tmp_path, yaml_text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    with pytest.raises(CortiqError) as e:
        load_settings(p)
    assert str(e.value).startswith(f"{p}: ")
    assert message in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CortiqError, match="no such parameter file"):
        load_settings(tmp_path / "nope.yaml")


def test_stage_groups_become_the_stages_dataclasses(tmp_path):
    p = tmp_path / "set.yaml"
    p.write_text("source: m.cmf\ndata:\n  sources: [corpus:pydoc]\n  record_tokens: 128\n"
                 "compress:\n  keep_frac: 0.5\nheal:\n  lr: 0.001\n")
    s = load_settings(p)
    assert s.name == "set"  # the file's stem
    assert s.extra("data", "sources") == ["corpus:pydoc"]
    assert s.stage("data").record_tokens == 128
    assert s.stage("compress").fold.keep_frac == s.stage("compress").masks.keep_frac == 0.5
    assert s.stage("heal").lr == 0.001
    assert load_settings(s) is s
    assert load_settings(s.to_dict()).to_dict() == s.to_dict()


@pytest.mark.parametrize("path", sorted((ROOT / "deployments" / "params").glob("*.yaml")))
def test_shipped_parameter_sets_load(path):
    assert isinstance(load_settings(path), PipelineSettings)
