"""A Hugging Face model directory → CMF.

Reads config.json (→ cortiq.arch.from_hf_config), the safetensors weights
(one file, several, or shards named by model.safetensors.index.json; streamed
tensor by tensor), tokenizer.json and tokenizer_config.json, and renames to
the canonical CMF names (docs/internals.md):

- Qwen3.5 multimodal checkpoints: model.language_model.* → model.*; vision
  tensors dropped;
- Qwen3-Next's fused GDN projections in_proj_qkvz / in_proj_ba → the split
  layout in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (un-interleaved per
  key-head group, as transformers' `fix_query_key_value_ordering` reads them);
- the MTP draft `mtp.*` → `model.mtp.*` (fc → eh_proj, pre_fc_norm_embedding →
  enorm, pre_fc_norm_hidden → hnorm), also read from `mtp/model.safetensors`
  (where `cortiq export` puts the draft of a Llama / Qwen2 / Qwen3 model);
- a tied head's stored `lm_head.weight` dropped.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..arch import from_hf_config
from ..cmf import Spec, new_doc, write_cmf
from ..codecs import choose as choose_codec
from ..codecs import get as get_codec
from ..errors import CortiqError
from ..tokenizer import tokenizer_doc

_DROP = re.compile(r"^(model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.|model\.multi_modal_projector\.|.*rotary_emb\.inv_freq$)")
_MOE = re.compile(r"\.mlp\.(experts|gate\.weight|shared_expert|shared_expert_gate)")
_MTP_RENAME = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm."}
_ST_CODEC = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
#: the MTP draft of a family whose checkpoints have none, as `cortiq export` writes it beside them
_MTP_FILE = "mtp/model.safetensors"


def _canonical(name: str) -> str | None:
    """The CMF name of an HF tensor name (None: not carried)."""
    if _DROP.match(name):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith("mtp."):
        rest = name[4:]
        for a, b in _MTP_RENAME.items():
            if rest.startswith(a):
                rest = b + rest[len(a):]
        name = "model.mtp." + rest
    return name


def _weight_files(src: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CortiqError(f"{index}: not a safetensors index (no weight_map)") from None
        out = {}
        for name, fn in wm.items():
            p = src / fn
            if not p.exists():
                raise CortiqError(f"{index}: names shard {fn}, which is missing")
            out[name] = p
        return _add_tensors_of(out, [src / _MTP_FILE] if (src / _MTP_FILE).is_file() else [])
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CortiqError(f"{src}: no *.safetensors weights")
    return _add_tensors_of({}, files + ([src / _MTP_FILE] if (src / _MTP_FILE).is_file() else []))


def _add_tensors_of(out: dict[str, Path], files) -> dict[str, Path]:
    from safetensors import safe_open

    for p in files:
        with safe_open(str(p), framework="pt") as f:
            for name in f.keys():
                out[name] = p
    return out


def _tokenizer(src: Path, cfg: dict) -> dict:
    tj = src / "tokenizer.json"
    if not tj.exists():
        raise CortiqError(f"{src}: no tokenizer.json (cortiq carries the tokenizer inside the model file)")
    text = tj.read_text()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    tc_path = src / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}

    def tid(v):
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    eos = cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    t_eos = tid(tc.get("eos_token"))
    if t_eos is not None and t_eos not in eos_ids:
        eos_ids.append(t_eos)
    bos = cfg.get("bos_token_id")
    if bos is None:
        bos = tid(tc.get("bos_token"))
    template = tc.get("chat_template")
    tmpl_file = src / "chat_template.jinja"
    if template is None and tmpl_file.exists():
        template = tmpl_file.read_text()
    return tokenizer_doc(text, eos_ids, bos, template)


def _split_qkvz(arch, w):
    """in_proj_qkvz [Hk·(2Dk + 2rDv), H] → (qkv [2HkDk + HvDv, H], z [HvDv, H]); r = Hv/Hk.
    HF lays the rows out per key-head group: [q(Dk); k(Dk); v(r·Dv); z(r·Dv)]."""
    import torch

    hk, hv, dk, dv = arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r = hv // hk
    g = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = g.split([dk, dk, r * dv, r * dv], 1)
    H = w.shape[-1]
    return torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)], 0), z.reshape(-1, H)


def _split_ba(arch, w):
    """in_proj_ba [Hk·2r, H] → (b [Hv, H], a [Hv, H]); per key-head group [b(r); a(r)]."""
    hk, hv = arch.linear_num_key_heads, arch.linear_num_value_heads
    r = hv // hk
    b, a = w.reshape(hk, 2 * r, -1).split([r, r], 1)
    return b.reshape(hv, -1), a.reshape(hv, -1)


def _trim_padding(cfg: dict, arch, plan: dict, cfg_path: Path) -> None:
    """Undo the zero-neuron padding of a `cortiq export`: config.json's
    `cortiq_intermediate_sizes` (and `cortiq_mtp_intermediate_size`) give the
    true MLP widths; the padded neurons are cut off again, after checking
    that they are zero (nothing is lost)."""
    widths = cfg.get("cortiq_intermediate_sizes")
    layers = {}
    if widths is not None:
        if not isinstance(widths, list) or len(widths) != arch.num_layers:
            raise CortiqError(f"{cfg_path}: cortiq_intermediate_sizes must list {arch.num_layers} widths")
        arch.intermediate_sizes = [int(w) for w in widths]
        layers = {f"model.layers.{i}.mlp.": int(w) for i, w in enumerate(widths)}
    if arch.mtp_layers and cfg.get("cortiq_mtp_intermediate_size"):
        arch.mtp_intermediate_size = int(cfg["cortiq_mtp_intermediate_size"])
        layers["model.mtp.layers.0.mlp."] = arch.mtp_intermediate_size

    def cut(get, name, w, dim):
        def trimmed():
            t = get()
            if bool(t.narrow(dim, w, t.shape[dim] - w).any()):
                raise CortiqError(f"{cfg_path}: {name} has non-zero neurons past the width {w} that config.json records")
            return t.narrow(dim, 0, w)
        return trimmed

    for base, w in layers.items():
        for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            name = f"{base}{proj}.weight"
            if name not in plan or plan[name][0][dim] == w:
                continue
            shape, dt, get = plan[name]
            if shape[dim] < w:
                raise CortiqError(f"{cfg_path}: {name} is {shape[dim]} wide, narrower than the recorded width {w}")
            shape = tuple(w if d == dim else s for d, s in enumerate(shape))
            plan[name] = (shape, dt, cut(get, name, w, dim))


def convert_hf_dir(src_dir: str | os.PathLike, out_path: str | os.PathLike, codec: str = "keep") -> Path:
    """Convert a HF model directory to a CMF file at `out_path`.

    codec "keep": every tensor as the checkpoint stores it (f32/f16/bf16); a
    codec name: that codec for 2-D weights, the plain source type for norms,
    biases, conv kernels and per-head vectors (quantized codecs do not apply)."""
    import torch
    from safetensors import safe_open

    src = Path(src_dir)
    if not src.is_dir():
        raise CortiqError(f"{src}: not a directory")
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise CortiqError(f"{src}: no config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CortiqError(f"{cfg_path}: not JSON ({e})") from None
    if codec != "keep":
        get_codec(codec)
    arch = from_hf_config(cfg)
    arch.linear_proj_layout = "split"  # the fused layout is split below
    tok = _tokenizer(src, cfg)
    where = _weight_files(src)

    # plan: canonical name → (shape, source dtype, getter)
    handles: dict[Path, object] = {}

    def handle(p: Path):
        if p not in handles:
            handles[p] = safe_open(str(p), framework="pt")
        return handles[p]

    def shape_dtype(hf_name):
        sl = handle(where[hf_name]).get_slice(hf_name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def reader(hf_name):
        return lambda: handle(where[hf_name]).get_tensor(hf_name)

    plan: dict[str, tuple] = {}
    moe = []
    for hf_name in where:
        name = _canonical(hf_name)
        if name is None:
            continue
        if _MOE.search(name):
            moe.append(hf_name)
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        shape, dt = shape_dtype(hf_name)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            H = shape[1]
            hv, dv = arch.linear_num_value_heads, arch.linear_value_head_dim
            qkv_rows = shape[0] - hv * dv
            get = reader(hf_name)
            plan[base + "in_proj_qkv.weight"] = ((qkv_rows, H), dt, lambda g=get: _split_qkvz(arch, g())[0])
            plan[base + "in_proj_z.weight"] = ((hv * dv, H), dt, lambda g=get: _split_qkvz(arch, g())[1])
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            hv, H = arch.linear_num_value_heads, shape[1]
            get = reader(hf_name)
            plan[base + "in_proj_b.weight"] = ((hv, H), dt, lambda g=get: _split_ba(arch, g())[0])
            plan[base + "in_proj_a.weight"] = ((hv, H), dt, lambda g=get: _split_ba(arch, g())[1])
        else:
            plan[name] = (shape, dt, reader(hf_name))
    if moe:
        raise CortiqError(f"{src}: mixture-of-experts MLPs ({moe[0]} ...) are not supported: cortiq runs dense MLPs")
    if any(n.startswith("model.mtp.") for n in plan):
        arch.mtp_layers = max(arch.mtp_layers, 1)
        g = plan.get("model.mtp.layers.0.mlp.gate_proj.weight")
        if g:
            arch.mtp_intermediate_size = g[0][0]
    else:
        arch.mtp_layers, arch.mtp_intermediate_size = 0, 0
    _trim_padding(cfg, arch, plan, cfg_path)

    # every tensor the model needs, and nothing it has no place for
    from ..model.decoder import CausalLM

    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in CausalLM(arch).named_parameters()}
    missing = sorted(set(want) - set(plan))
    extra = sorted(set(plan) - set(want))
    if missing or extra:
        raise CortiqError(
            f"{src}: weights do not match config.json ({arch.arch_name}): "
            + (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}" if extra else "")
        )
    for n, shp in want.items():
        if tuple(plan[n][0]) != shp:
            raise CortiqError(f"{src}: tensor {n} has shape {list(plan[n][0])}, config.json says {list(shp)}")

    specs = []
    for n in want:  # the model's order: embeddings, layers, norm, head
        shape, dt, get = plan[n]
        specs.append(Spec(n, choose_codec(codec, shape, _ST_CODEC.get(dt, "f32")), shape, get))
    doc = new_doc(arch, tok, {"convert": {"source": str(src.resolve()), "format": "hf", "codec": codec}})
    return write_cmf(Path(out_path), doc, specs)
