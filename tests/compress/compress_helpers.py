"""A tiny random Llama-style CMF model (byte tokenizer) and tiny tdata for the compress tests."""

from __future__ import annotations

from pathlib import Path

import torch

from cortiq.arch import Arch
from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

V = 259


def tiny_arch(hidden=32, width=48, layers=2) -> Arch:
    return Arch(arch_name="llama", vocab_size=V, hidden_size=hidden, num_layers=layers, intermediate_sizes=[width] * layers,
                num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=512)


def tiny_cmf(path: Path, seed=0, **kw) -> Path:
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    arch = tiny_arch(**kw)
    model = CausalLM(arch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if "embed" not in n else 1.0))
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [256]))
    tensors = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return write_cmf(path, doc, specs_from_tensors(tensors, "f32"))


TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)


def tiny_tdata(model_cmf: Path, out: Path, n_docs=24) -> Path:
    from cortiq.data import BuildSettings, build

    src = out.parent / "corpus.txt"
    src.write_text("\n\n".join(f"{i}: " + TEXT * (1 + i % 3) for i in range(n_docs)))
    build([str(src)], model_cmf, out, BuildSettings(record_tokens=64, fractions=(0.6, 0.2, 0.2)))
    return out
