"""cortiq.measure's score chain: each model read once for all of its texts, with the NLLs of reading it for each."""

import sys
from pathlib import Path

import pytest

import cortiq.model
from cortiq.measure import ScoreSettings, Text, reading_once, score, score_chain
from cortiq.runner import LocalRunner

sys.path.insert(0, str(Path(__file__).parent / "heal"))
from heal_models import healing_pair  # noqa: E402


@pytest.fixture
def counted_reads(monkeypatch):
    reads, real = [], cortiq.model.load_model

    def counting(path, *a, **k):
        reads.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(cortiq.model, "load_model", counting)
    return reads


def test_a_chain_reads_each_model_once_and_scores_as_separate_reads(tmp_path, counted_reads):
    teacher, student, td = healing_pair(tmp_path)
    texts = [Text(split, str(td), ScoreSettings(split=split, device="cpu"), split) for split in ("test", "val", "all")]
    runner = LocalRunner(tmp_path / "work", progress=False)
    score_chain(runner, {"source": teacher, "pruned": student}, texts)
    assert counted_reads == ["t.cmf", "s.cmf"]
    for t in texts:  # each text's NLL is what one read of each model for that text alone gives
        alone = score({"source": teacher, "pruned": student}, td, None if t.settings.split == "all" else t.settings.split,
                      device="cpu", progress=False)
        got = {label: runner.results[f"{t.at}{label}"]["report"]["metrics"]["nll"] for label in alone}
        assert got == pytest.approx(alone, rel=1e-6)
        assert alone["source"] != alone["pruned"]


def test_a_file_written_again_is_read_again(tmp_path, counted_reads):
    teacher, student, td = healing_pair(tmp_path)
    with reading_once():
        first = score({"m": student}, td, "test", device="cpu", progress=False)["m"]
        assert score({"m": student}, td, "val", device="cpu", progress=False) and counted_reads == ["s.cmf"]
        student.write_bytes(teacher.read_bytes())  # another model at the same path
        again = score({"m": student}, td, "test", device="cpu", progress=False)["m"]
    assert counted_reads == ["s.cmf", "s.cmf"]
    assert again == pytest.approx(score({"m": teacher}, td, "test", device="cpu", progress=False)["m"]) != first
    score({"m": student}, td, "test", device="cpu", progress=False)  # outside it: every call reads
    assert counted_reads == ["s.cmf", "s.cmf", "t.cmf", "s.cmf"]
