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
- a tied head's stored `lm_head.weight` dropped;
- compressed-tensors pack-quantized modules (`weight_packed`, `weight_scale`,
  `weight_shape`; symmetric int8 in groups of 32, int4 in groups of 32 or 64,
  as `cortiq export` writes them) → q8 / q4 / q4_64 blocks of the same values
  (`cortiq.convert.ct.unpack`), kept as such with codec "keep".
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..arch import from_hf_config
from ..cmf import Spec, new_doc, regular_size, write_cmf
from ..codecs import choose_codec
from ..codecs import get as get_codec
from ..errors import CortiqError
from ..tokenizer import tokenizer_doc

_DROP = re.compile(r"^(model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.|model\.multi_modal_projector\.|.*rotary_emb\.inv_freq$)")
_MOE = re.compile(r"\.mlp\.(experts|gate\.weight|shared_expert|shared_expert_gate)")
_MTP_RENAME = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm."}
_ST_CODEC = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
#: the codecs pack-quantized modules read back as
_PACKED = ("q8", "q4", "q4_64")
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


#: the most a JSON file of a model folder (config, tokenizer config, index) may hold
_JSON_MAX = 64 << 20
#: the most tokenizer.json may hold (a 256k vocabulary with merges is ~30 MB)
_TOKENIZER_MAX = 512 << 20


def _allowed_root(src: Path) -> Path:
    """The folder every file of the model must resolve into: the model folder itself or, for a
    Hugging Face cache snapshot (`.../models--org--name/snapshots/REV`, whose files are symlinks
    to `../../blobs/`), the cached repository that holds both."""
    root = src.resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def _inside(src: Path, rel, what: str) -> Path:
    """`src / rel`, refused when `rel` is absolute or it (symlinks followed) leaves the model folder:
    a model's metadata must not make cortiq read files elsewhere."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise CortiqError(f"{src}: {what} {str(rel)[:80]!r} is not a file name")
    if os.path.isabs(rel) or rel.startswith("~"):
        raise CortiqError(f"{src}: {what} {rel[:200]!r} is an absolute path: the model's files must lie in its folder")
    p = src / rel
    if not p.resolve().is_relative_to(_allowed_root(src)):
        raise CortiqError(f"{src}: {what} {rel[:200]!r} leads outside the model folder (to {p.resolve()})")
    return p


def _regular(p: Path, limit: int | None = None) -> int:
    """The size of `p`, a regular file of the model folder, at most `limit` bytes."""
    return regular_size(p, limit, "model file", CortiqError)


def _read_text(p: Path, limit: int) -> str:
    _regular(p, limit)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CortiqError(f"{p}: not UTF-8 text") from None


def _read_json(p: Path, limit: int = _JSON_MAX) -> dict:
    """A JSON object from `p`, or one line saying what is wrong with it."""
    try:
        v = json.loads(_read_text(p, limit))
    except json.JSONDecodeError as e:
        raise CortiqError(f"{p}: not JSON ({e})") from None
    except RecursionError:
        raise CortiqError(f"{p}: nested too deeply") from None
    if not isinstance(v, dict):
        raise CortiqError(f"{p}: holds a JSON {type(v).__name__}, not an object")
    return v


def _weight_files(src: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it (plus an exported MTP draft's file)."""
    index = src / "model.safetensors.index.json"
    mtp = [_inside(src, _MTP_FILE, "the MTP weights file")] if os.path.lexists(src / _MTP_FILE) else []
    if os.path.lexists(index):
        _inside(src, index.name, "the index")
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CortiqError(f"{index}: not a safetensors index (no weight_map table)")
        out, seen = {}, {}
        for name, fn in wm.items():
            if fn not in seen:
                p = _inside(src, fn, "the weight_map entry")
                if not p.exists():
                    raise CortiqError(f"{index}: names shard {fn}, which is missing")
                _regular(p)
                seen[fn] = p
            out[name] = seen[fn]
        return _add_tensors_of(out, mtp)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CortiqError(f"{src}: no *.safetensors weights")
    return _add_tensors_of({}, [_inside(src, p.name, "the weights file") for p in files] + mtp)


def _add_tensors_of(out: dict[str, Path], files) -> dict[str, Path]:
    from safetensors import safe_open

    for p in files:
        _regular(p)
        try:
            with safe_open(str(p), framework="pt") as f:
                for name in f.keys():
                    out[name] = p
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error type on a damaged file)
            raise CortiqError(f"{p}: not a readable safetensors file ({_one_line(e)})") from None
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _template(tc: dict, src: Path):
    """The chat template of tokenizer_config.json (or chat_template.jinja): a string, or the
    `default` one of a list of named templates; checked in the sandbox before it is stored."""
    from ..chat import validate_template

    template = tc.get("chat_template")
    where = src / "tokenizer_config.json"
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    tmpl_file = src / "chat_template.jinja"
    if template is None and os.path.lexists(tmpl_file):
        template = _read_text(_inside(src, tmpl_file.name, "the chat template"), _JSON_MAX)
        where = tmpl_file
    if template is not None and not isinstance(template, str):
        raise CortiqError(f"{where}: chat_template is {type(template).__name__}, not a string")
    validate_template(template, str(where))
    return template


def _tokenizer(src: Path, cfg: dict) -> dict:
    tj = src / "tokenizer.json"
    if not os.path.lexists(tj):
        raise CortiqError(f"{src}: no tokenizer.json (cortiq carries the tokenizer inside the model file)")
    text = _read_text(_inside(src, tj.name, "tokenizer.json"), _TOKENIZER_MAX)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        raise CortiqError(f"{tj}: not a tokenizer the tokenizers library reads ({_one_line(e)})") from None
    tc_path = src / "tokenizer_config.json"
    tc = _read_json(_inside(src, tc_path.name, "tokenizer_config.json")) if os.path.lexists(tc_path) else {}

    def tid(v):
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    def ids(v, key):
        if v is None:
            return []
        v = [v] if isinstance(v, int) and not isinstance(v, bool) else v
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 31 for i in v):
            raise CortiqError(f"{src / 'config.json'}: {key} is {str(v)[:80]}, not a token id or a list of them")
        return list(v)

    eos_ids = ids(cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id")), "eos_token_id")
    t_eos = tid(tc.get("eos_token"))
    if t_eos is not None and t_eos not in eos_ids:
        eos_ids.append(t_eos)
    bos = ids(cfg.get("bos_token_id"), "bos_token_id")
    bos = bos[0] if bos else tid(tc.get("bos_token"))
    return tokenizer_doc(text, eos_ids, bos, _template(tc, src), where=str(tj))


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


def _config(src: Path, codec: str) -> tuple[dict, Path, object]:
    """(config.json, its path, the arch it describes), the codec name checked."""
    if not src.is_dir():
        raise CortiqError(f"{src}: not a directory")
    cfg_path = src / "config.json"
    if not os.path.lexists(cfg_path):
        raise CortiqError(f"{src}: no config.json")
    cfg = _read_json(_inside(src, cfg_path.name, "config.json"))
    if codec != "keep":
        get_codec(codec)
    try:
        arch = from_hf_config(cfg)
    except CortiqError as e:
        raise CortiqError(f"{cfg_path}: {e}") from None
    arch.linear_proj_layout = "split"  # the fused layout is split below
    return cfg, cfg_path, arch


class _Tensors:
    """The checkpoint's tensors by HF name, read one at a time; each file opened once."""

    def __init__(self, where: dict[str, Path]):
        self.where = where
        self.handles: dict[Path, object] = {}

    def _handle(self, p: Path):
        from safetensors import safe_open

        if p not in self.handles:
            self.handles[p] = safe_open(str(p), framework="pt")
        return self.handles[p]

    def shape_dtype(self, hf_name: str) -> tuple[tuple, str]:
        try:
            sl = self._handle(self.where[hf_name]).get_slice(hf_name)
            return tuple(sl.get_shape()), sl.get_dtype()
        except Exception as e:  # noqa: BLE001 (safetensors' own error type)
            raise CortiqError(f"{self.where[hf_name]}: cannot read tensor {hf_name!r} ({_one_line(e)})") from None

    def read(self, hf_name: str):
        try:
            return self._handle(self.where[hf_name]).get_tensor(hf_name)
        except Exception as e:  # noqa: BLE001
            raise CortiqError(f"{self.where[hf_name]}: cannot read tensor {hf_name!r} ({_one_line(e)})") from None

    def reader(self, hf_name: str):
        return lambda: self.read(hf_name)


def _packed_entry(tensors: _Tensors, scheme: dict, module: str, where: Path) -> tuple:
    """(shape, codec, getter of the codec's bytes) of a pack-quantized module."""
    from ..cmf import Stored
    from . import ct

    key = next((k for t, k in scheme.items() if t == module or t == "Linear"
                or (t.startswith("re:") and re.match(t[3:], module))), None)
    if key is None:
        raise CortiqError(f"{where}: {module} is packed but no quantization group of config.json names it")
    shape = tuple(int(x) for x in tensors.read(module + ".weight_shape").tolist())
    bits, group = key
    if len(shape) != 2 or shape[1] % group:
        raise CortiqError(f"{where}: {module}.weight_shape {list(shape)} is not a matrix of whole groups of {group}")

    def get():
        return Stored(ct.unpack(bits, group, tensors.read(module + ".weight_packed"),
                                tensors.read(module + ".weight_scale"), shape))
    return shape, ct.CODEC_OF[key], get


def _plan(src: Path, arch, tensors: _Tensors, scheme: dict | None = None) -> dict[str, tuple]:
    """Canonical name → (shape, source dtype or codec, getter) of every tensor carried, the fused GDN
    projections split, pack-quantized modules as cortiq blocks (`scheme`: their groups); a
    mixture-of-experts checkpoint is refused."""
    plan: dict[str, tuple] = {}
    moe = []
    for hf_name in tensors.where:
        name = _canonical(hf_name)
        if name is None or (scheme is not None and name.endswith((".weight_scale", ".weight_shape"))):
            continue
        if scheme is not None and name.endswith(".weight_packed"):
            plan[name[: -len("_packed")]] = _packed_entry(tensors, scheme, hf_name[: -len(".weight_packed")],
                                                          src / "config.json")
            continue
        if _MOE.search(name):
            moe.append(hf_name)
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        shape, dt = tensors.shape_dtype(hf_name)
        get = tensors.reader(hf_name)
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            H = shape[1]
            hv, dv = arch.linear_num_value_heads, arch.linear_value_head_dim
            qkv_rows = shape[0] - hv * dv
            plan[base + "in_proj_qkv.weight"] = ((qkv_rows, H), dt, lambda g=get: _split_qkvz(arch, g())[0])
            plan[base + "in_proj_z.weight"] = ((hv * dv, H), dt, lambda g=get: _split_qkvz(arch, g())[1])
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            hv, H = arch.linear_num_value_heads, shape[1]
            plan[base + "in_proj_b.weight"] = ((hv, H), dt, lambda g=get: _split_ba(arch, g())[0])
            plan[base + "in_proj_a.weight"] = ((hv, H), dt, lambda g=get: _split_ba(arch, g())[1])
        else:
            plan[name] = (shape, dt, get)
    if moe:
        raise CortiqError(f"{src}: mixture-of-experts MLPs ({moe[0]} ...) are not supported: cortiq runs dense MLPs")
    return plan


def _mtp_geometry(arch, plan: dict) -> None:
    """The arch's MTP block as the tensors have it (none when they hold no `model.mtp.*`)."""
    if any(n.startswith("model.mtp.") for n in plan):
        arch.mtp_layers = max(arch.mtp_layers, 1)
        g = plan.get("model.mtp.layers.0.mlp.gate_proj.weight")
        if g:
            arch.mtp_intermediate_size = g[0][0]
    else:
        arch.mtp_layers, arch.mtp_intermediate_size = 0, 0


def _model_shapes(src: Path, arch, plan: dict) -> dict[str, tuple]:
    """The model's parameters (name → shape, in the model's order: embeddings, layers, norm,
    head), refused unless the planned tensors are exactly these."""
    import torch

    # the layer count against the tensors present, before a model of that many layers is planned
    layers = {int(m.group(1)) for n in plan if (m := re.match(r"model\.layers\.(\d{1,9})\.", n))}
    if layers != set(range(arch.num_layers)):
        raise CortiqError(f"{src}: config.json says {arch.num_layers} layers, the weights hold "
                          f"{len(layers)} ({'layers ' + str(min(layers)) + '..' + str(max(layers)) if layers else 'none'})")

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
    return want


def convert_hf_dir(src_dir: str | os.PathLike, out_path: str | os.PathLike, codec: str = "keep") -> Path:
    """Convert a HF model directory to a CMF file at `out_path`.

    codec "keep": every tensor as the checkpoint stores it (f32/f16/bf16); a
    codec name: that codec for 2-D weights, the plain source type for norms,
    biases, conv kernels and per-head vectors (quantized codecs do not apply)."""
    src = Path(src_dir)
    cfg, cfg_path, arch = _config(src, codec)
    tok = _tokenizer(src, cfg)
    from .ct import read_scheme

    plan = _plan(src, arch, _Tensors(_weight_files(src)), read_scheme(cfg.get("quantization_config"), str(cfg_path)))
    _mtp_geometry(arch, plan)
    _trim_padding(cfg, arch, plan, cfg_path)
    specs = []
    for n in _model_shapes(src, arch, plan):
        shape, dt, get = plan[n]
        current = _ST_CODEC.get(dt, dt if dt in _PACKED else "f32")
        want = choose_codec(codec, shape, current, n)
        if current in _PACKED and want != current:  # another codec: from the packed values
            get = (lambda g=get, c=current, shp=shape: get_codec(c).decode(g().data, shp))
        specs.append(Spec(n, want, shape, get))
    doc = new_doc(arch, tok, {"convert": {"source": str(src.resolve()), "format": "hf", "codec": codec}})
    return write_cmf(Path(out_path), doc, specs)
