"""CMF → Hugging Face: transformers loads the export with cortiq's logits, the
tokenizer files work, unequal widths are padded with zero neurons and trimmed
again, convert(export(x)) is x, shards, dtypes and the refusals."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_helpers import V, arch_of, recode, write_random  # noqa: E402

from cortiq.cli import main  # noqa: E402
from cortiq.cmf import copy_specs, open_cmf, write_cmf  # noqa: E402
from cortiq.convert.hf import convert_hf_dir  # noqa: E402
from cortiq.errors import CortiqError  # noqa: E402
from cortiq.export.hf import export_hf  # noqa: E402
from cortiq.model import load_model  # noqa: E402
from cortiq.tokenizer import load_tokenizer  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_next", "qwen3_5"]
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}


def _load_hf(path):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _hf_tensors(d: Path) -> dict:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _same_logits(cmf_path, hf_dir, n=19):
    model = load_model(cmf_path)
    hf, info = _load_hf(hf_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        got = hf(ids).logits
    assert got.shape == ref.shape
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err
    return hf


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_export_with_equal_logits(tmp_path, family):
    src = write_random(tmp_path / "m.cmf", arch_of(family, mtp=48), seed=3)
    out = export_hf(src, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [CLASSES[family]]
    assert "cortiq_intermediate_sizes" not in cfg  # equal widths: nothing padded
    hf = _same_logits(src, out)
    assert type(hf).__name__ == CLASSES[family]
    names = set(_hf_tensors(out))
    # the draft under the Qwen3-Next / Qwen3.5 checkpoint names: in the checkpoint for those families, in a
    # file of its own for the others (transformers would list it as unexpected, vLLM would refuse it)
    draft = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
             "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"}
    if family in ("qwen3_next", "qwen3_5"):
        assert draft <= names and not (out / "mtp").exists()
    else:
        assert not any(n.startswith("mtp.") for n in names) and draft <= set(_hf_tensors(out / "mtp"))
    assert cfg["mtp_num_hidden_layers"] == 1
    if family == "qwen3_next":  # the fused GDN projections transformers' Qwen3-Next has
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names and "model.layers.0.linear_attn.in_proj_ba.weight" in names
        assert "model.layers.0.linear_attn.in_proj_z.weight" not in names


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_pruned_unequal_widths_are_padded_with_zero_neurons_and_round_trip(tmp_path, family):
    mtp = 36 if family == "qwen3_5" else 0
    src = write_random(tmp_path / "m.cmf", arch_of(family, widths=(48, 24), mtp=mtp), seed=4)
    out = export_hf(src, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["intermediate_size"] == 48 and cfg["cortiq_intermediate_sizes"] == [48, 24]
    assert cfg.get("cortiq_mtp_intermediate_size", 0) == mtp
    w = _hf_tensors(out)
    f = open_cmf(src)
    gate = w["model.layers.1.mlp.gate_proj.weight"]
    down = w["model.layers.1.mlp.down_proj.weight"]
    assert gate.shape == (48, 32) and down.shape == (32, 48)
    assert torch.equal(gate[:24], f.tensor("model.layers.1.mlp.gate_proj.weight")) and not gate[24:].any()
    assert torch.equal(down[:, :24], f.tensor("model.layers.1.mlp.down_proj.weight")) and not down[:, 24:].any()
    assert not w["model.layers.1.mlp.up_proj.weight"][24:].any()
    _same_logits(src, out)
    back = open_cmf(convert_hf_dir(out, tmp_path / "back.cmf"))
    assert back.arch.intermediate_sizes == [48, 24]
    assert back.arch.to_dict() == f.arch.to_dict()
    assert set(back.names) == set(f.names)
    for n in f.names:
        assert torch.equal(back.tensor(n), f.tensor(n)), n


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_of_export_is_the_model(tmp_path, family):
    src = write_random(tmp_path / "m.cmf", arch_of(family, mtp=40), seed=5)
    back = open_cmf(convert_hf_dir(export_hf(src, tmp_path / "hf"), tmp_path / "back.cmf"))
    f = open_cmf(src)
    assert back.arch.to_dict() == f.arch.to_dict()
    assert set(back.names) == set(f.names)
    for n in f.names:
        assert torch.equal(back.tensor(n), f.tensor(n)), n
    assert back.tokenizer["json"] == f.tokenizer["json"] and back.tokenizer["eos_ids"] == f.tokenizer["eos_ids"]


def test_padding_that_is_not_zero_is_refused_by_convert(tmp_path):
    from safetensors.torch import save_file

    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(48, 24)), seed=4)
    out = export_hf(src, tmp_path / "hf")
    w = _hf_tensors(out)
    w["model.layers.1.mlp.up_proj.weight"][30, 3] = 0.5  # a "padding" neuron that learnt something
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CortiqError, match="model.layers.1.mlp.up_proj.weight has non-zero neurons past the width 24"):
        convert_hf_dir(out, tmp_path / "back.cmf")
    assert not (tmp_path / "back.cmf").exists() and not (tmp_path / "back.cmf.partial").exists()


def test_shards_with_an_index_and_quantized_tensors_dequantized_to_the_dtype(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("qwen3", mtp=0), seed=6)
    q8 = recode(src, tmp_path / "q8.cmf", lambda n, i: "q8" if len(i.shape) == 2 else i.codec)
    out = export_hf(q8, tmp_path / "hf", dtype="bf16", shard_bytes=12_000, quantized="none")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({v for v in index["weight_map"].values()})
    assert len(files) > 2 and files == sorted(p.name for p in out.glob("*.safetensors"))
    w = _hf_tensors(out)
    f = open_cmf(q8)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in w.values())
    assert set(index["weight_map"]) == set(w) == set(f.names)
    for n in f.names:
        assert w[n].dtype == torch.bfloat16
        assert torch.equal(w[n], f.tensor(n).to(torch.bfloat16)), n
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf, _ = _load_hf(out)
    assert hf.model.embed_tokens.weight.shape == (V, 32)
    back = open_cmf(convert_hf_dir(out, tmp_path / "back.cmf"))  # reads the index
    assert torch.equal(back.tensor("model.layers.1.mlp.down_proj.weight"), w["model.layers.1.mlp.down_proj.weight"].float())


def test_tokenizer_files_load_in_transformers(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    src = write_random(tmp_path / "m.cmf", arch_of("llama"), seed=7)
    f = open_cmf(src)
    doc = dict(f.doc)
    tmpl = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    doc["tokenizer"] = {**f.tokenizer, "chat_template": tmpl, "bos_id": 257, "eos_ids": [256, 258]}
    write_cmf(tmp_path / "t2.cmf", {k: v for k, v in doc.items() if k not in ("codecs", "hashes", "shards")},
              copy_specs(f))
    out = export_hf(tmp_path / "t2.cmf", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    text = "Sphinx of black quartz, judge my vow. <|im_end|> ünïcödé"
    assert tok(text)["input_ids"] == load_tokenizer(src).encode(text).ids
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|im_start|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [256, 258] and gen.bos_token_id == 257


def test_refusals_are_one_line(tmp_path, capsys):
    src = write_random(tmp_path / "m.cmf", arch_of("llama"), seed=8)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    assert main(["export", str(src), "--to", "hf", str(busy)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"cortiq: {busy} exists (a directory that is not empty); pass --force to overwrite"
    assert (busy / "x").read_text() == "keep me" and not (tmp_path / "busy.partial").exists()
    assert main(["export", str(src), "--to", "onnx", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.strip() == "cortiq: --to onnx: the format is hf or gguf"
    assert main(["export", str(tmp_path / "nope.cmf"), "--to", "hf", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.strip() == f"cortiq: {tmp_path / 'nope.cmf'}: no such file"
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is fine
    assert main(["export", str(src), "--to", "hf", str(empty)]) == 0
    assert (empty / "model.safetensors").exists() and not (tmp_path / "empty.partial").exists()
