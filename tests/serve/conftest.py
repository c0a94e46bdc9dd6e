"""The served model the server tests share (a fixture); the helpers live in serve_helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serve_helpers import write_model  # noqa: E402


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("serve") / "tiny.cmf")
