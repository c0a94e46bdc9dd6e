"""PipelineSettings from YAML: every key checked, a bad one named with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.errors import CortiqError
from cortiq.settings import PipelineSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_missing_file(tmp_path):
    with pytest.raises(CortiqError, match="no such file"):
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
