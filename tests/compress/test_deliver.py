"""Putting a cached stage output at the user's path, again: a re-run over an existing output
leaves only the output (no `.partial` hard-linked to it and the cache entry)."""

import os

from cortiq.runner import deliver


def test_a_second_delivery_leaves_no_partial_link(tmp_path):
    entry = tmp_path / "cache" / "student.cmf"
    entry.parent.mkdir()
    entry.write_bytes(b"model")
    out = tmp_path / "cr.cmf"
    for _ in range(2):
        assert deliver({"path": str(entry)}, out) == out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "cr.cmf"]
    assert os.path.samefile(out, entry) and os.stat(entry).st_nlink == 2


def test_a_stale_output_is_replaced(tmp_path):
    entry = tmp_path / "new.cmf"
    entry.write_bytes(b"new")
    out = tmp_path / "cr.cmf"
    out.write_bytes(b"old")
    deliver({"path": str(entry)}, out)
    assert out.read_bytes() == b"new" and not (tmp_path / "cr.cmf.partial").exists()


def test_compress_run_twice_to_one_output(tmp_path, capsys):
    """The command line itself: the second run reuses every stage and leaves cr.cmf alone."""
    from tiny import llama_arch, write_corpus, write_random

    from cortiq.cli import main
    from cortiq.data.builder import build
    from cortiq.data.settings import BuildSettings

    model = write_random(tmp_path / "m.cmf", llama_arch(32, 64, 2), 0)
    corpus = write_corpus(tmp_path / "corpus.txt")
    build([str(corpus)], model, tmp_path / "td", BuildSettings(record_tokens=64, fractions=(0.6, 0.2, 0.2)))
    out = tmp_path / "cr.cmf"
    argv = ["compress", str(model), "--data", str(tmp_path / "td"), "--out", str(out), "--keep-frac", "0.5",
            "--masks-max-steps", "4", "--masks-window", "32", "--masks-batch", "2", "--masks-eval-every", "2",
            "--work", str(tmp_path / "work"), "--retain-sources", "none"]
    assert main(argv) == 0
    first = out.read_bytes()
    assert main(argv) == 0
    assert out.read_bytes() == first and not list(tmp_path.rglob("*.partial"))
