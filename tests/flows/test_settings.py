"""PipelineSettings from YAML: every key checked, a bad one named with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.errors import CortiqError
from cortiq.data.settings import BuildSettings
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
    assert s.data.sources == ["corpus:pydoc"]
    assert s.data.record_tokens == 128 and s.data.build_settings() == BuildSettings(record_tokens=128)
    assert s.compress.fold.keep_frac == s.compress.masks.keep_frac == 0.5
    assert s.heal.lr == 0.001
    assert load_settings(s) is s
    # what leaves the process (a flow's parameters) is a parameter file's mapping that loads back the same
    assert load_settings(s.to_dict()) == s and load_settings(s.to_dict()).to_dict() == s.to_dict()
    assert load_settings(PipelineSettings().to_dict()) == PipelineSettings()


@pytest.mark.parametrize("path", sorted((ROOT / "deployments" / "params").glob("*.yaml")))
def test_shipped_parameter_sets_load(path):
    assert isinstance(load_settings(path), PipelineSettings)
