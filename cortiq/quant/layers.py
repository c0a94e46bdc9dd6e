"""Quantization of a decoder layer's linear weights from the Grams of their inputs.

The linear weights of a layer fall into groups that read one input, so share
one Gram G = Σ x xᵀ of it: q/k/v (the input RMSNorm's output), o (the
attention's output), gate/up (the post-attention RMSNorm's output), down (the
MLP activations). A group is quantized as one matrix, its weights' rows
stacked: GPTQ treats rows independently under a shared Hessian, and a block
codec's blocks lie within rows when the input width is a multiple of the
block, so each weight's bytes are a contiguous slice of the stack's.

AWQ-style scales (per input channel, s = diag(G)^α) are used only where the
inverse scale folds exactly into the op before: the RMSNorm weight before
q/k/v and gate/up, and up_proj's rows before down (the activations are
silu(gate)·up, linear in up's rows). o's input is the attention's output; with
grouped-query attention one v channel feeds several heads' o channels, which
a per-channel scale of o's input does not respect, so o is never scaled.
For each scaled group the exponent is searched on the round-to-nearest error
under G (cheap, vectorised over the grid), then GPTQ runs at that exponent and
at α = 0; the scaled result is kept only when its error under G is lower. A
group whose best GPTQ result has no lower error under G than round-to-nearest
is written round-to-nearest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import codecs
from ..arch import FULL
from ..compress.gptq_solver import gptq_quantize


@dataclass(frozen=True)
class Group:
    """Linear weights of one layer that read the same input."""

    #: the Gram's name within the layer
    key: str
    #: module paths within the layer (e.g. "self_attn.q_proj")
    mods: tuple[str, ...]
    #: the module whose input the Gram is taken of (the first of `mods`)
    hook: str
    #: where 1/s folds: ("norm", path) an RMSNorm weight, ("rows", path) a linear's output rows, None: no scales
    fold: tuple[str, str] | None


def groups(layer) -> list[Group]:
    """The groups of a decoder layer, in the order they are quantized (down before
    gate/up: down's scales fold into up's rows, which are then quantized)."""
    out = []
    if layer.kind == FULL:
        out += [Group("attn_in", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.q_proj",
                      ("norm", "input_layernorm")),
                Group("o_in", ("self_attn.o_proj",), "self_attn.o_proj", None)]
    out += [Group("down_in", ("mlp.down_proj",), "mlp.down_proj", ("rows", "mlp.up_proj")),
            Group("mlp_in", ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj", ("norm", "post_attention_layernorm"))]
    return out


def more_bits(n_layers: int, rule: str) -> set[int]:
    """The decoder layers whose down_proj a 4-bit file writes at q8 (QuantSettings.down_8bit): "none";
    "ends": the first and last eighth of the layers and every third layer between them (the layers
    llama.cpp's Q4_K_M mix gives its ffn_down more bits); "all"."""
    if rule == "none":
        return set()
    if rule == "all":
        return set(range(n_layers))
    if rule == "ends":
        lo, hi = n_layers / 8, 7 * n_layers / 8
        return {i for i in range(n_layers) if i < lo or i >= hi or (i - int(lo)) % 3 == 2}
    raise ValueError(f"down_8bit {rule!r}: one of none, ends, all")


def gram_error(D: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """‖D X‖² under the Gram: Σ_o (D G Dᵀ)_oo, for D [..., R, C] (f64) → [...]."""
    return ((D @ G) * D).sum((-2, -1)).clamp_min(0)


def _scales(G: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """s [A, C] = d^α normalised to geometric mean 1 (d: diag G, dead channels lifted to the least live one)."""
    d = torch.diagonal(G).clamp_min(0)
    live = d[d > 0]
    d = d.clamp_min(live.min() if live.numel() else 1.0)
    s = d[None, :] ** alphas[:, None]  # [A, C]
    return s / s.log().mean(-1, keepdim=True).exp()


#: scaled weights at most this large keep their blocks' f16 scale and min finite (f16's largest is 65504)
F16_ROOM = 2.0 ** 15


def search_alpha(W: torch.Tensor, G: torch.Tensor, codec_name: str, grid: int,
                 q4_grid: str = "asymmetric") -> tuple[float, torch.Tensor]:
    """The exponent of the grid whose round-to-nearest error of W [R, C] scaled
    by s = diag(G)^α is least under G (q4 blocks on `q4_grid`): (α, s [C])."""
    c = codecs.encoder(codec_name, q4_grid)
    alphas = torch.linspace(0, 1, grid, dtype=torch.float64, device=W.device)
    S = _scales(G, alphas)  # [A, C]
    Wd = W.double()
    Ws = Wd[None] * S[:, None, :]  # [A, R, C]: every candidate at once
    # a channel of massive activations (diag G many orders of magnitude over the rest; the real
    # SmolLM2 pruned and healed has them) makes s so large on it that the scaled weights leave the
    # codec's f16 scales and mins: such a candidate cannot be stored, so it is not a candidate
    # (α = 0, s = 1, always is)
    ok = Ws.abs().amax((1, 2)) < F16_ROOM
    err = torch.full((len(alphas),), math.inf, dtype=torch.float64, device=W.device)
    Wq = c.roundtrip(Ws[ok].float()).double() / S[ok][:, None, :]
    err[ok] = gram_error(Wd[None] - Wq, G)  # [A]
    best = int(torch.argmin(err))
    return float(alphas[best]), S[best]


@dataclass
class LayerResult:
    #: weight name within the layer -> the codec's bytes
    stored: dict[str, torch.Tensor]
    #: per group: {"group", "method", "alpha", "err", "err_rtn"}
    rows: list[dict]


def _submodule(layer, path: str):
    m = layer
    for p in path.split("."):
        m = getattr(m, p)
    return m


def _fold_norm(norm, s: torch.Tensor) -> None:
    """norm(x)·diag(1/s): the weight w (or 1 + w, offset style) divided by s."""
    w = norm.weight
    if norm.offset:
        w.copy_(((1.0 + w.double()) / s - 1.0).to(w.dtype))
    else:
        w.copy_((w.double() / s).to(w.dtype))


@torch.no_grad()
def quantize_layer(layer, grams: dict[str, torch.Tensor], codec_name: str, method: str, block: int = 128,
                   damp: float = 0.01, act_order: bool = False, awq_grid: int = 11, clip_grid: int = 1,
                   codec_of: dict[str, str] | None = None, q4_grid: str = "asymmetric") -> LayerResult:
    """Quantize `layer`'s grouped linear weights in place (each left at its
    dequantized values, folded norms and rows changed with them) from the
    Grams of their inputs; returns each weight's codec bytes. `codec_of`:
    groups written in another codec than `codec_name` ({group key: codec});
    `q4_grid` (codecs.Q4_GRIDS): where every q4 block goes, by each method."""
    stored, rows = {}, []
    grids = {"clip_grid": clip_grid, "q4_grid": q4_grid}
    for g in groups(layer):
        codec = (codec_of or {}).get(g.key, codec_name)
        row = _quantize_group(layer, g, grams[g.key], codec, method, block, damp, act_order, awq_grid, grids, stored)
        rows.append({**row, "codec": codec})
    return LayerResult(stored, rows)


def _rounded(g: Group, mods, c, err_rtn: float, stored: dict) -> dict:
    """The group's weights round-to-nearest in codec `c` (in place, bytes into `stored`); its report row."""
    for name, m in zip(g.mods, mods):
        stored[name] = c.encode(m.weight.detach().float().cpu())
        m.weight.copy_(c.roundtrip(m.weight.detach().float()).to(m.weight.dtype))
    return {"group": g.key, "method": "rtn", "alpha": 0.0, "err": err_rtn, "err_rtn": err_rtn}


def _quantize_group(layer, g: Group, G: torch.Tensor, codec_name: str, method: str, block: int, damp: float,
                    act_order: bool, awq_grid: int, grids: dict, stored: dict) -> dict:
    """One group of `quantize_layer`: its weights' bytes into `stored`; its report row. `grids`: gptq_quantize's
    clip_grid and q4_grid."""
    c = codecs.encoder(codec_name, grids["q4_grid"])
    mods = [_submodule(layer, m) for m in g.mods]
    G = G.to(mods[0].weight.device, torch.float64)
    sizes = [int(m.weight.shape[0]) for m in mods]
    W = torch.cat([m.weight.detach().float() for m in mods])  # [R, C]
    C = W.shape[1]
    err_rtn = float(gram_error(W.double() - c.roundtrip(W).double(), G))
    if C % c.block:
        # blocks straddle rows: no per-row grid to optimise, each weight round-to-nearest
        return _rounded(g, mods, c, err_rtn, stored)
    r = gptq_quantize(W, G, codec_name, block, damp, act_order, **grids)
    best = {"res": r, "s": None, "alpha": 0.0, "err": float(gram_error(W.double() - r.weight.double(), G))}
    if method == "awq" and g.fold is not None:
        alpha, s = search_alpha(W, G, codec_name, awq_grid, grids["q4_grid"])
        if alpha > 0:
            Gs = G / (s[:, None] * s[None, :])  # the Gram of the inputs scaled by 1/s
            rs = gptq_quantize((W.double() * s).float(), Gs, codec_name, block, damp, act_order, **grids)
            e = float(gram_error(W.double() - rs.weight.double() / s, G))
            if e < best["err"]:
                best = {"res": rs, "s": s, "alpha": alpha, "err": e}
    if best["err"] >= err_rtn:
        # GPTQ's greedy error feedback can lose to plain rounding under the very Gram it minimises (weights
        # already on the codec's grid, which rounding reproduces exactly: the bundled SmolLM2's in q4, where
        # GPTQ without act-order had 0.8-7.9x its error); the group then stays round-to-nearest
        return _rounded(g, mods, c, err_rtn, stored)
    r, s = best["res"], best["s"]
    if s is not None:
        kind, path = g.fold
        if kind == "norm":
            _fold_norm(_submodule(layer, path), s)
        else:
            # the rows that make the group's input channels: up_proj's output rows
            up = _submodule(layer, path)
            up.weight.copy_((up.weight.double() / s[:, None]).to(up.weight.dtype))
    per_row = c.nbytes((C,))  # whole blocks per row
    a = 0
    for name, m, n in zip(g.mods, mods, sizes):
        stored[name] = r.stored[a * per_row : (a + n) * per_row].clone()
        m.weight.copy_(r.weight[a : a + n].to(m.weight.dtype))
        a += n
    return {"group": g.key, "method": "awq" if s is not None else r.method, "alpha": best["alpha"],
            "err": best["err"], "err_rtn": err_rtn}
