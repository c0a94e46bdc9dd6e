"""cortiq.chains: what a parameter set's chain checks before its first long stage."""

import pytest

from tiny import llama_arch, write_corpus, write_random

from cortiq.chains import student
from cortiq.errors import CortiqError
from cortiq.runner import LocalRunner
from cortiq.settings import load_settings


def test_calibration_windows_past_the_context_stop_the_chain_before_compress(tmp_path):
    src = write_random(tmp_path / "m.cmf", llama_arch())  # a context of 512 tokens
    params = {"name": "t", "source": str(src),
              "data": {"sources": [str(write_corpus(tmp_path / "c.txt"))], "record_tokens": 64,
                       "fractions": [0.6, 0.2, 0.2]},
              "retain": {"sources": []}, "quant": {"window": 1024}}
    runner = LocalRunner(tmp_path / "work", progress=False)
    with pytest.raises(CortiqError) as e:
        student(runner, load_settings(params))
    assert str(e.value) == f"{src}: quant.window 1024 is past the model's context of 512 tokens (max_position_embeddings)"
    assert list(runner.results) == ["data"]  # nothing past the data was run
