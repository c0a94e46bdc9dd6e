"""Tiny Hugging Face models built in code (no hub), saved with a byte tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cortiq.tokenizer import byte_tokenizer_json

V = 259  # 256 bytes + 3 specials


def save_hf(model, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(byte_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": "{{ x }}"}))
    return out


def tiny_llama(tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=tie, eos_token_id=256, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                      eos_token_id=256)
    return Qwen3ForCausalLM(cfg).eval()


def _perturb_norms(model):
    # HF initialises RMSNorm weights to 1 (or 0 for offset style): random ones test the style
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)


def tiny_qwen3_next(seed=0, layers=4):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                          linear_conv_kernel_dim=4, full_attention_interval=2, mlp_only_layers=list(range(layers)),
                          num_experts=4, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=256)
    return Qwen3NextForCausalLM(cfg).eval()
