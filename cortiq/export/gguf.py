"""CMF → a GGUF file that llama.cpp runs (Llama, Qwen2, Qwen3).

Written with the `gguf` package's GGUFWriter, streamed (tensor infos first,
then each tensor's bytes, one tensor in memory at a time):

- llama.cpp's tensor names (`token_embd`, `blk.{i}.attn_q`, ...) and metadata
  keys for the family; a Llama whose MLP widths differ per layer is written as
  llama.cpp's `deci` architecture with a `feed_forward_length` array (see
  PER_LAYER_WIDTHS); a Qwen one has every MLP padded to the widest with zero
  neurons (`padded_width`: llama.cpp builds its layers at one width);
- the q_proj / k_proj rows of Llama models in llama.cpp's order (per head,
  the rotary halves interleaved, as its converter permutes them; Qwen2 and
  Qwen3 use the rotate-half rope and stay as they are);
- the tokenizer as `tokenizer.ggml.*` (byte-level BPE: tokens, merges,
  token types, BOS / EOS ids, the pre-tokenizer's llama.cpp name, the chat
  template).

Codecs, without re-quantization:

- q8 is GGUF's Q8_0 block as it is (f16 scale, then 32 int8): its bytes are
  copied;
- q4 (blocks of 32) holds GGUF Q4_1's numbers (f16 scale, f16 min, 32 4-bit
  codes; x = min + scale·q) but packs the codes in another order: cortiq puts
  elements 2j and 2j+1 in the low and high nibble of byte j, Q4_1 puts
  elements j and j+16 there. The scale and min bytes are copied and the
  nibbles moved (the codes themselves are untouched), so the values decode
  bit for bit the same;
- both need whole blocks per row (a row width that is a multiple of 32: the
  blocks of a row-major flattening are then the rows' blocks, as GGUF
  blocks them); other widths, and the other codecs (q4_64, fp8), go in as
  F32, which holds their decoded values exactly; f32 / f16 / bf16 as F32 /
  F16 / BF16; vectors (norms, biases) always as F32, as llama.cpp wants them.

The MTP draft (`model.mtp.*`) has no place in llama.cpp's Llama / Qwen2 /
Qwen3 and is left out (`export_gguf` returns the names it left out).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..cmf import CmfFile, open_cmf
from ..convert.gguf import _LAYER, _LLAMA3_SPLIT, _QWEN2_SPLIT, _TOP, _permute
from ..errors import CortiqError, is_full, write_error
from ..model import verify_file

#: families llama.cpp runs that cortiq writes (its `general.architecture` names)
SUPPORTED = ("llama", "qwen2", "qwen3")
#: llama.cpp's architecture that runs a Llama whose MLP widths differ per layer: its "llama" builds
#: every layer at the first layer's width, its "deci" (DeciLM / Nemotron-NAS) at each layer's own
#: (`hparams.n_ff(i)` in src/models/deci.cpp, against one `n_ff` in src/models/llama.cpp); the
#: tensors, rope and q/k row order are Llama's
PER_LAYER_WIDTHS = {"llama": "deci"}


def gguf_arch(f: CmfFile) -> str:
    """The `general.architecture` a model is written as: its family's, or PER_LAYER_WIDTHS' where
    its MLP widths differ per layer."""
    if len(set(f.arch.intermediate_sizes)) > 1 and f.arch.arch_name in PER_LAYER_WIDTHS:
        return PER_LAYER_WIDTHS[f.arch.arch_name]
    return f.arch.arch_name


def padded_width(f: CmfFile) -> int | None:
    """The width every MLP is padded to (the widest) when the widths differ and llama.cpp's model of
    the family builds its layers at one width (a Qwen); else None. Zero neurons add exactly 0: a zero
    gate and up row, a zero down column, in any codec's bytes (a block of scale 0 and codes 0)."""
    widths = f.arch.intermediate_sizes
    return max(widths) if len(set(widths)) > 1 and f.arch.arch_name not in PER_LAYER_WIDTHS else None


def _pad(get, shape: tuple[int, int], dim: int, to: int):
    """A getter of `get`'s array (of byte shape `shape`) padded with zeros along `dim` to `to`."""
    def padded():
        a = get()
        more = list(a.shape)
        more[dim] = to - a.shape[dim]
        return np.ascontiguousarray(np.concatenate([a, np.zeros(more, a.dtype)], dim))
    return padded

_TO_GGUF_TOP = {v: k for k, v in _TOP.items()}
_TO_GGUF_LAYER = {v: k for k, v in _LAYER.items()}
# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
#: llama.cpp's pre-tokenizer names, by what the tokenizer.json's pre-tokenizer does (GPT-2's is "gpt-2":
#: llama.cpp refuses to load a file naming "gpt2", which is the tokenizer model's name, not a pre-tokenizer's)
PRE_NAMES = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def gguf_name(name: str) -> str:
    """The llama.cpp tensor name of a CMF tensor name."""
    if name in _TO_GGUF_TOP:
        return _TO_GGUF_TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _TO_GGUF_LAYER:
        return f"blk.{parts[2]}.{_TO_GGUF_LAYER[parts[3]]}"
    raise CortiqError(f"tensor {name!r} has no llama.cpp name")


def q4_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """cortiq q4 blocks [n, 20] (uint8) → GGUF Q4_1 blocks [n, 20]: scale and
    min bytes as they are, codes moved from (2j, 2j+1) to (j, j+16) nibble pairs."""
    raw = raw.reshape(-1, 20)
    packed = raw[:, 4:]  # [n, 16]
    q = np.empty((raw.shape[0], 32), dtype=np.uint8)
    q[:, 0::2] = packed & 0x0F
    q[:, 1::2] = packed >> 4
    out = np.empty_like(raw)
    out[:, :4] = raw[:, :4]
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def pre_name(tok_json: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json (a CortiqError if none fits)."""
    pre = tok_json.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in pre.get("pretokenizers", [])] if pre.get("type") == "Sequence" else [pre.get("type")]
    parts = pre.get("pretokenizers", [pre])
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        regex = (parts[0].get("pattern") or {}).get("Regex")
        if regex == _LLAMA3_SPLIT:
            return "llama-bpe"
        if regex == _QWEN2_SPLIT:
            return "qwen2"
    raise CortiqError(f"the tokenizer's pre-tokenizer ({'+'.join(map(str, kinds))}) matches none of llama.cpp's "
                      f"{', '.join(PRE_NAMES)}; name one with --pre")


def tokenizer_meta(tok: dict | None, vocab_size: int, where: str, pre: str | None = None) -> dict:
    """The tokenizer.ggml.* values for the CMF tokenizer entry: tokens [vocab_size],
    merges, token types, pre-tokenizer name, BOS / EOS ids, add_bos, chat template."""
    if not tok or not tok.get("json"):
        raise CortiqError(f"{where}: carries no tokenizer; a GGUF export needs one")
    doc = json.loads(tok["json"])
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise CortiqError(f"{where}: tokenizer model {model.get('type')!r} cannot be written as GGUF metadata (supported: byte-level BPE)")
    ids: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in doc.get("added_tokens", [])}
    for i, a in added.items():
        ids[i] = a["content"]
    n = max(ids) + 1 if ids else 0
    if n > vocab_size:
        raise CortiqError(f"{where}: the tokenizer has {n} tokens, more than the model's vocabulary of {vocab_size}")
    special = set(int(i) for i in tok.get("special_ids") or []) | {i for i, a in added.items() if a.get("special")}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in ids:
            tokens.append(ids[i])
            types.append(_CONTROL if i in special else _USER_DEFINED if i in added else _NORMAL)
        else:  # ids no token has (a vocabulary padded for the matrix shapes), as llama.cpp's converter fills them
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    post = doc.get("post_processor") or {}
    single = post.get("single") or [] if post.get("type") == "TemplateProcessing" else []
    add_bos = bool(single) and "SpecialToken" in single[0]
    return {
        "tokens": tokens, "types": types, "merges": merges, "pre": pre or pre_name(doc),
        "eos": list(tok.get("eos_ids") or []), "bos": tok.get("bos_id"), "add_bos": add_bos,
        "chat_template": tok.get("chat_template"),
    }


def _tensor_plan(f: CmfFile) -> tuple[list[tuple], list[str]]:
    """(gguf name, byte shape, numpy dtype, GGML type or None, getter of the numpy data) per
    tensor, and the CMF names left out (the MTP draft)."""
    from gguf import GGMLQuantizationType as Q

    arch = f.arch
    heads = {"q_proj": arch.num_heads, "k_proj": arch.num_kv_heads}
    wide = padded_width(f)
    out, left = [], []
    for name in f.names:
        if name.startswith("model.mtp."):
            left.append(name)
            continue
        info = f.info(name)
        shape = tuple(info.shape)
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        perm = heads.get(kind) if arch.arch_name == "llama" and name.endswith("_proj.weight") else None
        pad = wide if wide and name.endswith("mlp.down_proj.weight") and shape[1] < wide else None
        blocks = len(shape) == 2 and shape[1] % 32 == 0 and (pad is None or pad % 32 == 0)

        def fix(a, perm=perm):
            return np.ascontiguousarray(_permute(a, perm) if perm else a)

        if len(shape) == 2 and blocks and info.codec == "q8":
            get = (lambda n=name, s=shape, fix=fix: fix(f.raw(n).reshape(s[0], s[1] // 32 * 34)))
            out.append((gguf_name(name), (shape[0], shape[1] // 32 * 34), np.uint8, Q.Q8_0, get))
        elif len(shape) == 2 and blocks and info.codec == "q4":
            get = (lambda n=name, s=shape, fix=fix: fix(q4_to_q4_1(f.raw(n)).reshape(s[0], s[1] // 32 * 20)))
            out.append((gguf_name(name), (shape[0], shape[1] // 32 * 20), np.uint8, Q.Q4_1, get))
        elif len(shape) >= 2 and info.codec == "f16":
            get = (lambda n=name, fix=fix: fix(f.stored(n).numpy()))
            out.append((gguf_name(name), shape, np.float16, None, get))
        elif len(shape) >= 2 and info.codec == "bf16":
            get = (lambda n=name, s=shape, fix=fix: fix(f.raw(n).reshape(s[0], s[1] * 2)))
            out.append((gguf_name(name), (shape[0], shape[1] * 2), np.uint8, Q.BF16, get))
        else:  # f32, vectors, and codecs GGUF has no block for: their decoded values, exactly
            get = (lambda n=name, fix=fix: fix(f.tensor(n).numpy()))
            out.append((gguf_name(name), shape, np.float32, None, get))
        if pad:  # a down row's bytes grow in proportion to its columns (whole blocks: pad % 32 == 0)
            g, bshape, dt, q, get = out[-1]
            cols = bshape[1] * pad // shape[1]
            out[-1] = (g, (bshape[0], cols), dt, q, _pad(get, bshape, 1, cols))
        elif wide and name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and shape[0] < wide:
            g, bshape, dt, q, get = out[-1]
            out[-1] = (g, (wide, bshape[1]), dt, q, _pad(get, bshape, 0, wide))
    return out, left


def _file_type(plan: list[tuple]) -> int:
    """general.file_type: the GGML type most of the matrices' bytes are in."""
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F

    by = {Q.Q8_0: F.MOSTLY_Q8_0, Q.Q4_1: F.MOSTLY_Q4_1, Q.BF16: F.MOSTLY_BF16, None: None}
    weight: dict = {}
    for _, shape, dt, q, _ in plan:
        if len(shape) == 2:
            key = q if q is not None else ("f16" if dt == np.float16 else "f32")
            weight[key] = weight.get(key, 0) + int(np.prod(shape)) * np.dtype(dt).itemsize
    top = max(weight, key=weight.get) if weight else "f32"
    if top == "f16":
        return int(F.MOSTLY_F16)
    if top == "f32":
        return int(F.ALL_F32)
    return int(by[top])


def _check_exportable(f: CmfFile, out: Path, pre: str | None) -> None:
    """Refuse what llama.cpp would not run as cortiq writes it, before anything is written."""
    verify_file(f)  # what cortiq would refuse to load is not written out for others to load
    arch = f.arch
    if arch.arch_name not in SUPPORTED:
        raise CortiqError(f"{f.path}: llama.cpp does not run {arch.arch_name!r} models as cortiq writes them; "
                          f"GGUF export supports {', '.join(SUPPORTED)} (use --to hf)")
    sc = arch.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type"))
    if sc and kind != "linear":
        raise CortiqError(f"{f.path}: rope scaling {kind!r} is not written to GGUF (supported: none, linear)")
    if pre is not None and pre not in PRE_NAMES:
        raise CortiqError(f"pre-tokenizer {pre!r} is not one of {', '.join(PRE_NAMES)}")
    if out.exists() and out.is_dir():
        raise CortiqError(f"{out}: is a directory; give a .gguf file name")


def _add_metadata(w, f: CmfFile, tok: dict, plan: list[tuple], name: str) -> None:
    """The model's geometry, file type and tokenizer as GGUF keys, and every tensor's info."""
    from gguf import GGML_QUANT_VERSION, RopeScalingType
    from gguf import GGMLQuantizationType as Q

    arch = f.arch
    sc = arch.rope_scaling
    widths = [padded_width(f) or f.info(f"model.layers.{i}.mlp.up_proj.weight").shape[0] for i in range(arch.num_layers)]
    w.add_name(name)
    w.add_block_count(arch.num_layers)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(widths[0] if len(set(widths)) == 1 else widths)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_key_length(arch.head_dim)
    w.add_value_length(arch.head_dim)
    w.add_rope_dimension_count(arch.rotary_dim)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    if sc:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(sc["factor"]))
    w.add_vocab_size(arch.vocab_size)
    w.add_file_type(_file_type(plan))
    if any(q in (Q.Q8_0, Q.Q4_1) for _, _, _, q, _ in plan):
        w.add_quantization_version(GGML_QUANT_VERSION)  # the block layouts' version, as llama.cpp's tools write it
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if tok["bos"] is not None:
        w.add_bos_token_id(int(tok["bos"]))
    w.add_add_bos_token(tok["add_bos"])
    for key, i in zip(("eos", "eot", "eom"), tok["eos"]):
        getattr(w, f"add_{key}_token_id")(int(i))
    if tok["chat_template"]:
        w.add_chat_template(tok["chat_template"])
    for gname, shape, dt, q, _ in plan:
        w.add_tensor_info(gname, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize, raw_dtype=q)


def _write(w, plan: list[tuple], out: Path, progress: Callable[[str], None] | None) -> None:
    """The header, the keys and every planned tensor's data into `out.partial`, renamed to `out`
    when complete; on any error the partial file is removed."""
    tmp = out.with_name(out.name + ".partial")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gname, shape, dt, q, get in plan:
            data = get()
            if data.dtype != np.dtype(dt) or tuple(data.shape) != tuple(shape):
                raise CortiqError(f"tensor {gname}: got {data.dtype}{list(data.shape)}, planned {np.dtype(dt)}{list(shape)}")
            w.write_tensor_data(data)
            if progress:
                progress(gname)
        w.close()
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):  # a full disk fails the flush again
            w.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and is_full(e):
            raise write_error(out, e) from None
        raise


def export_gguf(model: str | os.PathLike | CmfFile, out_file: str | os.PathLike, pre: str | None = None,
                name: str | None = None, progress: Callable[[str], None] | None = None) -> tuple[Path, list[str]]:
    """Write the CMF model as the GGUF file `out_file` (see the module doc), through
    `out_file.partial`. Returns the path and the CMF tensors left out (the MTP draft)."""
    from gguf import GGUFWriter

    f = model if isinstance(model, CmfFile) else open_cmf(model)
    out = Path(out_file)
    _check_exportable(f, out, pre)
    tok = tokenizer_meta(f.tokenizer, f.arch.vocab_size, str(f.path), pre)
    plan, left = _tensor_plan(f)
    w = GGUFWriter(None, gguf_arch(f))
    conv = next((v for k, v in f.provenance.items() if k.split("#")[0] == "convert"), {})
    _add_metadata(w, f, tok, plan, name or conv.get("name") or out.stem)
    _write(w, plan, out, progress)
    return out, left
