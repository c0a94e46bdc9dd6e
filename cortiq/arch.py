"""The model geometry a CMF file records (`arch` in its header).

One dataclass for the decoder family cortiq runs: Llama, Qwen2, Qwen3 and the
Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet + gated full attention, dense
SwiGLU MLPs). Everything a model needs to be built is here; nothing is read
from a hub.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields

from .errors import CortiqError

FULL = "full_attention"
LINEAR = "linear_attention"
LAYER_TYPES = (FULL, LINEAR)

#: architectures the converters read (the HF `model_type` and what it maps to)
SUPPORTED = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
}


class ArchError(CortiqError, ValueError):
    """A geometry cortiq cannot build."""


# Bounds on what an arch may say, checked before anything is sized from it: a
# 100-byte header must not plan a model of 10**8 layers. They are well above
# every released decoder (the largest have ~128 layers, hidden 16k, vocab 256k,
# MLP 53k, 128 heads of 256).
_INT_BOUNDS = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "num_layers": (1, 1 << 10),
    "num_heads": (1, 1 << 10),
    "num_kv_heads": (1, 1 << 10),
    "head_dim": (1, 1 << 12),
    "linear_num_key_heads": (0, 1 << 10),
    "linear_num_value_heads": (0, 1 << 10),
    "linear_key_head_dim": (0, 1 << 12),
    "linear_value_head_dim": (0, 1 << 12),
    "linear_conv_kernel_dim": (1, 64),
    "mtp_layers": (0, 8),
    "mtp_intermediate_size": (0, 1 << 20),
    "max_position_embeddings": (1, 1 << 26),
}
#: one MLP width
_WIDTH_MAX = 1 << 20
_FLOAT_BOUNDS = {
    "rope_theta": (1e-3, 1e12),
    "partial_rotary_factor": (0.0, 1.0),
    "rms_norm_eps": (0.0, 1.0),
}
_BOOLS = ("attention_bias", "qk_norm", "attn_output_gate", "tie_word_embeddings")
_STRINGS = {"arch_name": None, "norm_style": ("weight", "offset"), "linear_proj_layout": ("qkvz", "split")}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(a: "Arch") -> None:
    """Types and bounds of every field: ints are ints, floats finite, booleans booleans,
    lists no longer than the layer count. Nothing is built before this passes."""
    for k, (lo, hi) in _INT_BOUNDS.items():
        v = getattr(a, k)
        if not _is_int(v):
            raise ArchError(f"{k} is {type(v).__name__} {v!r}, not an integer")
        if not lo <= v <= hi:
            raise ArchError(f"{k} {v} is out of range [{lo}, {hi}]")
    for k, (lo, hi) in _FLOAT_BOUNDS.items():
        v = getattr(a, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ArchError(f"{k} is {type(v).__name__} {v!r}, not a finite number")
        if not lo <= v <= hi:
            raise ArchError(f"{k} {v} is out of range [{lo:g}, {hi:g}]")
        setattr(a, k, float(v))
    for k in _BOOLS:
        v = getattr(a, k)
        if not isinstance(v, bool):
            raise ArchError(f"{k} is {type(v).__name__} {v!r}, not true or false")
    for k, allowed in _STRINGS.items():
        v = getattr(a, k)
        if not isinstance(v, str) or len(v) > 64:
            raise ArchError(f"{k} is {type(v).__name__}, not a short string")
        if allowed and v not in allowed:
            raise ArchError(f"{k} {v!r} is not one of {', '.join(allowed)}")
    n = a.num_layers
    w = a.intermediate_sizes
    if _is_int(w):
        w = [w]
    if not isinstance(w, list) or len(w) not in (1, n) or not all(_is_int(x) and 1 <= x <= _WIDTH_MAX for x in w):
        raise ArchError(f"intermediate_sizes must be {n} integers in [1, {_WIDTH_MAX}] (one per layer)")
    t = a.layer_types
    if not isinstance(t, list) or len(t) not in (0, n) or not all(isinstance(x, str) for x in t):
        raise ArchError(f"layer_types must be a list of {n} strings (one per layer)")
    if a.num_kv_heads > a.num_heads:
        raise ArchError(f"num_kv_heads {a.num_kv_heads} exceeds num_heads {a.num_heads}")
    _check_rope_scaling(a.rope_scaling)


def _check_rope_scaling(sc) -> None:
    if sc is None:
        return
    if not isinstance(sc, dict) or len(sc) > 32 or not all(isinstance(k, str) for k in sc):
        raise ArchError(f"rope_scaling is {type(sc).__name__}, not a small table")
    for k, v in sc.items():
        if v is not None and not isinstance(v, (bool, int, float, str)) and not (
                isinstance(v, list) and len(v) <= 1024 and all(isinstance(x, (int, float)) for x in v)):
            raise ArchError(f"rope_scaling.{k} is {type(v).__name__}, not a number or string")
        if isinstance(v, float) and not math.isfinite(v):
            raise ArchError(f"rope_scaling.{k} is {v}, not finite")
    kind = sc.get("rope_type", sc.get("type"))
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(kind, ())
    for k in need:
        v = sc.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e9:
            raise ArchError(f"rope_scaling.{k} of {kind} scaling is {v!r}, not a positive number")
    if kind == "llama3" and not sc["high_freq_factor"] > sc["low_freq_factor"]:
        raise ArchError("rope_scaling: llama3 scaling needs high_freq_factor > low_freq_factor")


@dataclass
class Arch:
    # ── identity and size ──
    #: family name: llama, qwen2, qwen3, qwen3_next, qwen3_5
    arch_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    #: MLP width per layer (a fold makes them differ)
    intermediate_sizes: list[int]

    # ── full attention ──
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    #: share of head_dim that is rotated (Qwen3-Next: 0.25)
    partial_rotary_factor: float = 1.0
    #: Llama-3 style rope scaling etc., as the HF config gives it (None: plain RoPE)
    rope_scaling: dict | None = None
    #: bias on q/k/v projections (Qwen2)
    attention_bias: bool = False
    #: RMSNorm on each head's q and k (Qwen3, Qwen3-Next)
    qk_norm: bool = False
    #: sigmoid output gate: q_proj emits [query; gate] per head (Qwen3-Next)
    attn_output_gate: bool = False

    # ── norms ──
    rms_norm_eps: float = 1e-6
    #: "weight": w·x̂ (Llama, Qwen3); "offset": (1+w)·x̂ (Qwen3-Next, Gemma)
    norm_style: str = "weight"

    # ── layers ──
    #: per layer: full_attention or linear_attention
    layer_types: list[str] = field(default_factory=list)

    # ── Gated DeltaNet (linear attention) ──
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    #: "qkvz": fused in_proj_qkvz + in_proj_ba (Qwen3-Next);
    #: "split": in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5)
    linear_proj_layout: str = "split"

    # ── head and draft ──
    tie_word_embeddings: bool = False
    #: number of MTP draft layers carried under model.mtp.* (0 or 1)
    mtp_layers: int = 0
    #: MLP width of the MTP block's layer (0: the last trunk layer's width)
    mtp_intermediate_size: int = 0
    max_position_embeddings: int = 32768

    def __post_init__(self):
        _check_fields(self)
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers
        if isinstance(self.intermediate_sizes, int):
            self.intermediate_sizes = [self.intermediate_sizes] * self.num_layers
        self.intermediate_sizes = [int(x) for x in self.intermediate_sizes]
        if len(self.layer_types) != self.num_layers:
            raise ArchError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if len(self.intermediate_sizes) != self.num_layers:
            raise ArchError(f"{len(self.intermediate_sizes)} MLP widths for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ArchError(f"unknown layer types {bad} (known: {', '.join(LAYER_TYPES)})")
        if self.norm_style not in ("weight", "offset"):
            raise ArchError(f"norm_style {self.norm_style!r} is neither 'weight' nor 'offset'")
        if self.num_heads % max(self.num_kv_heads, 1):
            raise ArchError(f"{self.num_heads} heads do not group over {self.num_kv_heads} KV heads")
        if LINEAR in self.layer_types and not (self.linear_num_key_heads and self.linear_num_value_heads):
            raise ArchError("linear_attention layers need linear_num_key_heads and linear_num_value_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Arch":
        if not isinstance(d, dict):
            raise ArchError(f"the arch is {type(d).__name__}, not a table")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ArchError(f"unknown arch keys {[str(k)[:40] for k in unknown[:8]]}")
        need = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in d)
        if need:
            raise ArchError(f"arch keys missing: {need}")
        return cls(**d)


def from_hf_config(cfg: dict) -> Arch:
    """An Arch from a Hugging Face `config.json` (dict). Raises ArchError naming
    an unsupported architecture and listing the supported ones, or the key
    that is missing or of the wrong type."""
    if not isinstance(cfg, dict):
        raise ArchError(f"the config is {type(cfg).__name__}, not a JSON object")
    try:
        return _from_hf_config(cfg)
    except KeyError as e:
        raise ArchError(f"config key {e} is missing") from None
    except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
        if isinstance(e, ArchError):
            raise
        raise ArchError(f"a config value has the wrong type or value ({e})") from None


def _hf_int(cfg: dict, key: str, default=None) -> int:
    """An integer config value: a float or string is refused, not truncated."""
    v = cfg[key] if default is None else cfg.get(key, default)
    if not _is_int(v):
        raise ArchError(f"config {key} is {type(v).__name__} {v!r}, not an integer")
    return v


def _from_hf_config(cfg: dict) -> Arch:
    mt = cfg.get("model_type", "")
    if mt == "qwen3_5" and "text_config" in cfg:
        outer = cfg
        cfg = dict(cfg["text_config"])
        cfg.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", False))
        mt = "qwen3_5"
    if mt not in SUPPORTED:
        raise ArchError(
            f"unsupported architecture {mt or '(no model_type)'!r}; supported: {', '.join(sorted(set(SUPPORTED)))}"
        )
    name = SUPPORTED[mt]
    n = _hf_int(cfg, "num_hidden_layers")
    heads = _hf_int(cfg, "num_attention_heads")
    hidden = _hf_int(cfg, "hidden_size")
    if not 1 <= n <= _INT_BOUNDS["num_layers"][1]:
        raise ArchError(f"num_hidden_layers {n} is out of range [1, {_INT_BOUNDS['num_layers'][1]}]")
    if heads < 1:
        raise ArchError(f"num_attention_heads {heads} is not positive")
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    prf = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") not in ("default", None):
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default", None):
        scaling = None
    hybrid = name in ("qwen3_next", "qwen3_5")
    if hybrid:
        if name == "qwen3_next":
            prf = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))
            sparse = int(cfg.get("decoder_sparse_step", 1))
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = [i for i in range(n) if i not in dense and cfg.get("num_experts", 0) > 0 and sparse > 0 and (i + 1) % sparse == 0]
            if moe:
                raise ArchError(
                    f"qwen3_next with mixture-of-experts MLPs (layers {moe[:4]}...) is not supported: cortiq runs dense MLPs"
                )
        else:
            prf = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))
        types = cfg.get("layer_types") or [
            LINEAR if (i + 1) % int(cfg.get("full_attention_interval", 4)) else FULL for i in range(n)
        ]
    else:
        types = [FULL] * n
    mtp = int(cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers", 0)) or 0)
    return Arch(
        arch_name=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=n,
        intermediate_sizes=[int(cfg["intermediate_size"])] * n,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        rope_scaling=scaling,
        attention_bias=bool(cfg.get("attention_bias", name == "qwen2")) or name == "qwen2",
        qk_norm=name in ("qwen3", "qwen3_next", "qwen3_5"),
        attn_output_gate=hybrid,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        norm_style="offset" if hybrid else "weight",
        layer_types=list(types),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 0)) if hybrid else 0,
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 0)) if hybrid else 0,
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 0)) if hybrid else 0,
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 0)) if hybrid else 0,
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_proj_layout="qkvz" if name == "qwen3_next" else "split",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=mtp,
        mtp_intermediate_size=int(cfg["intermediate_size"]) if mtp else 0,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
    )
