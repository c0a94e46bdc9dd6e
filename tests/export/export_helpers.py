"""Tiny CMF models of every family the exporters write (byte tokenizer, vocab 259)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import V, llama_arch, write_random  # noqa: E402,F401

from cortiq.arch import FULL, LINEAR, Arch  # noqa: E402
from cortiq.cmf import copy_specs, open_cmf, write_cmf  # noqa: E402


def arch_of(family: str, widths=(48, 48), mtp: int = 0) -> Arch:
    """A 2-layer model of `family`; `widths` per layer (unequal: a pruned model), `mtp` the draft's width (0: none)."""
    common = dict(vocab_size=V, hidden_size=32, num_layers=2, intermediate_sizes=list(widths), num_heads=4,
                  num_kv_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512, mtp_layers=1 if mtp else 0,
                  mtp_intermediate_size=mtp)
    if family == "llama":
        return Arch(arch_name="llama", head_dim=8, rope_theta=10000.0, tie_word_embeddings=True, **common)
    if family == "qwen2":
        return Arch(arch_name="qwen2", head_dim=8, attention_bias=True, rope_theta=1e6, **common)
    if family == "qwen3":
        return Arch(arch_name="qwen3", head_dim=16, qk_norm=True, rope_theta=1e6, tie_word_embeddings=True, **common)
    return Arch(arch_name=family, head_dim=16, partial_rotary_factor=0.25, qk_norm=True, attn_output_gate=True,
                norm_style="offset", layer_types=[LINEAR, FULL], linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, **common)


def recode(src_path: Path, out: Path, codec_for) -> Path:
    """`src_path` rewritten with `codec_for(name, info)` per tensor."""
    src = open_cmf(src_path)
    doc = {k: v for k, v in src.doc.items() if k not in ("codecs", "hashes", "shards")}
    return write_cmf(out, doc, copy_specs(src, codec_for))
