"""A tiny random Llama-style CMF model (byte tokenizer) and tiny tdata for the compress tests."""

from __future__ import annotations

from pathlib import Path

from tiny import TEXT, V, llama_arch as tiny_arch, write_corpus, write_random  # noqa: F401


def tiny_cmf(path: Path, seed=0, **kw) -> Path:
    return write_random(path, tiny_arch(**kw), seed)


def tiny_tdata(model_cmf: Path, out: Path, n_docs=24) -> Path:
    from cortiq.data import BuildSettings, build

    src = write_corpus(out.parent / "corpus.txt", n_docs)
    build([str(src)], model_cmf, out, BuildSettings(record_tokens=64, fractions=(0.6, 0.2, 0.2)))
    return out
