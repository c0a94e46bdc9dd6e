"""The fold: keep the top MLP neurons, slice gate/up rows and down columns.

Neurons are ranked by their DTG-MA mask logit, or, when no mask was learned,
by an activation score from the Gram diagonal (√E[a²]·‖down column‖: how much
a neuron can move the residual stream). Kept indices stay in their original
order, so a fold that keeps every neuron reproduces the source exactly.

Optional repair: the down projection is refitted by least squares so each
folded MLP's output stays closest to the original's over the captured
activations: with G = Σ a aᵀ over the unpruned model's down_proj inputs and
S the kept set, W' = W G[:, S] (G[S, S] + λI)⁻¹, λ = damp·mean(diag G[S, S]).
"""

from __future__ import annotations

import base64
import copy
import math
from pathlib import Path

import numpy as np
import torch

from ..cmf import CmfFile, copy_specs, new_doc, with_provenance, write_cmf
from ..codecs import get as get_codec
from ..errors import CortiqError


def mlp_names(i: int) -> tuple[str, str, str]:
    p = f"model.layers.{i}.mlp."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


#: multiple_of 0 (the default) rounds each layer's count to 64 where layers are wide (SmolLM2's
#: are 1536): a global fold's widths are otherwise arbitrary, and a width that is not a multiple
#: of the quant codecs' blocks (32 or 64 values along a row) takes round-to-nearest where GPTQ
#: would have run (its grid follows the rows only then), every width of its own makes the GPTQ
#: stage and the compiled heal run once per layer instead of once per width, and GPU matrix
#: kernels tile multiples of 64 without a ragged last block. Narrow layers (test models) keep
#: their exact counts.
AUTO_MULTIPLE, AUTO_MIN_WIDTH = 64, 1024


def select_kept(scores: list[torch.Tensor], keep_frac: float, scope: str = "per_layer", floor: float = 0.0,
                multiple_of: int = 1) -> list[torch.Tensor]:
    """Per layer, the sorted indices (int64) of the neurons to keep.

    per_layer: round(keep_frac·I_l) per layer (at least 1). global: the top
    round(keep_frac·N) over all layers, each layer keeping at least
    ceil(min(floor, keep_frac)·I_l) (and at least 1) of its own best. Either way each
    layer's count is then rounded to the nearest multiple of `multiple_of` (at least one
    multiple, at most I_l), the layer keeping its best that many. multiple_of 0: AUTO_MULTIPLE
    where every layer is at least AUTO_MIN_WIDTH wide, else 1."""
    widths = [int(s.numel()) for s in scores]
    if not widths or min(widths) == 0:
        raise CortiqError("fold: no neurons to rank")
    if multiple_of == 0:
        multiple_of = AUTO_MULTIPLE if min(widths) >= AUTO_MIN_WIDTH else 1
    if scope == "per_layer":
        return _top_per_layer(scores, [keep_frac * n for n in widths], multiple_of)
    if scope != "global":
        raise CortiqError(f"fold: unknown scope {scope!r}")
    flat = torch.cat([s.float().reshape(-1) for s in scores])  # [N]
    layer = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))  # [N]
    floor = min(floor, keep_frac)  # a floor above the share asked for would keep more than asked
    floors = torch.tensor([min(n, max(1, math.ceil(floor * n))) for n in widths])
    # rank of each neuron inside its layer (0 = best)
    rank = torch.empty(len(flat), dtype=torch.long)
    off = 0
    for n, s in zip(widths, scores):
        order = torch.argsort(s.float().reshape(-1), descending=True, stable=True)
        rank[off + order] = torch.arange(n)
        off += n
    must = rank < floors[layer]
    total = max(int(floors.sum()), round(keep_frac * len(flat)))
    # the floors go first (+inf), the rest of the budget to the best of the others
    pick = torch.topk(torch.where(must, torch.full_like(flat, float("inf")), flat), total).indices
    keep = torch.zeros(len(flat), dtype=torch.bool)
    keep[pick] = True
    if multiple_of > 1:  # the global counts, rounded per layer
        return _top_per_layer(scores, [int(k.sum()) for k in keep.split(widths)], multiple_of)
    return [torch.nonzero(k).reshape(-1) for k in keep.split(widths)]


def _top_per_layer(scores: list[torch.Tensor], counts: list[float], multiple_of: int) -> list[torch.Tensor]:
    """Each layer's best round(count) neurons, the count rounded to the nearest multiple of
    `multiple_of` (at least one multiple, at most the layer's width), as sorted indices."""
    out = []
    for s, c in zip(scores, counts):
        k = min(s.numel(), max(multiple_of, round(c / multiple_of) * multiple_of))
        out.append(torch.topk(s.float().reshape(-1), k).indices.sort().values)
    return out


def activation_scores(gram: torch.Tensor, count: int, down: torch.Tensor) -> torch.Tensor:
    """√(E[a_j²])·‖W_down[:, j]‖ for every neuron j: gram [I, I], down [H, I] → [I]."""
    ms = torch.diagonal(gram).double().clamp_min(0) / max(int(count), 1)
    return (ms.sqrt() * torch.linalg.vector_norm(down.double(), dim=0)).float()


def repair_down(down: torch.Tensor, gram: torch.Tensor, kept: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The least-squares down projection over the kept neurons:
    W [H, I], G [I, I], S [k] → W G[:, S] (G[S, S] + λI)⁻¹ [H, k], in f64 on
    the Gram's device (a CUDA Gram: cuSOLVER's Cholesky), in down's dtype."""
    G = gram.double()
    W = down.to(G.device, torch.float64)
    kept = kept.to(G.device)
    Gss = G[kept][:, kept]  # [k, k]
    d = torch.diagonal(Gss)
    mean = float(d.mean())
    if not mean > 0:
        raise CortiqError("fold repair: the kept neurons never fired in the captured Gram")
    lam = damp * mean
    eye = torch.eye(len(kept), dtype=torch.float64, device=G.device)
    rhs = G[kept] @ W.T  # [k, H] = G[S, :] Wᵀ
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(Gss + max(lam, 1e-12 * mean) * eye)
        if int(info) == 0:
            return torch.cholesky_solve(rhs, L).T.to(down.dtype).contiguous()  # [H, k]
        lam = max(lam, 1e-8 * mean) * 10.0
    raise CortiqError("fold repair: G[S, S] is singular even with heavy damping (raise --damp)")


def kept_to_b64(kept: torch.Tensor, width: int) -> str:
    """A layer's kept set as a base64 bitmask (compact enough for provenance)."""
    m = np.zeros(width, dtype=bool)
    m[kept.numpy()] = True
    return base64.b64encode(np.packbits(m).tobytes()).decode()


def kept_from_b64(s: str, width: int) -> torch.Tensor:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(s), dtype=np.uint8))[:width].astype(bool)
    return torch.from_numpy(np.nonzero(bits)[0].astype(np.int64))


def fold_cmf(
    src: CmfFile,
    kept: list[torch.Tensor],
    out: str | Path,
    down: dict[int, torch.Tensor] | None = None,
    provenance: dict | None = None,
) -> Path:
    """Write `src` folded to `kept` neurons per trunk layer (down_proj replaced
    by `down[i]` where given, e.g. repaired). Unchanged tensors are copied as
    stored; sliced ones keep a plain codec, or become f32 from a block codec
    (blocks would straddle the new shape)."""
    arch = copy.deepcopy(src.arch)
    if len(kept) != arch.num_layers:
        raise CortiqError(f"{src.path}: {len(kept)} kept sets for {arch.num_layers} layers")
    down = down or {}
    replace: dict = {}
    widths = []
    for i, (k, n) in enumerate(zip(kept, arch.intermediate_sizes)):
        k = k.to(torch.long)
        if k.numel() == 0 or int(k.min()) < 0 or int(k.max()) >= n or bool((k[1:] <= k[:-1]).any()):
            raise CortiqError(f"{src.path}: layer {i}: kept indices must be sorted, unique and within 0..{n - 1}")
        widths.append(int(k.numel()))
        g, u, d = mlp_names(i)
        H = src.info(d).shape[0]
        if k.numel() == n and i not in down:
            continue
        replace[g] = ((len(k), src.info(g).shape[1]), lambda g=g, k=k: src.tensor(g)[k])
        replace[u] = ((len(k), src.info(u).shape[1]), lambda u=u, k=k: src.tensor(u)[k])
        if i in down:
            if tuple(down[i].shape) != (H, len(k)):
                raise CortiqError(f"{src.path}: layer {i}: repaired down_proj {list(down[i].shape)} is not {[H, len(k)]}")
            replace[d] = ((H, len(k)), lambda t=down[i]: t.float())
        else:
            replace[d] = ((H, len(k)), lambda d=d, k=k: src.tensor(d)[:, k])
    arch.intermediate_sizes = widths

    def codec_for(name, info):
        if name in replace and not get_codec(info.codec).plain:
            return "f32"
        return info.codec

    doc = new_doc(arch, src.tokenizer, src.provenance)
    block = dict(provenance or {})
    block.setdefault("widths", widths)
    block.setdefault("kept", [kept_to_b64(k, n) for k, n in zip(kept, src.arch.intermediate_sizes)])
    block.setdefault("source_widths", list(src.arch.intermediate_sizes))
    doc = with_provenance(doc, "fold", block)
    return write_cmf(Path(out), doc, copy_specs(src, codec_for, replace))
