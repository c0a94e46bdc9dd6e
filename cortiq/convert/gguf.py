"""A GGUF file → CMF.

The `gguf` package reads the file (memory-mapped) and dequantizes it one tensor
at a time (Q4_1, Q8_0, K-quants...); each tensor is written in the chosen
codec through a `cmf.Spec` getter, so the whole model is never in memory.

Three things a GGUF file does differently from the HF layout CMF keeps:
- names: `blk.{i}.attn_q.weight` and so on (mapped to the HF names of
  docs/internals.md);
- llama.cpp's converter permutes the rows of q_proj and k_proj of llama-arch
  models, per head, from HF's rotate-half layout ([first half; second half])
  to interleaved pairs; `_unpermute` puts them back;
- the tokenizer is a list of tokens, merges and token types in the metadata:
  `tokenizer_json` builds the `tokenizers` byte-level BPE from them.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..arch import FULL, Arch, ArchError
from ..errors import CortiqError

#: GGUF `general.architecture` values this converter reads
SUPPORTED = ("llama", "qwen2", "qwen3")
#: llama.cpp architectures that are a Llama as cortiq reads them: "deci" (a Llama with a width per
#: layer, as cortiq's GGUF export writes one; its attention-free and linear-attention blocks are not read)
LLAMA_LIKE = {"deci": "llama"}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: the codec "keep" gives a tensor stored in a GGUF type (quantized types: f16)
_KEEP = {"F32": "f32", "F16": "f16", "BF16": "bf16"}

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# pre-tokenizer split patterns by `tokenizer.ggml.pre` (llama.cpp's names)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRES = ("default", "gpt2", "gpt-2", "mpt", "olmo")
_DIGIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRES = ("llama-bpe", "llama3", "dbrx", "smaug-bpe")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen")


def _open(src: Path):
    """A GGUFReader on `src`, or a CortiqError naming the file."""
    from gguf import GGUFReader

    try:
        with open(src, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CortiqError(f"{src}: no such file") from None
    except OSError as e:
        raise CortiqError(f"{src}: cannot read ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise CortiqError(f"{src}: not a GGUF file (it does not start with 'GGUF')")
    try:
        return GGUFReader(src, "r")
    except Exception as e:  # the reader raises what numpy/struct raise on a damaged file
        raise CortiqError(f"{src}: not a readable GGUF file, truncated or damaged ({type(e).__name__}: {e})") from None


def _meta(r, key: str, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that is that float32
    (1e-06, not 9.99999997e-07): the value its writer meant, so a model that
    went to GGUF and back has the settings it had."""
    import numpy as np

    return float(str(np.float32(v)))


def _logical_shape(t) -> tuple[int, ...]:
    # GGUF lists dimensions fastest first; numpy/torch order is the reverse
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation: per head, its rows went from HF's
    [first half; second half] of the rotary dims to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute(w, n_head: int):
    """llama.cpp's permutation (HF layout → GGUF), the inverse of `_unpermute` (tests use it)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_arch(r, src: Path) -> tuple[Arch, dict[str, str]]:
    """The Arch of an opened GGUF file, and the map GGUF tensor name → CMF name."""
    name = _meta(r, "general.architecture")
    if name not in SUPPORTED and name not in LLAMA_LIKE:
        raise ArchError(
            f"{src}: unsupported architecture {name or '(none)'!r}; supported: {', '.join(SUPPORTED + tuple(LLAMA_LIKE))}"
        )
    tensors = {t.name: t for t in r.tensors}
    names = _cmf_names(tensors, name, src)

    def one(key, v):
        # a per-layer array (deci's head counts) is read only when every layer has the same value
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise CortiqError(f"{src}: metadata {name}.{key} differs per layer ({min(v)}..{max(v)}): not read")
            return v[0]
        return v

    def need(key, cast=int):
        v = _meta(r, f"{name}.{key}")
        if v is None:
            raise CortiqError(f"{src}: metadata {name}.{key} is missing")
        return cast(one(key, v))

    n = need("block_count")
    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv = int(one("attention.head_count_kv", _meta(r, f"{name}.attention.head_count_kv")) or heads)
    head_dim = int(_meta(r, f"{name}.attention.key_length") or hidden // heads)
    rot = int(_meta(r, f"{name}.rope.dimension_count") or head_dim)
    widths = []
    for i in range(n):
        up = tensors.get(f"blk.{i}.ffn_up.weight")
        if up is None:
            raise CortiqError(f"{src}: tensor blk.{i}.ffn_up.weight is missing")
        widths.append(_logical_shape(up)[0])
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise CortiqError(f"{src}: tensor token_embd.weight is missing")
    scaling = None
    stype = _meta(r, f"{name}.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise CortiqError(f"{src}: rope scaling {stype!r} is not supported (supported: linear)")
        scaling = {"rope_type": "linear", "factor": _f32(_meta(r, f"{name}.rope.scaling.factor", 1.0))}
    arch = Arch(
        arch_name=LLAMA_LIKE.get(name, name),
        vocab_size=_logical_shape(emb)[0],
        hidden_size=hidden,
        num_layers=n,
        intermediate_sizes=widths,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rope_theta=_f32(_meta(r, f"{name}.rope.freq_base", 10000.0)),
        partial_rotary_factor=rot / head_dim,
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rms_norm_eps=_f32(_meta(r, f"{name}.attention.layer_norm_rms_epsilon", 1e-6)),
        layer_types=[FULL] * n,
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(_meta(r, f"{name}.context_length", 32768)),
    )
    _check_complete(arch, names, name, src)
    return arch, names


def _cmf_names(tensors: dict, name: str, src: Path) -> dict[str, str]:
    """GGUF tensor name → CMF name, for every tensor of a dense `name` model; any other tensor is refused."""
    names: dict[str, str] = {}
    for g in tensors:
        if g in _TOP:
            names[g] = _TOP[g]
            continue
        parts = g.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
            names[g] = f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
        elif g == "rope_freqs.weight":
            raise CortiqError(f"{src}: Llama-3 rope frequency factors (rope_freqs.weight) are not supported")
        else:
            raise CortiqError(f"{src}: tensor {g!r} is not part of a dense {name} model cortiq reads")
    return names


def _check_complete(arch: Arch, names: dict[str, str], name: str, src: Path) -> None:
    """Refuse a file that lacks a tensor `arch` needs, or holds one past its layers."""
    n = arch.num_layers
    want = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if arch.tie_word_embeddings else {"lm_head.weight"})
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [
        f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += [f"self_attn.{p}_proj.bias" for p in "qkv"] if arch.attention_bias else []
    layer += [f"self_attn.{p}_norm.weight" for p in "qk"] if arch.qk_norm else []
    want |= {f"model.layers.{i}.{x}" for i in range(n) for x in layer}
    missing = sorted(want - set(names.values()))
    if missing:
        raise CortiqError(f"{src}: {len(missing)} tensors missing for a {name} model, e.g. {missing[0]}")
    extra = sorted(g for g, c in names.items() if c not in want)
    if extra:
        raise CortiqError(f"{src}: tensor {extra[0]!r} does not belong to a {n}-layer {name} model")


def tokenizer_json(r, src: Path) -> tuple[str, dict]:
    """A `tokenizers` tokenizer.json text built from the GGUF's tokenizer.ggml.*
    metadata, and notes for the provenance. Only byte-level BPE (`gpt2`, the
    model of Llama-3, Qwen, SmolLM...) is read."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _meta(r, "tokenizer.ggml.model")
    tokens = _meta(r, "tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise CortiqError(f"{src}: carries no tokenizer (no tokenizer.ggml.model / tokens metadata)")
    if model != "gpt2":
        raise CortiqError(f"{src}: tokenizer model {model!r} is not supported (supported: gpt2, byte-level BPE)")
    merges = _meta(r, "tokenizer.ggml.merges") or []
    types = _meta(r, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token keeps its first id
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = _meta(r, "tokenizer.ggml.pre", "default")
    notes = {"tokenizer_model": model, "pre": pre}
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRES)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT), "isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in _GPT2_PRES:
            warnings.warn(f"{src}: pre-tokenizer {pre!r} unknown; using GPT-2's", stacklevel=2)
            notes["pre_fallback"] = "gpt2"
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, ty in enumerate(types) if ty == _USER_DEFINED])
    bos = _meta(r, "tokenizer.ggml.bos_token_id")
    if _meta(r, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str(), notes


def _tokenizer_doc(r, src: Path) -> tuple[dict, dict]:
    from ..tokenizer import tokenizer_doc

    text, notes = tokenizer_json(r, src)
    types = _meta(r, "tokenizer.ggml.token_type") or []
    eos = [_meta(r, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    if not eos:
        raise CortiqError(f"{src}: the tokenizer names no EOS token (tokenizer.ggml.eos_token_id)")
    bos = _meta(r, "tokenizer.ggml.bos_token_id")
    template = _meta(r, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CortiqError(f"{src}: tokenizer.chat_template is {type(template).__name__}, not a string")
    from ..chat import validate_template

    validate_template(template, f"{src}: tokenizer.chat_template")
    doc = tokenizer_doc(
        text,
        eos_ids=eos,
        bos_id=None if bos is None else int(bos),
        chat_template=template,
        special_ids=[i for i, ty in enumerate(types) if ty == _CONTROL],
    )
    return doc, notes


def convert_gguf(src: str | os.PathLike, out_path: str | os.PathLike, codec: str = "keep", progress=None) -> Path:
    """Convert the GGUF file `src` into the CMF file `out_path`.

    codec: "keep" writes quantized tensors as f16 and f32/f16/bf16 ones as
    they are; a codec name writes every tensor in it (a quantized codec:
    matrices only, vectors stay plain; see `codecs.choose_codec`).
    `progress(name)` is called after each tensor is written."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    from .. import cmf, codecs

    src, out_path = Path(src), Path(out_path)
    if codec != "keep":
        codecs.get(codec)  # an unknown codec fails before any work
    r = _open(src)
    arch, names = read_arch(r, src)
    tok, notes = _tokenizer_doc(r, src)
    heads = {"q_proj": arch.num_heads, "k_proj": arch.num_kv_heads}

    def getter(t, shape, unpermute_heads):
        def get():
            a = dequantize(t.data, t.tensor_type)  # [rows, cols] f32 (a view of the map for F32)
            a = np.asarray(a, dtype=np.float32).reshape(shape)
            if unpermute_heads:
                a = _unpermute(a, unpermute_heads)
            a = np.ascontiguousarray(a)
            return torch.from_numpy(a if a.flags.writeable else a.copy())  # F32 tensors are views of a read-only map

        return get

    specs = []
    for t in r.tensors:
        name = names[t.name]
        shape = _logical_shape(t)
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        unperm = heads.get(kind) if arch.arch_name == "llama" else None
        c = codecs.choose_codec(codec, shape, _KEEP.get(t.tensor_type.name, "f16"), name)
        specs.append(cmf.Spec(name, c, shape, getter(t, shape, unperm)))
    doc = cmf.new_doc(arch, tok)
    doc = cmf.with_provenance(doc, "convert", {
        "source": str(src.resolve()),
        "format": "gguf",
        "gguf_architecture": arch.arch_name,
        "name": _meta(r, "general.name"),
        "source_types": sorted({t.tensor_type.name for t in r.tensors}),
        "codec": codec,
        "q_k_unpermuted": arch.arch_name == "llama",
        **notes,
    })
    return cmf.write_cmf(out_path, doc, specs, progress=progress)
