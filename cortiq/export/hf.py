"""CMF → a Hugging Face model directory that transformers (and vLLM, SGLang) load.

What is written:

- `config.json`: the family's own `model_type` and fields (Llama, Qwen2,
  Qwen3, Qwen3-Next, Qwen3.5 as the text-only `qwen3_5_text` /
  `Qwen3_5ForCausalLM`); rope given both as the legacy `rope_theta` /
  `rope_scaling` keys (transformers 4.x) and `rope_parameters` (5.x);
- `generation_config.json` (BOS and EOS ids), `tokenizer.json`,
  `tokenizer_config.json` (special tokens, chat template),
  `special_tokens_map.json`;
- `model.safetensors`, or numbered shards and `model.safetensors.index.json`
  over the shard limit, in the requested dtype; the decoder layers' q8 / q4 /
  q4_64 matrices (`quantized`) as compressed-tensors pack-quantized weights
  with a `quantization_config` in config.json, which transformers and vLLM load
  as quantized (`cortiq.convert.ct`; a q4 matrix exactly when its blocks are
  symmetric, as QuantSettings.q4_grid "symmetric" writes them); other
  quantized tensors dequantized.

Names are the HF names CMF keeps, except:
- Qwen3-Next's Gated DeltaNet projections, which CMF keeps split, are fused
  back into `in_proj_qkvz` / `in_proj_ba` (per key-head group
  [q; k; v; z] and [b; a], the layout transformers'
  `fix_query_key_value_ordering` reads);
- the MTP draft `model.mtp.*` goes under the Qwen3-Next / Qwen3.5 checkpoint
  names `mtp.*` (eh_proj → fc, enorm → pre_fc_norm_embedding, hnorm →
  pre_fc_norm_hidden), which vLLM's MTP speculative decoding reads and
  transformers skips. Llama, Qwen2 and Qwen3 have no MTP in transformers or
  vLLM: both would stop at (vLLM) or list (transformers) weights their model
  has no place for, so the draft goes, under the same names, into its own
  file `mtp/model.safetensors` that neither reads and `cortiq convert` does.

MLP widths that differ per layer (a global fold) have no per-layer field in
any of these families' transformers configs, so every MLP (the draft's too)
is padded to the widest with zero neurons: a zero gate row and zero up row
give silu(0)·0 = 0, and a zero down column adds exactly 0 to the output. The
true widths go into config.json as `cortiq_intermediate_sizes` (and
`cortiq_mtp_intermediate_size`), from which `cortiq convert` trims the
padding again. Zero neurons also stay zero under fine-tuning: every gradient
of their weights is a product with one of their zero activations.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from ..arch import Arch
from ..cmf import CmfFile, open_cmf
from ..errors import CortiqError, is_full, write_error
from ..model import verify_file
from ..store import check_output, replace_dir
from ..convert import ct

#: cortiq family → (HF model_type, transformers class)
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
}
#: export dtype name → (torch dtype, safetensors dtype, config.json name)
DTYPES = {
    "f32": (torch.float32, "F32", "float32"),
    "f16": (torch.float16, "F16", "float16"),
    "bf16": (torch.bfloat16, "BF16", "bfloat16"),
}
#: families whose HF checkpoints carry the MTP draft beside the trunk (`mtp.*`)
MTP_IN_CHECKPOINT = ("qwen3_next", "qwen3_5")
#: where the draft of the other families goes, beside the checkpoint
MTP_FILE = "mtp/model.safetensors"
#: the default shard limit (as transformers' save_pretrained)
SHARD_BYTES = 5 * 10**9
_MTP_HF = {"eh_proj.": "fc.", "enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden."}


def hf_name(name: str) -> str:
    """The HF checkpoint name of a CMF tensor name (the GDN fusion aside)."""
    if name.startswith("model.mtp."):
        rest = name[len("model.mtp."):]
        for a, b in _MTP_HF.items():
            if rest.startswith(a):
                rest = b + rest[len(a):]
        return "mtp." + rest
    return name


def mtp_width(f: CmfFile) -> int:
    """The MTP layer's MLP width, 0 without a draft."""
    g = "model.mtp.layers.0.mlp.gate_proj.weight"
    return f.info(g).shape[0] if g in f else 0


def config(arch: Arch, tok: dict | None, dtype: str, widths: list[int], mtp: int) -> dict:
    """config.json for `arch` whose MLPs are all `max(widths)` wide (see the module doc)."""
    model_type, cls = FAMILIES[arch.arch_name]
    width = max(widths + ([mtp] if mtp else []))
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling:
        rope = {**arch.rope_scaling, "rope_theta": arch.rope_theta}
    hybrid = arch.arch_name in ("qwen3_next", "qwen3_5")
    if arch.partial_rotary_factor != 1.0 or hybrid:
        rope["partial_rotary_factor"] = arch.partial_rotary_factor
    eos = list((tok or {}).get("eos_ids") or [])
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": width,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "rope_parameters": rope,
        "attention_bias": arch.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "bos_token_id": (tok or {}).get("bos_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "use_cache": True,
        "torch_dtype": DTYPES[dtype][2],
        "dtype": DTYPES[dtype][2],
    }
    if arch.arch_name == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    if arch.arch_name in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=arch.num_layers)
    if hybrid:
        cfg.update(
            layer_types=list(arch.layer_types),
            partial_rotary_factor=arch.partial_rotary_factor,
            linear_num_key_heads=arch.linear_num_key_heads,
            linear_num_value_heads=arch.linear_num_value_heads,
            linear_key_head_dim=arch.linear_key_head_dim,
            linear_value_head_dim=arch.linear_value_head_dim,
            linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        )
    if arch.arch_name == "qwen3_next":
        # dense MLPs in every layer: no experts, every layer listed as MLP-only
        cfg.update(num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1, mlp_only_layers=list(range(arch.num_layers)),
                   moe_intermediate_size=width, shared_expert_intermediate_size=0, norm_topk_prob=True)
    if mtp:
        cfg.update(mtp_num_hidden_layers=1, num_nextn_predict_layers=1, mtp_use_dedicated_embeddings=False)
    if any(w != width for w in widths):
        cfg["cortiq_intermediate_sizes"] = list(widths)
    if mtp and mtp != width:
        cfg["cortiq_mtp_intermediate_size"] = mtp
    return cfg


def runtimes_line(widths: list[int], source: int) -> str:
    """Which runtimes a model of MLP `widths` (per layer) runs smaller than its source's `source` wide MLPs:
    CMF and a Llama's GGUF carry per-layer widths, this export pads them to the widest (see the module doc)."""
    lo, hi = min(widths), max(widths)
    if lo == hi:
        return (f"uniform MLP widths ({hi} of {source}): smaller in every format: CMF, GGUF (llama.cpp) and "
                "Hugging Face (transformers, vLLM)")
    return (f"MLP widths differ per layer ({lo}..{hi} of {source}): smaller in CMF and, for a Llama, GGUF "
            f"(llama.cpp); the Hugging Face export pads every MLP to {hi}, which transformers and vLLM run in "
            "full (--fold-scope per_layer gives uniform widths)")


def tokenizer_files(tok: dict | None, arch: Arch, where: str) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json texts from the CMF tokenizer entry."""
    if not tok or not tok.get("json"):
        raise CortiqError(f"{where}: carries no tokenizer; a Hugging Face export needs one")
    doc = json.loads(tok["json"])
    added = {int(t["id"]): t for t in doc.get("added_tokens", [])}
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(tok["json"])

    def text(i):
        return None if i is None else t.id_to_token(int(i))

    eos = list(tok.get("eos_ids") or [])
    special = {"bos_token": text(tok.get("bos_id")), "eos_token": text(eos[0]) if eos else None}
    special = {k: v for k, v in special.items() if v is not None}
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": arch.max_position_embeddings,
        "added_tokens_decoder": {
            str(i): {k: a.get(k, d) for k, d in (("content", ""), ("lstrip", False), ("normalized", False),
                                                   ("rstrip", False), ("single_word", False), ("special", False))}
            for i, a in sorted(added.items())
        },
    }
    if tok.get("chat_template"):
        tc["chat_template"] = tok["chat_template"]
    gen = {"bos_token_id": tok.get("bos_id"), "eos_token_id": eos[0] if len(eos) == 1 else eos}
    return {
        "tokenizer.json": tok["json"],
        "tokenizer_config.json": json.dumps(tc, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2),
    }


def _fuse_qkvz(arch: Arch, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(in_proj_qkv [2HkDk + HvDv, H], in_proj_z [HvDv, H]) → in_proj_qkvz [Hk·(2Dk + 2rDv), H],
    per key-head group [q(Dk); k(Dk); v(r·Dv); z(r·Dv)]; r = Hv/Hk."""
    hk, hv, dk, dv = arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r, H = hv // hk, qkv.shape[-1]
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], 0)
    g = [q.reshape(hk, dk, H), k.reshape(hk, dk, H), v.reshape(hk, r * dv, H), z.reshape(hk, r * dv, H)]
    return torch.cat(g, 1).reshape(-1, H)


def _fuse_ba(arch: Arch, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(in_proj_b [Hv, H], in_proj_a [Hv, H]) → in_proj_ba [Hk·2r, H], per key-head group [b(r); a(r)]."""
    hk, hv = arch.linear_num_key_heads, arch.linear_num_value_heads
    r, H = hv // hk, b.shape[-1]
    return torch.cat([b.reshape(hk, r, H), a.reshape(hk, r, H)], 1).reshape(-1, H)


def _pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `width` (zero neurons)."""
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def _packed(f: CmfFile, name: str, shape: tuple[int, ...]) -> list[tuple]:
    """The pack-quantized items of a q8 / q4 decoder-layer matrix (see `cortiq.convert.ct`)."""
    codec = f.info(name).codec
    base = hf_name(name)[: -len("weight")]
    cache: dict = {}

    def part(suffix):
        def get():
            if not cache:
                cache.update(ct.pack(codec, f.stored(name), shape))
            return cache.pop(suffix)
        return get

    return [(base + sfx, shp, part(sfx), dt) for sfx, (shp, dt) in ct.packed_shapes(codec, shape).items()]


#: what `export_hf(quantized=)` packs: "exact" the q8 matrices and the q4 ones whose blocks are symmetric
#: (their values survive), "all" every q4 one too (re-derived as symmetric int4), "none" nothing
QUANTIZED = ("exact", "all", "none")


def padded(name: str, shape: tuple[int, ...], width: int) -> bool:
    """True for a narrower layer's MLP matrix, which goes dense, padded to `width` (whatever its codec)."""
    return (name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")) and shape[0] < width) or \
        (name.endswith("mlp.down_proj.weight") and shape[1] < width)


def q4_symmetric(f: CmfFile, width: int) -> dict[str, bool]:
    """Each decoder-layer 4-bit matrix that could go pack-quantized (not padded) → whether every block of
    it is symmetric, so that compressed-tensors' int4 holds its values exactly (one read of each)."""
    out = {}
    for name in f.names:
        codec, shape = f.info(name).codec, tuple(f.info(name).shape)
        if name.startswith("model.layers.") and ct.packable(codec, shape) and ct.SCHEMES[codec][0] == 4 \
                and not padded(name, shape, width):
            out[name] = ct.exact(codec, f.stored(name))
    return out


def packs(f: CmfFile, name: str, shape: tuple[int, ...], quantized: str, symmetric: dict[str, bool]) -> bool:
    """True when decoder-layer matrix `name` goes pack-quantized under `quantized` (QUANTIZED); `symmetric`
    is `q4_symmetric`'s (a q8 matrix is always exact)."""
    codec = f.info(name).codec
    if quantized == "none" or not name.startswith("model.layers.") or not ct.packable(codec, shape):
        return False
    return quantized == "all" or symmetric.get(name, True)


#: the quantization whose q4 blocks an HF export packs exactly (QuantSettings.q4_grid)
SYMMETRIC_HOW = "`cortiq recode --codec q4 --q4-grid symmetric` (any --method)"


def export_notes(widths: list[int], symmetric: dict[str, bool], quantized: str, dtype: str) -> list[str]:
    """What an HF export's reader should know: padded widths, q4 matrices dequantized or re-derived."""
    out = []
    if len(set(widths)) > 1:
        out.append(f"widths differ per layer ({min(widths)}..{max(widths)}): every MLP is padded to {max(widths)} with "
                   "zero neurons, which transformers and vLLM run: no saving there; `cortiq compress --fold-scope "
                   "per_layer` gives uniform widths that keep it")
    odd = sum(not v for v in symmetric.values())
    if odd and quantized == "exact":
        out.append(f"{odd} of {len(symmetric)} q4 matrices written dequantized to {dtype}: their blocks keep a "
                   f"min that compressed-tensors' int4 cannot hold; {SYMMETRIC_HOW} writes q4 that exports exactly "
                   "as 4-bit, --quantized all re-derives 4-bit values, not cortiq's (docs/export.md, 'Quantized "
                   "Hugging Face exports')")
    elif odd and quantized == "all":
        out.append(f"{odd} of {len(symmetric)} q4 matrices written as symmetric int4 (compressed-tensors has no per-block "
                   f"min): their values are re-derived, not cortiq's; {SYMMETRIC_HOW} writes q4 that exports exactly "
                   "(docs/export.md, 'Quantized Hugging Face exports')")
    return out


def hf_tensors(f: CmfFile, width: int, quantized: str = "none", symmetric: dict[str, bool] | None = None) -> list[tuple]:
    """(HF name, shape, getter, safetensors dtype) per tensor of the export, in the file's order; the
    getter gives f32 values written in the export's dtype (dtype None) or a tensor written as it is.
    `quantized` (QUANTIZED): which decoder-layer q8 / q4 matrices that need no padding go pack-quantized
    (`symmetric`: `q4_symmetric`'s, read here when not given)."""
    if symmetric is None:
        symmetric = q4_symmetric(f, width) if quantized == "exact" else {}
    arch = f.arch
    out = []
    fuse = arch.arch_name == "qwen3_next"
    for name in f.names:
        shape = tuple(f.info(name).shape)
        get = (lambda n=name: f.tensor(n))
        if fuse and name.endswith(("linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight")):
            continue  # written with its partner
        if fuse and name.endswith("linear_attn.in_proj_qkv.weight"):
            base = name[: -len("in_proj_qkv.weight")]
            z = base + "in_proj_z.weight"
            shape = (shape[0] + f.info(z).shape[0], shape[1])
            out.append((base + "in_proj_qkvz.weight", shape,
                        lambda n=name, z=z: _fuse_qkvz(arch, f.tensor(n), f.tensor(z)), None))
            continue
        if fuse and name.endswith("linear_attn.in_proj_b.weight"):
            base = name[: -len("in_proj_b.weight")]
            a = base + "in_proj_a.weight"
            out.append((base + "in_proj_ba.weight", (2 * shape[0], shape[1]),
                        lambda n=name, a=a: _fuse_ba(arch, f.tensor(n), f.tensor(a)), None))
            continue
        if padded(name, shape, width):
            dim = 1 if name.endswith("mlp.down_proj.weight") else 0
            shape = (width, shape[1]) if dim == 0 else (shape[0], width)
            get = (lambda n=name, dim=dim: _pad(f.tensor(n), width, dim))
        elif packs(f, name, shape, quantized, symmetric):
            out += _packed(f, name, shape)
            continue
        out.append((hf_name(name), shape, get, None))
    return out


#: safetensors dtype → bytes per element, for the tensors written as they are
_ITEMSIZE = {"I32": 4, "I64": 8, "F16": 2}


def quantized_modules(f: CmfFile, items) -> dict[str, str]:
    """HF module name → cortiq codec of the pack-quantized modules among `items` (a decoder layer's
    HF names are its CMF names)."""
    tail = ".weight_packed"
    return {n[: -len(tail)]: f.info(n[: -len(tail)] + ".weight").codec for n, *_ in items if n.endswith(tail)}


def _nbytes(item, itemsize: int) -> int:
    return math.prod(item[1]) * (_ITEMSIZE[item[3]] if item[3] else itemsize)


def _write_safetensors(path: Path, items, st_dtype: str, dtype: torch.dtype, itemsize: int, progress=None) -> None:
    """One safetensors file, streamed: the header from the planned shapes, then
    each tensor's bytes as its getter gives them (one tensor in memory at a time)."""
    header, off = {}, 0
    for it in items:
        n = _nbytes(it, itemsize)
        header[it[0]] = {"dtype": it[3] or st_dtype, "shape": list(it[1]), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, get, dt in items:
            t = get().contiguous() if dt else get().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape) or _nbytes((name, shape, None, dt), itemsize) != t.numel() * t.element_size():
                raise CortiqError(f"tensor {name}: got shape {list(t.shape)} ({t.dtype}), planned {list(shape)}")
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            fh.write(t.numpy().tobytes())
            if progress:
                progress(name)


def export_hf(model: str | os.PathLike | CmfFile, out_dir: str | os.PathLike, dtype: str = "f32",
              shard_bytes: int = SHARD_BYTES, progress: Callable[[str], None] | None = None,
              force: bool = False, quantized: str = "exact", say: Callable[[str], None] | None = None) -> Path:
    """Write the CMF model as a Hugging Face directory `out_dir` (see the module
    doc). `out_dir` must not exist or be empty (with `force`, whatever is there is
    replaced); it is written as `out_dir.partial` and renamed when complete.
    `quantized` (QUANTIZED): which q8 / q4 decoder-layer matrices go as compressed-tensors
    weights (the others dequantized to `dtype`); `say` gets `export_notes`' lines once it is written."""
    if quantized not in QUANTIZED:
        raise CortiqError(f"quantized {quantized!r} is not one of {', '.join(QUANTIZED)}")
    f = model if isinstance(model, CmfFile) else open_cmf(model)
    out = Path(out_dir)
    verify_file(f)  # what cortiq would refuse to load is not written out for others to load
    if dtype not in DTYPES:
        raise CortiqError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    arch = f.arch
    if arch.arch_name not in FAMILIES:
        raise CortiqError(f"{f.path}: family {arch.arch_name!r} has no Hugging Face export (known: {', '.join(FAMILIES)})")
    check_output(out, list(f.paths), folder=True, kind="new", force=force)
    widths = [f.info(f"model.layers.{i}.mlp.down_proj.weight").shape[1] for i in range(arch.num_layers)]
    mtp = mtp_width(f)
    width = max(widths + ([mtp] if mtp else []))
    files = tokenizer_files(f.tokenizer, arch, str(f.path))
    cfg = config(arch, f.tokenizer, dtype, widths, mtp)
    symmetric = q4_symmetric(f, width) if quantized != "none" else {}
    items = hf_tensors(f, width, quantized, symmetric)
    modules = quantized_modules(f, items)
    if modules:
        cfg["quantization_config"] = ct.quantization_config(modules)
    draft = []
    if arch.arch_name not in MTP_IN_CHECKPOINT:
        draft = [it for it in items if it[0].startswith("mtp.")]
        items = [it for it in items if not it[0].startswith("mtp.")]

    torch_dt, st_dt, _ = DTYPES[dtype]
    itemsize = torch.finfo(torch_dt).bits // 8
    shards: list[list] = [[]]
    size = 0
    for it in items:
        n = _nbytes(it, itemsize)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in files.items():
            (tmp / name).write_text(text)
        if len(shards) == 1:
            _write_safetensors(tmp / "model.safetensors", shards[0], st_dt, torch_dt, itemsize, progress)
        else:
            weight_map, total = {}, 0
            for k, sh in enumerate(shards):
                fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(tmp / fn, sh, st_dt, torch_dt, itemsize, progress)
                for it in sh:
                    weight_map[it[0]] = fn
                    total += _nbytes(it, itemsize)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if draft:
            (tmp / MTP_FILE).parent.mkdir()
            _write_safetensors(tmp / MTP_FILE, draft, st_dt, torch_dt, itemsize, progress)
        replace_dir(tmp, out)  # the old output, if any, goes only once the new one is whole
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and is_full(e):
            raise write_error(out, e) from None
        raise
    for line in export_notes(widths, symmetric, quantized, dtype):
        (say or (lambda m: None))(line)
    return out
