"""Helpers of the data tests: a tiny CMF carrying the byte tokenizer (the --tokenizer), a tiny real model."""

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



def tiny_model_cmf(path: Path, seed: int = 0, chat_template: str | None = None) -> Path:
    """A tiny random Llama-style model that load_model builds (for --generate-with)."""
    from cortiq.cmf import specs_from_tensors
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    arch = Arch(arch_name="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, intermediate_sizes=[48, 48],
                num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)
    model = CausalLM(arch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) * (0.5 if "embed" in n else 0.2))
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), eos_ids=[EOS], chat_template=chat_template))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in model.named_parameters()], "f32"))
