"""CMF → GGUF: the `gguf` package's reader reads the export, cortiq's GGUF
reader reads it back to identical tensors and logits, q8 / q4 blocks are the
CMF's bytes (Q4_1: the same scales, mins and codes), the tokenizer travels,
and what llama.cpp cannot run is refused."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_helpers import V, arch_of, recode, write_random  # noqa: E402

from cortiq import codecs  # noqa: E402
from cortiq.cli import main  # noqa: E402
from cortiq.errors import CortiqError  # noqa: E402
from cortiq.cmf import open_cmf  # noqa: E402
from cortiq.convert.gguf import _permute, convert_gguf  # noqa: E402
from cortiq.export.gguf import export_gguf, q4_to_q4_1  # noqa: E402
from cortiq.model import load_model  # noqa: E402
from cortiq.tokenizer import load_tokenizer  # noqa: E402

TEXT = "The quick brown fox, 1234 jumps; <|im_start|>über den Zaun<|im_end|>\n  done."


def _mixed(tmp_path, family="llama", widths=(64, 96), seed=0):
    """A model whose matrices are in every codec: q8, q4, f16, bf16, fp8, q4_64, f32."""
    a = arch_of(family, widths=widths)
    a.hidden_size, a.head_dim = 64, 16
    src = write_random(tmp_path / "f32.cmf", a, seed=seed)
    order = ["q8", "q4", "f16", "bf16", "fp8", "q4_64", "f32"]
    names = [n for n in open_cmf(src).names if n.endswith("weight") and "norm" not in n]
    pick = {n: order[k % len(order)] for k, n in enumerate(names)}
    pick["model.layers.0.mlp.down_proj.weight"] = "q4"
    pick["model.layers.1.self_attn.q_proj.weight"] = "q8"
    pick["model.layers.1.self_attn.k_proj.weight"] = "q4"
    return recode(src, tmp_path / "mixed.cmf", lambda n, i: pick.get(n, i.codec) if len(i.shape) == 2 else i.codec)


def _logits(path):
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return load_model(path)(ids)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_read_back_to_identical_tensors_and_logits(tmp_path, family):
    # widths per layer for a Llama (llama.cpp's deci), one width for Qwen (llama.cpp builds its layers at one)
    cmf_path = _mixed(tmp_path, family, widths=(64, 96) if family == "llama" else (96, 96))
    f = open_cmf(cmf_path)
    assert {f.info(n).codec for n in f.names} >= {"q8", "q4", "f16", "bf16", "fp8", "q4_64", "f32"}
    out, left = export_gguf(cmf_path, tmp_path / "m.gguf")
    assert left == [] and not (tmp_path / "m.gguf.partial").exists()
    back = open_cmf(convert_gguf(out, tmp_path / "back.cmf", codec="f32"))
    assert back.arch.to_dict() == f.arch.to_dict()
    assert set(back.names) == set(f.names)
    for n in f.names:
        assert torch.equal(back.tensor(n), f.tensor(n)), n
    assert torch.equal(_logits(back.path), _logits(cmf_path))
    text_ids = load_tokenizer(cmf_path).encode(TEXT).ids
    assert load_tokenizer(back.path).encode(TEXT).ids == text_ids


def _gptq_made(tmp_path, codec):
    """A model quantized by GPTQ (AWQ's scales included) from calibration windows, the way `cortiq recode --data` does."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compress"))
    from compress_helpers import tiny_tdata

    from cortiq.quant import QuantSettings, requantize

    a = arch_of("llama", widths=(64, 96))
    a.hidden_size, a.head_dim = 64, 16
    src = write_random(tmp_path / "f32.cmf", a, seed=1)
    td = tiny_tdata(src, tmp_path / "td")
    s = QuantSettings(method="awq", method_8bit="awq", window=64, max_windows=8, device="cpu", awq_grid=3)
    r = requantize(src, td, codec, s, tmp_path / "work", progress=False, log=lambda m: None)
    assert r["quantize"]["report"]["method"] == "awq"
    return Path(r["path"])


@pytest.mark.parametrize("made", ["mixed", "gptq-q4", "gptq-q8"])
def test_quantized_blocks_are_the_cmf_bytes(tmp_path, made):
    cmf_path = _mixed(tmp_path) if made == "mixed" else _gptq_made(tmp_path, made.split("-")[1])
    f = open_cmf(cmf_path)
    if made != "mixed":
        assert "quantize" in f.provenance
    out, _ = export_gguf(cmf_path, tmp_path / "m.gguf")
    r = GGUFReader(out)
    assert r.fields["general.quantization_version"].contents() == 2
    by = {t.name: t for t in r.tensors}
    checked = {"q8": 0, "q4": 0}
    for n in f.names:
        info = f.info(n)
        if info.codec not in checked:
            continue
        g = by[n.replace("model.layers.", "blk.").replace(".self_attn.q_proj", ".attn_q").replace(".self_attn.k_proj", ".attn_k")
               .replace(".self_attn.v_proj", ".attn_v").replace(".self_attn.o_proj", ".attn_output").replace(".mlp.gate_proj", ".ffn_gate")
               .replace(".mlp.up_proj", ".ffn_up").replace(".mlp.down_proj", ".ffn_down").replace("model.embed_tokens", "token_embd")
               .replace("lm_head", "output")]
        rows, cols = info.shape
        width = 34 if info.codec == "q8" else 20
        assert g.tensor_type == (GGMLQuantizationType.Q8_0 if info.codec == "q8" else GGMLQuantizationType.Q4_1)
        cmf_blocks = np.asarray(f.raw(n)).reshape(rows, cols // 32, width)
        got = np.asarray(g.data).reshape(rows, cols // 32, width)
        heads = {"attn_q": 4, "attn_k": 2}.get(g.name.split(".")[-2])
        if heads:  # llama.cpp's row order: whole rows, so whole blocks, move
            cmf_blocks = _permute(cmf_blocks, heads)
        if info.codec == "q8":
            assert got.tobytes() == cmf_blocks.tobytes(), n
        else:
            # scale and min bytes as they are; the same 4-bit codes, each in GGUF's nibble slot
            assert got[..., :4].tobytes() == cmf_blocks[..., :4].tobytes(), n
            ours = np.stack([cmf_blocks[..., 4:] & 15, cmf_blocks[..., 4:] >> 4], -1).reshape(rows, cols // 32, 32)
            theirs = np.concatenate([got[..., 4:] & 15, got[..., 4:] >> 4], -1)
            assert np.array_equal(ours, theirs), n
        # and the gguf package decodes them to cortiq's values, bit for bit
        want = f.tensor(n).numpy()
        if heads:
            want = _permute(want, heads)
        assert np.array_equal(dequantize(g.data, g.tensor_type).reshape(rows, cols), want), n
        checked[info.codec] += 1
    if made == "mixed":
        assert checked["q8"] >= 2 and checked["q4"] >= 2
    elif made == "gptq-q8":  # every linear weight of both layers, and the embedding
        assert checked["q8"] == 2 * 7 + 1
    else:  # a 4-bit file keeps its (tied) embedding at q8 (cortiq.codecs.KEEP_8BIT), and GPTQ/AWQ the down_proj of
        # the layers QuantSettings.down_8bit names (of two layers, "ends": layer 0), each Q8_0 with cortiq's bytes
        from cortiq.quant import QuantSettings
        from cortiq.quant.layers import more_bits

        n8 = len(more_bits(2, QuantSettings().down_8bit))
        assert n8 == 1 and checked == {"q4": 2 * 7 - n8, "q8": 1 + n8}


def test_q4_repack_matches_ggufs_own_q4_1_layout():
    # gguf's Q4_1 quantizer and cortiq's q4 pick the same codes for values on an exact grid:
    # the repacked cortiq bytes must be the gguf bytes
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 32), generator=g).float()
    codes[:, 0], codes[:, 1] = 0, 15  # every block spans the full range
    x = (codes * 0.5 - 3.0).numpy().astype(np.float32)  # scale 0.5, min -3: exact in f16
    ours = codecs.get("q4").encode(torch.from_numpy(x)).numpy()
    theirs = quantize(x, GGMLQuantizationType.Q4_1).reshape(-1, 20)
    assert np.array_equal(q4_to_q4_1(ours), theirs)


def test_gguf_reader_sees_llama_cpp_metadata(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("qwen3", widths=(64, 64)), seed=1)
    out, _ = export_gguf(src, tmp_path / "m.gguf", name="tiny")
    r = GGUFReader(out)

    def meta(k):
        return r.fields[k].contents()

    assert meta("general.architecture") == "qwen3" and meta("general.name") == "tiny"
    assert meta("qwen3.block_count") == 2 and meta("qwen3.embedding_length") == 32
    assert meta("qwen3.feed_forward_length") == 64
    assert meta("qwen3.attention.head_count") == 4 and meta("qwen3.attention.head_count_kv") == 2
    assert meta("qwen3.attention.key_length") == 16 and meta("qwen3.rope.freq_base") == 1e6
    assert meta("tokenizer.ggml.model") == "gpt2" and len(meta("tokenizer.ggml.tokens")) == V
    assert meta("tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's name; it refuses to load "gpt2"
    assert meta("tokenizer.ggml.eos_token_id") == 256 and meta("general.file_type") == 0  # all F32
    assert "general.quantization_version" not in r.fields
    names = {t.name for t in r.tensors}
    assert {"token_embd.weight", "output_norm.weight", "blk.1.attn_q_norm.weight", "blk.1.ffn_down.weight"} <= names
    assert "output.weight" not in names  # tied head
    back = open_cmf(convert_gguf(out, tmp_path / "back.cmf"))
    assert back.arch.intermediate_sizes == [64, 64]


def test_a_llama_of_per_layer_widths_is_llama_cpps_deci_and_reads_back_as_a_llama(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 40)), seed=1)
    out, _ = export_gguf(src, tmp_path / "m.gguf")
    r = GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "deci"
    assert r.fields["deci.feed_forward_length"].contents() == [64, 40]
    assert r.fields["deci.block_count"].contents() == 2
    back = open_cmf(convert_gguf(out, tmp_path / "back.cmf", codec="f32"))
    assert back.arch.to_dict() == open_cmf(src).arch.to_dict()
    assert torch.equal(_logits(back), _logits(src))


@pytest.mark.parametrize("codecs", ["f32", "mixed"])
def test_a_qwen_of_per_layer_widths_is_padded_to_the_widest_with_zero_neurons(tmp_path, codecs):
    if codecs == "mixed":  # q8, q4, f16, bf16, fp8, q4_64, f32 among the MLPs; 96 wide, then 64
        src = _mixed(tmp_path, "qwen3", widths=(96, 64))
    else:  # a width that is no whole number of blocks: the down rows go as f32
        src = write_random(tmp_path / "m.cmf", arch_of("qwen3", widths=(64, 40)), seed=1)
    f = open_cmf(src)
    out, _ = export_gguf(src, tmp_path / "m.gguf")
    r = GGUFReader(out)
    wide = max(f.arch.intermediate_sizes)
    assert r.fields["general.architecture"].contents() == "qwen3"
    assert r.fields["qwen3.feed_forward_length"].contents() == wide
    back = open_cmf(convert_gguf(out, tmp_path / "back.cmf", codec="f32"))
    assert back.arch.intermediate_sizes == [wide, wide]
    for n in f.names:  # the true neurons as they were, the padding zero
        t, b = f.tensor(n), back.tensor(n)
        if t.shape != b.shape:
            assert torch.equal(b[tuple(slice(0, k) for k in t.shape)], t) and b.abs().sum() == t.abs().sum(), n
        else:
            assert torch.equal(b, t), n
    assert torch.allclose(_logits(back), _logits(src), atol=1e-5)
