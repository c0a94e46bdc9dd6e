"""GGUF → CMF: names, the q/k permutation undone, dequantized values, the
tokenizer built from the metadata, bad input; and the bundled SmolLM2 end to
end (convert, inspect, recode, verify, and 'Paris' from transformers)."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from cortiq import cmf, codecs
from cortiq.cli import main
from cortiq.convert.gguf import _permute, _unpermute, convert_gguf
from cortiq.errors import CortiqError

H, I, HEADS, KV, HD, L = 64, 96, 4, 2, 16, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def hf_weights(tied=False):
    """Random weights in the HF layout, by HF name."""
    g = torch.Generator().manual_seed(0)
    vocab = len(SPECIALS) + 256 + len(MERGES)
    w = {"model.embed_tokens.weight": torch.randn(vocab, H, generator=g), "model.norm.weight": torch.rand(H, generator=g)}
    if not tied:
        w["lm_head.weight"] = torch.randn(vocab, H, generator=g)
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.rand(H, generator=g)
        w[p + "post_attention_layernorm.weight"] = torch.rand(H, generator=g)
        w[p + "self_attn.q_proj.weight"] = torch.randn(HEADS * HD, H, generator=g)
        w[p + "self_attn.k_proj.weight"] = torch.randn(KV * HD, H, generator=g)
        w[p + "self_attn.v_proj.weight"] = torch.randn(KV * HD, H, generator=g)
        w[p + "self_attn.o_proj.weight"] = torch.randn(H, HEADS * HD, generator=g)
        w[p + "mlp.gate_proj.weight"] = torch.randn(I, H, generator=g)
        w[p + "mlp.up_proj.weight"] = torch.randn(I, H, generator=g)
        w[p + "mlp.down_proj.weight"] = torch.randn(H, I, generator=g)
    return w


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def make_gguf(path, arch="llama", tokenizer=True, tied=False, f16_head=True):
    """A tiny GGUF as llama.cpp writes one: q/k rows permuted (llama), matrices
    Q8_0, norms f32 (and an f16 output head)."""
    w = hf_weights(tied)
    wr = GGUFWriter(str(path), arch)
    wr.add_block_count(L)
    wr.add_embedding_length(H)
    wr.add_feed_forward_length(I)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV)
    wr.add_rope_freq_base(50000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_context_length(512)
    wr.add_rope_dimension_count(HD)
    if tokenizer:
        tokens = SPECIALS + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("smollm")
        wr.add_token_list(tokens)
        wr.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
        wr.add_token_merges(MERGES)
        wr.add_bos_token_id(1)
        wr.add_eos_token_id(2)
        wr.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in w.items():
        a = t.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = _permute(a, HEADS if "q_proj" in name else KV)
        if a.ndim == 1:
            wr.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
        elif name == "lm_head.weight" and f16_head:
            wr.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            wr.add_tensor(gguf_name(name), quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path, w


def test_permute_inverts():
    x = np.arange(4 * 16 * 3).reshape(64, 3)
    assert np.array_equal(_unpermute(_permute(x, 4), 4), x)
    assert not np.array_equal(_permute(x, 4), x)


def test_convert_tiny_gguf_equals_dequantized_with_the_permutation_undone(tmp_path):
    src, hf = make_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(src, tmp_path / "tiny.cmf", codec="f32")
    f = cmf.open_cmf(out)
    a = f.arch
    assert (a.arch_name, a.num_layers, a.hidden_size, a.intermediate_sizes, a.num_heads, a.num_kv_heads, a.head_dim) == (
        "llama", L, H, [I] * L, HEADS, KV, HD)
    assert a.vocab_size == 262 and a.rope_theta == 50000.0 and a.rms_norm_eps == pytest.approx(1e-5)
    assert not a.tie_word_embeddings and a.max_position_embeddings == 512
    assert set(f.names) == set(hf)
    r = GGUFReader(src)
    for t in r.tensors:
        name = {gguf_name(n): n for n in hf}[t.name]
        want = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            want = _unpermute(want, HEADS if "q_proj" in name else KV)
        assert np.array_equal(f.tensor(name).numpy(), want), name
        # and (independently of _unpermute) the HF weights come back, within Q8_0's error
        err = (f.tensor(name) - hf[name]).abs().max()
        assert err <= hf[name].abs().max() / 127, name
    assert f.verify() == []
    assert f.provenance["convert"]["format"] == "gguf" and f.provenance["convert"]["codec"] == "f32"


def test_keep_codec_and_quantized_codec(tmp_path):
    src, hf = make_gguf(tmp_path / "tiny.gguf", tied=True)
    f = cmf.open_cmf(convert_gguf(src, tmp_path / "keep.cmf"))
    assert f.arch.tie_word_embeddings and "lm_head.weight" not in f.names
    assert f.info("model.norm.weight").codec == "f32"  # f32 in the GGUF
    assert f.info("model.layers.0.mlp.up_proj.weight").codec == "f16"  # Q8_0 in the GGUF
    exact = cmf.open_cmf(convert_gguf(src, tmp_path / "f32.cmf", codec="f32"))
    q = cmf.open_cmf(convert_gguf(src, tmp_path / "q4.cmf", codec="q4"))
    for name in exact.names:
        x = exact.tensor(name)
        assert bool(((f.tensor(name) - x).abs() <= codecs.get(f.info(name).codec).bound(x)).all())
        # matrices in q4 but the (tied) embedding, which a 4-bit file keeps at q8; vectors f32
        want = "f32" if x.dim() != 2 else "q8" if name == "model.embed_tokens.weight" else "q4"
        assert q.info(name).codec == want, name
        assert bool(((q.tensor(name) - x).abs() <= codecs.get(q.info(name).codec).bound(x)).all())


def test_tokenizer_travels_in_the_cmf(tmp_path):
    src, _ = make_gguf(tmp_path / "tiny.gguf")
    f = cmf.open_cmf(convert_gguf(src, tmp_path / "tiny.cmf"))
    t = f.tokenizer
    assert t["eos_ids"] == [2] and t["bos_id"] == 1 and t["special_ids"] == [0, 1, 2]
    assert "<|im_start|>" in t["chat_template"]
    tok = Tokenizer.from_str(t["json"])
    enc = tok.encode("the 42<|im_end|>")
    assert enc.tokens == ["t", "he", "Ġ", "4", "2", "<|im_end|>"]  # merges applied, digits split, special whole
    assert enc.ids[-1] == 2 and tok.token_to_id("Ġthe") == 261
    assert tok.encode(" the").tokens == ["Ġthe"]
    assert tok.decode(tok.encode("héllo wörld 123").ids) == "héllo wörld 123"


def test_qwen2_gguf_is_not_unpermuted(tmp_path):
    src, hf = make_gguf(tmp_path / "q.gguf", arch="qwen2")
    f = cmf.open_cmf(convert_gguf(src, tmp_path / "q.cmf", codec="f32"))
    assert f.arch.arch_name == "qwen2"
    q = "model.layers.1.self_attn.q_proj.weight"
    assert (f.tensor(q) - hf[q]).abs().max() <= hf[q].abs().max() / 127


# ── bad input, through the CLI ──


def _cli_fails(capsys, tmp_path, argv, pattern):
    import re

    before = set(tmp_path.iterdir())
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert re.search(pattern, err), err
    # nothing left behind but the cortiq home (conftest puts it in tmp_path; the first `cortiq` command of a
    # process that loads the flows' commands makes its prefect folder, so whether it is there depends on order)
    assert set(tmp_path.iterdir()) - {tmp_path / "cortiq-home"} == before - {tmp_path / "cortiq-home"}
    return err


def test_unsupported_architecture(tmp_path, capsys):
    src, _ = make_gguf(tmp_path / "g.gguf", arch="gemma")
    _cli_fails(capsys, tmp_path, ["convert", str(src), str(tmp_path / "g.cmf")],
               r"^cortiq: .*g\.gguf: unsupported architecture 'gemma'; supported: llama, qwen2, qwen3, deci$")


def test_missing_tokenizer(tmp_path, capsys):
    src, _ = make_gguf(tmp_path / "n.gguf", tokenizer=False)
    _cli_fails(capsys, tmp_path, ["convert", str(src), str(tmp_path / "n.cmf")], r"n\.gguf: carries no tokenizer")


def test_truncated_and_fake_gguf(tmp_path, capsys):
    src, _ = make_gguf(tmp_path / "t.gguf")
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    _cli_fails(capsys, tmp_path, ["convert", str(src), str(tmp_path / "t.cmf")], r"t\.gguf: not a readable GGUF file")
    fake = tmp_path / "f.gguf"
    fake.write_text("not gguf")
    _cli_fails(capsys, tmp_path, ["convert", str(fake), str(tmp_path / "f.cmf")], r"f\.gguf: not a GGUF file")


def test_unknown_codec_for_convert(tmp_path, capsys):
    src, _ = make_gguf(tmp_path / "u.gguf")
    _cli_fails(capsys, tmp_path, ["convert", str(src), str(tmp_path / "u.cmf"), "--codec", "q3"],
               r"unknown codec 'q3' \(known: f32, f16, bf16, q8, q4")


def test_convert_tiny_gguf_through_the_cli(tmp_path, capsys):
    src, _ = make_gguf(tmp_path / "c.gguf")
    assert main(["convert", str(src), str(tmp_path / "c.cmf"), "--codec", "q8"]) == 0
    assert cmf.open_cmf(tmp_path / "c.cmf").info("model.layers.0.mlp.up_proj.weight").codec == "q8"


# ── the bundled SmolLM2-135M-Instruct, end to end ──


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from cortiq.convert.bundled import smollm2_path

    try:
        smollm2_path()
    except CortiqError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.cmf"
    assert main(["convert", "smollm2", str(out)]) == 0
    return out


@pytest.mark.slow
def test_smollm2_inspect(smollm2, capsys):
    capsys.readouterr()
    assert main(["inspect", str(smollm2), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    a = s["arch"]
    assert (a["num_layers"], a["hidden_size"], a["vocab_size"], a["num_heads"], a["num_kv_heads"]) == (30, 576, 49152, 9, 3)
    assert a["intermediate_sizes"] == [1536] * 30 and a["tie_word_embeddings"] and a["rope_theta"] == 100000.0
    assert s["tensors"] == 272 and s["params"] == 134_515_008
    assert s["codecs"]["f16"]["tensors"] == 211 and s["codecs"]["f32"]["tensors"] == 61
    assert s["tokenizer"]["eos_ids"] == [2] and s["tokenizer"]["chat_template"]
    assert s["provenance"]["convert"]["gguf_architecture"] == "llama"


@pytest.mark.slow
def test_smollm2_recode_q8_and_back_and_verify(smollm2, tmp_path, capsys):
    q8, f16 = tmp_path / "q8.cmf", tmp_path / "f16.cmf"
    assert main(["recode", str(smollm2), str(q8), "--codec", "q8"]) == 0
    assert main(["recode", str(q8), str(f16), "--codec", "f16"]) == 0
    src, a, b = cmf.open_cmf(smollm2), cmf.open_cmf(q8), cmf.open_cmf(f16)
    for name in src.names:
        x, y, z = src.tensor(name), a.tensor(name), b.tensor(name)
        ca = codecs.get(a.info(name).codec)
        assert a.info(name).codec == ("q8" if x.dim() == 2 else "f32")
        assert b.info(name).codec == "f16"
        assert bool(((y - x).abs() <= ca.bound(x)).all()), name
        assert torch.equal(z, y.half().float()), name  # f16 rounds to nearest: exactly
    assert list(b.provenance) == ["convert", "recode", "recode#2"]
    # verify: clean, then a flipped byte is named
    capsys.readouterr()
    assert main(["verify", str(q8)]) == 0
    victim = a.info("model.layers.7.mlp.down_proj.weight")
    with open(q8, "r+b") as fh:
        fh.seek(victim.start + 1000)
        byte = fh.read(1)
        fh.seek(victim.start + 1000)
        fh.write(bytes([byte[0] ^ 0x10]))
    capsys.readouterr()
    assert main(["verify", str(q8)]) == 1
    err = capsys.readouterr().err
    assert "1 of 272 tensors fail their sha256: model.layers.7.mlp.down_proj.weight" in err


PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
             "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally "
             "nicknamed 'La dame de fer', it was constructed as the centrepiece of the 1889 World's Fair.")


@pytest.mark.slow
def test_smollm2_says_paris_in_transformers(smollm2):
    """The layout is right: transformers' own Llama, fed the CMF's weights and tokenizer, answers Paris; and
    its NLL on a paragraph is far lower than with q/k left in llama.cpp's row order (which still says Paris:
    a common permutation of q and k keeps their dot products, only RoPE's pairing suffers)."""
    transformers = pytest.importorskip("transformers")
    f = cmf.open_cmf(smollm2)
    a = f.arch
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_sizes[0],
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        tie_word_embeddings=a.tie_word_embeddings, max_position_embeddings=a.max_position_embeddings)
    weights = {n: f.tensor(n) for n in f.names}

    def build(w):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        model.load_state_dict(w, strict=False, assign=True)
        model.tie_weights()
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its buffers are not in the state dict
        assert not [n for n, p in model.named_parameters() if p.is_meta]
        return model.eval()

    model = build(weights)
    tok = Tokenizer.from_str(f.tokenizer["json"])
    ids = tok.encode("The capital of France is").ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
        text = tok.decode(out[0, len(ids):].tolist())
        assert "Paris" in text, text
        para = torch.tensor([tok.encode(PARAGRAPH).ids])
        nll = float(model(para, labels=para).loss)
        gguf_order = {n: torch.from_numpy(_permute(w.numpy(), a.num_heads if "q_proj" in n else a.num_kv_heads).copy())
                      if n.endswith(("q_proj.weight", "k_proj.weight")) else w for n, w in weights.items()}
        nll_gguf_order = float(build(gguf_order)(para, labels=para).loss)
    assert nll < 2.6 and nll_gguf_order > nll + 1.0, (nll, nll_gguf_order)  # measured: 2.07 vs 3.87 nats/token
