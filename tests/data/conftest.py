"""Fixtures of the data tests: a tiny CMF carrying the byte tokenizer (the --tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

from cortiq.arch import Arch
from cortiq.cmf import Spec, new_doc, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

EOS = 256  # <|endoftext|> in byte_tokenizer_json()
VOCAB = 259


def tiny_cmf(path: Path, vocab: int = VOCAB, chat_template: str | None = None, tok_json: str | None = None) -> Path:
    arch = Arch(arch_name="llama", vocab_size=vocab, hidden_size=8, num_layers=1, intermediate_sizes=[16],
                num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    tok = tokenizer_doc(tok_json or byte_tokenizer_json(), eos_ids=[EOS], chat_template=chat_template)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, 8, generator=g)
    return write_cmf(path, new_doc(arch, tok), [Spec("model.embed_tokens.weight", "f32", (vocab, 8), lambda: emb)])


import pytest  # noqa: E402


@pytest.fixture
def tok_cmf(tmp_path) -> Path:
    return tiny_cmf(tmp_path / "tok.cmf")


@pytest.fixture
def make_cmf(tmp_path):
    def make(name="m.cmf", **kw):
        return tiny_cmf(tmp_path / name, **kw)
    return make
