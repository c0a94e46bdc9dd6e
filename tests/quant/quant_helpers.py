"""A tiny model whose every linear input is a whole number of q4 blocks, and tdata for it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compress"))

from compress_helpers import tiny_cmf, tiny_tdata  # noqa: E402,F401


def model_and_data(tmp_path: Path, seed: int = 0):
    m = tiny_cmf(tmp_path / "m.cmf", seed=seed, hidden=64, width=64, layers=2)
    return m, tiny_tdata(m, tmp_path / "td")
