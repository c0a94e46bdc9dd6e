"""The Hugging Face converter: names, layouts, shards, tokenizer, clear errors."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cortiq.cmf import open_cmf
from cortiq.convert.hf import _split_ba, _split_qkvz, convert_hf_dir
from cortiq.errors import CortiqError
from cortiq.model import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import save_hf, tiny_llama, tiny_qwen3_next  # noqa: E402


def test_tokenizer_and_provenance(tmp_path):
    out = convert_hf_dir(save_hf(tiny_llama(), tmp_path / "hf"), tmp_path / "m.cmf")
    f = open_cmf(out)
    assert f.tokenizer["eos_ids"] == [256]
    assert f.tokenizer["chat_template"] == "{{ x }}"
    assert f.provenance["convert"]["format"] == "hf"
    assert f.info("model.embed_tokens.weight").codec == "f32"


def test_missing_tokenizer_names_the_directory(tmp_path):
    src = save_hf(tiny_llama(), tmp_path / "hf")
    (src / "tokenizer.json").unlink()
    with pytest.raises(CortiqError, match=f"^{src}: no tokenizer.json"):
        convert_hf_dir(src, tmp_path / "m.cmf")
    assert not (tmp_path / "m.cmf").exists() and not (tmp_path / "m.cmf.partial").exists()


def test_sharded_checkpoint_and_codec(tmp_path):
    hf = tiny_llama()
    src = tmp_path / "hf"
    src.mkdir()
    hf.save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    shutil.copy(save_hf(tiny_llama(), tmp_path / "one") / "tokenizer.json", src)
    out = convert_hf_dir(src, tmp_path / "m.cmf", codec="bf16")
    f = open_cmf(out)
    assert {f.info(n).codec for n in f.names} == {"bf16"}
    ids = torch.randint(0, 259, (1, 11))
    with torch.no_grad():
        ref = hf(ids).logits
        got = load_model(out)(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 2e-2


def test_moe_is_not_supported(tmp_path):
    from transformers import Qwen3NextConfig

    src = save_hf(tiny_qwen3_next(), tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["mlp_only_layers"] = []
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CortiqError, match="mixture-of-experts MLPs .* not supported"):
        convert_hf_dir(src, tmp_path / "m.cmf")
    del Qwen3NextConfig


def test_qkvz_split_is_transformers_ordering():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf = tiny_qwen3_next()
    arch_like = type("A", (), dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12))
    layer = next(m for m in hf.modules() if isinstance(m, Qwen3NextGatedDeltaNet))
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        qkv_w, z_w = _split_qkvz(arch_like, layer.in_proj_qkvz.weight)
        b_w, a_w = _split_ba(arch_like, layer.in_proj_ba.weight)
        want_qkv = torch.cat([q.reshape(1, 3, -1), k.reshape(1, 3, -1), v.reshape(1, 3, -1)], -1)
        assert torch.allclose(x @ qkv_w.T, want_qkv, atol=1e-6)
        assert torch.allclose(x @ z_w.T, z.reshape(1, 3, -1), atol=1e-6)
        assert torch.allclose(x @ b_w.T, b, atol=1e-6)
        assert torch.allclose(x @ a_w.T, a, atol=1e-6)


def test_qwen35_prefixes_vision_and_mtp_names(tmp_path):
    # a Qwen3.5-style checkpoint: language_model prefix, vision tensors, split GDN, HF mtp.* names
    from safetensors.torch import load_file, save_file

    hf = tiny_qwen3_next(layers=2)
    src = save_hf(hf, tmp_path / "hf")
    sd = load_file(src / "model.safetensors")
    out = {}
    for n, t in sd.items():
        if n.endswith("in_proj_qkvz.weight") or n.endswith("in_proj_ba.weight"):
            continue
        out[n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n] = t
    arch_like = type("A", (), dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12))
    base = "model.layers.0.linear_attn."
    out["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"], out["model.language_model.layers.0.linear_attn.in_proj_z.weight"] = _split_qkvz(arch_like, sd[base + "in_proj_qkvz.weight"])
    out["model.language_model.layers.0.linear_attn.in_proj_b.weight"], out["model.language_model.layers.0.linear_attn.in_proj_a.weight"] = _split_ba(arch_like, sd[base + "in_proj_ba.weight"])
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    H = 32
    mtp = {"mtp.fc.weight": torch.randn(H, 2 * H), "mtp.pre_fc_norm_embedding.weight": torch.randn(H),
           "mtp.pre_fc_norm_hidden.weight": torch.randn(H), "mtp.norm.weight": torch.randn(H)}
    for n, t in sd.items():
        if n.startswith("model.layers.1."):  # layer 1 is full attention: the MTP layer's shape
            mtp["mtp.layers.0." + n[len("model.layers.1."):]] = t.clone()
    out.update(mtp)
    (src / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in out.items()}, src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    text.update(model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"], mtp_num_hidden_layers=1)
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}))
    f = open_cmf(convert_hf_dir(src, tmp_path / "m.cmf"))
    assert f.arch.arch_name == "qwen3_5" and f.arch.mtp_layers == 1
    assert not any("visual" in n or "language_model" in n for n in f.names)
    assert torch.equal(f.tensor("model.mtp.eh_proj.weight"), mtp["mtp.fc.weight"])
    assert torch.equal(f.tensor("model.mtp.enorm.weight"), mtp["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(f.tensor("model.mtp.hnorm.weight"), mtp["mtp.pre_fc_norm_hidden.weight"])
    m = load_model(f)
    ids = torch.randint(0, 259, (1, 13))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (m(ids) - ref).abs().max() / ref.abs().max() < 1e-4
        h, _ = m.forward_hidden(ids)
        assert m.mtp_forward(h[:, :-1], ids[:, 1:]).shape == (1, 12, H)
