"""Tiny random models and text the tests share (byte tokenizer: vocab 259, EOS 256)."""

from __future__ import annotations

from pathlib import Path

import torch

from cortiq.arch import Arch
from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

V, EOS = 259, 256

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. ")


def llama_arch(hidden: int = 32, width: int = 48, layers: int = 2) -> Arch:
    return Arch(arch_name="llama", vocab_size=V, hidden_size=hidden, num_layers=layers, intermediate_sizes=[width] * layers,
                num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=512)


def write_random(path: Path, arch: Arch, seed: int = 0) -> Path:
    """A CMF file of `arch` with random weights that keep activations O(1):
    norms 1 ± 0.2, matrices N(0, 0.25/fan_in), embeddings N(0, 1)."""
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    model = CausalLM(arch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if "embed" not in n else 1.0))
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [EOS]))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in model.named_parameters()], "f32"))


def write_corpus(path: Path, n_docs: int = 24) -> Path:
    path.write_text("\n\n".join(f"{i}: " + TEXT * (1 + i % 3) for i in range(n_docs)))
    return path
