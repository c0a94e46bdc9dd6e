"""Tiny CMF models and a tdata directory for the heal stage tests."""

from __future__ import annotations

from pathlib import Path

import torch

from cortiq.arch import Arch
from cortiq.cmf import Spec, new_doc, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

EOS = 256
VOCAB = 259


def arch(layers=2, vocab=VOCAB):
    return Arch(arch_name="llama", vocab_size=vocab, hidden_size=32, num_layers=layers, intermediate_sizes=[48] * layers,
                num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, max_position_embeddings=512)


def random_weights(a: Arch, seed=0) -> dict[str, torch.Tensor]:
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    model = CausalLM(a)
    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            out[n] = (1.0 + 0.1 * torch.randn_like(p)) if p.dim() == 1 else torch.randn_like(p) * (0.6 if "embed" in n else 0.25)
    return out


def save(path: Path, a: Arch, weights: dict, codecs: dict | None = None, tok_json: str | None = None) -> Path:
    doc = new_doc(a, tokenizer_doc(tok_json or byte_tokenizer_json(), eos_ids=[EOS]))
    codecs = codecs or {}
    specs = [Spec(n, codecs.get(n, "f32"), tuple(t.shape), lambda t=t: t) for n, t in weights.items()]
    return write_cmf(path, doc, specs)


def perturbed(weights: dict, seed=1, scale=0.6) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for n, t in weights.items():
        if ".mlp." in n:
            out[n] = t + scale * t.std() * torch.randn(t.shape, generator=g)
    return out


def text_file(path: Path, chars=7000) -> Path:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[:chars]
    path.write_text(text)
    return path


def tdata(tmp: Path, tok_cmf: Path, fractions=(0.7, 0.15, 0.15), chars=7000) -> Path:
    from cortiq.data import BuildSettings, build

    src = text_file(tmp / "corpus.txt", chars)
    out = tmp / "tdata"
    build([str(src)], tok_cmf, out, BuildSettings(record_tokens=64, fractions=fractions))
    return out


def healing_pair(tmp: Path, chars=4000) -> tuple[Path, Path, Path]:
    """(teacher, student, heal tdata) in `tmp`: a tiny model, its MLPs perturbed, a small text."""
    a = arch()
    w = random_weights(a)
    teacher = save(tmp / "t.cmf", a, w)
    return teacher, save(tmp / "s.cmf", a, perturbed(w)), tdata(tmp, teacher, chars=chars)
