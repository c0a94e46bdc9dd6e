"""The model geometry a CMF file records (`arch` in its header).

One dataclass for the decoder family cortiq runs: Llama, Qwen2, Qwen3 and the
Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet + gated full attention, dense
SwiGLU MLPs). Everything a model needs to be built is here; nothing is read
from a hub.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ArchError(f"unknown arch keys {unknown}")
        return cls(**d)


def from_hf_config(cfg: dict) -> Arch:
    """An Arch from a Hugging Face `config.json` (dict). Raises ArchError naming
    an unsupported architecture and listing the supported ones."""
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
    n = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
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
