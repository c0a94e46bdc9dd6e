"""Fixtures of the data tests."""

from pathlib import Path

import pytest

from data_helpers import tiny_cmf


@pytest.fixture
def tok_cmf(tmp_path) -> Path:
    return tiny_cmf(tmp_path / "tok.cmf")


@pytest.fixture
def make_cmf(tmp_path):
    def make(name="m.cmf", **kw):
        return tiny_cmf(tmp_path / name, **kw)
    return make
