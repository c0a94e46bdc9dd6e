"""GPTQ (Frantar et al. 2022) into cortiq's block codecs.

The quantization grid is the codec's own: blocks of `g` (32 or 64) values
along the flattened row-major tensor, i.e. `g` consecutive input columns of
one output row when `in % g == 0`; q8 is symmetric (one f16 scale per block),
q4 asymmetric (f16 scale and min), or symmetric with `q4_grid` "symmetric"
(min = −8·scale, kept so through every search and refit: the blocks
compressed-tensors' int4 holds exactly). A group's grid is fixed when GPTQ reaches
its first column, from the error-compensated weights at that moment (with
act-order the grids come from the original weights up front: "static
groups", since a group's columns are then visited out of order).

The result is the codec's exact byte layout, so `codec.decode` of the stored
bytes gives GPTQ's dequantized weights.

`gptq_quantize_layers` is the blocked algorithm with lazy batch updates on
a stack of same-shape layers at once; `gptq_quantize` the one-layer call of
it; `gptq_reference` the plain column-by-column one they are tested against.
The loop over columns is inherent to GPTQ (each column's rounding depends on
the errors of the ones before); every step is vectorised over the rows and
over the stacked layers, so a model's MLPs (one width per fold) take one
column loop, not one per layer: on a GPU each column is a handful of kernel
launches, and launches, not arithmetic, bound the loop. The Cholesky factors
and the error feedback run in f64 (`dtype`) on whatever device W is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import codecs
from ..errors import CortiqError


@dataclass
class GptqResult:
    #: storage bytes in the codec's layout (wrap in cmf.Stored to write)
    stored: torch.Tensor
    #: dequantized weights [out, in] f32, equal to codec.decode(stored)
    weight: torch.Tensor
    #: "gptq", or "rtn" when the codec's blocks do not follow the rows
    method: str
    #: the damping that made H positive definite (damp·mean diag)
    damp: float


def _group(codec_name: str) -> int:
    c = codecs.get(codec_name)
    if codec_name not in ("q8", "q4", "q4_64"):
        raise CortiqError(f"GPTQ: codec {codec_name!r} is not a block codec GPTQ writes (q4, q4_64, q8)")
    return int(c.block)


def _grid(codec_name: str, w: torch.Tensor, q4_grid: str = "asymmetric") -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's grid for groups w [R, g] → (scale f32 [R], min f32 [R]); min 0 for q8.
    Scale and min pass through f16 exactly as the codec stores them."""
    c = codecs.encoder(codec_name, q4_grid)
    b = w.to(torch.float32)
    if codec_name == "q8":
        _, scale = c.quantize(b)
        return scale.to(torch.float32), torch.zeros_like(scale, dtype=torch.float32)
    _, scale, lo = c.quantize(b)
    return scale.to(torch.float32), lo.to(torch.float32)


def clip_factors(clip_grid: int) -> torch.Tensor:
    """The range shrink factors a grid search tries: `clip_grid` of them, evenly from 1 (the group's whole
    range, always a candidate) down to 0.5; one: no search."""
    return torch.linspace(1.0, 0.5, max(clip_grid, 1), dtype=torch.float64)


def _fit(codec_name: str, w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, s: torch.Tensor, lo: torch.Tensor,
         q4_grid: str = "asymmetric"):
    """The (scale, min) [N] that fit w ≈ min + scale·q best under the weights h, codes q fixed (weighted
    least squares; q8: min 0; a symmetric q4 grid: min −8·scale, the scale alone fitted), through f16
    as the codec stores them; rows whose codes cannot determine a fit keep (s, lo)."""
    if codec_name != "q8" and q4_grid == "symmetric":
        c = q - 8.0  # the signed codes: w ≈ scale·c
        den = (h * c * c).sum(-1)
        ns = ((h * c * w).sum(-1) / den.clamp_min(1e-30)).to(torch.float16)
        ok = (den > 0) & torch.isfinite(ns) & (ns > 0) & torch.isfinite(ns * -8.0)
        ns = torch.where(ok, ns, s.to(torch.float16))  # a kept row's scale is an f16 already
        return ns.to(torch.float32), (ns * -8.0).to(torch.float32)
    A, B, Cq = h.sum(-1), (h * q).sum(-1), (h * q * q).sum(-1)
    D, E = (h * w).sum(-1), (h * q * w).sum(-1)
    if codec_name == "q8":
        ns, nlo = E / Cq.clamp_min(1e-30), torch.zeros_like(lo)
        ok = Cq > 0
    else:
        det = A * Cq - B * B
        ok = det > 1e-12 * (A * Cq).clamp_min(1e-30)
        safe = torch.where(ok, det, torch.ones_like(det))
        ns, nlo = (A * E - B * D) / safe, (Cq * D - B * E) / safe
    ns, nlo = ns.to(torch.float16).to(torch.float32), nlo.to(torch.float16).to(torch.float32)
    ok = ok & (ns > 0) & torch.isfinite(ns) & torch.isfinite(nlo)
    return torch.where(ok, ns, s), torch.where(ok, nlo, lo)


#: least-squares refits of the grid to its own codes, per candidate range
REFITS = 2


def _searched_grid(codec_name: str, w: torch.Tensor, h: torch.Tensor, clip_grid: int,
                   q4_grid: str = "asymmetric") -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of each group w [N, g] whose rounding error weighted by its inputs' energy h [N, g]
    (diag H: which columns the output feels) is least among: the group's range [min, max] shrunk
    toward 0 by each of `clip_factors(clip_grid)`, each then refitted `REFITS` times to its own
    codes by weighted least squares (scale and min given the codes, codes given the grid; the
    min/max grid wastes levels on a group's one or two extreme values, and a fitted grid spends
    them where the weights are). The search of AWQ's clipping and llama.cpp's k-quant fits, with
    the Gram's diagonal as the weights. → (scale, min) [N] as `_grid` gives them; `clip_grid` 1 is
    `_grid` itself. On a symmetric q4 grid every candidate and refit stays symmetric."""
    s, lo = _grid(codec_name, w, q4_grid)
    if clip_grid <= 1:
        return s, lo
    w32, h32 = w.to(torch.float32), h.to(torch.float32)
    wmin, wmax = w32.amin(-1, keepdim=True), w32.amax(-1, keepdim=True)

    def err(sc, mn):
        q, wq = _qdq(codec_name, w32, sc[:, None], mn[:, None])
        return (h32 * (w32 - wq) ** 2).sum(-1), q  # [N], [N, g]

    best, _ = err(s, lo)
    for f in clip_factors(clip_grid).tolist():  # a handful of candidates, each over every group at once
        cs, clo = (s, lo) if f == 1.0 else _grid(codec_name, w32.clamp(f * wmin, f * wmax), q4_grid)
        e, cq = err(cs, clo)
        for _ in range(REFITS + 1):
            take = e < best
            best, s, lo = torch.where(take, e, best), torch.where(take, cs, s), torch.where(take, clo, lo)
            cs, clo = _fit(codec_name, w32, h32, cq, cs, clo, q4_grid)
            e, cq = err(cs, clo)
    return s, lo


def _qdq(codec_name: str, w: torch.Tensor, s: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round one column w [R] onto its rows' grids → (codes f32 [R], dequantized [R]),
    with the codec's arithmetic (f32), so decode reproduces the values bitwise."""
    w32 = w.to(torch.float32)
    if codec_name == "q8":
        q = torch.where(s > 0, w32 / s.clamp_min(1e-30), 0.0).round().clamp(-127, 127)
        return q, (q * s).to(w.dtype)
    q = torch.where(s > 0, (w32 - lo) / s.clamp_min(1e-30), 0.0).round().clamp(0, 15)
    return q, (lo + q * s).to(w.dtype)


def _pack(codec_name: str, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, g: int) -> torch.Tensor:
    """codes [R, C], scale/min [R, C/g] → the codec's bytes (blocks in row-major order)."""
    c = codecs.get(codec_name)
    qb = codes.reshape(-1, g)  # [R·C/g, g]: row-major blocks
    if codec_name == "q8":
        return c.pack(qb.to(torch.int8), scale.reshape(-1).to(torch.float16))
    return c.pack(qb.to(torch.uint8), scale.reshape(-1).to(torch.float16), lo.reshape(-1).to(torch.float16))


def _prepare(W: torch.Tensor, H: torch.Tensor, damp: float, dtype: torch.dtype):
    """Dead inputs (H_jj = 0) get H_jj = 1 so the inverse exists (their error
    propagates nowhere); then the upper Cholesky factor of (H + λI)⁻¹, for a
    stack W [L, R, C], H [L, C, C] → (U [L, C, C], λ [L]); each layer's λ
    grows ×10 until its factor exists."""
    if W.ndim != 3 or H.shape != (W.shape[0], W.shape[2], W.shape[2]):
        raise CortiqError(f"GPTQ: Hessian {list(H.shape[1:])} does not match weight {list(W.shape[1:])}")
    H = H.to(dtype).clone()
    if not torch.isfinite(H).all():
        raise CortiqError("GPTQ: the Hessian has non-finite entries")
    d = torch.diagonal(H, dim1=-2, dim2=-1)  # [L, C], a view: writes reach H
    dead = d <= 0
    d[dead] = 1.0
    live = (~dead).sum(-1)  # [L]
    if bool((live == 0).any()):
        raise CortiqError("GPTQ: the Hessian is all zero (no activations were captured)")
    lam = damp * torch.where(dead, 0.0, d).sum(-1) / live  # [L]
    eye = torch.eye(H.shape[-1], dtype=dtype, device=H.device)
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(H + lam[:, None, None] * eye)
        U, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        bad = (info != 0) | (info2 != 0)  # [L]
        if not bool(bad.any()):
            return U, lam
        lam = torch.where(bad, lam * 10.0, lam)
    raise CortiqError("GPTQ: the Hessian is not positive definite even with heavy damping")


def _few_threads(dev):
    """One intra-op thread for the column loop on a CPU: its steps are a few
    thousand values each, and threads cost more than they give there (measured
    on a loaded 2-core machine: 11.8 s for one 960 × 576 q4 layer with the
    default threads, 0.48 s with one)."""
    import contextlib

    if torch.device(dev).type != "cpu":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def one():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return one()


def _columns(codec_name, Wd, U, scale, lo, g, B, act_order, col_group, hd=None, clip_grid=1, q4_grid="asymmetric"):
    """GPTQ's blocked column loop on Wd [L, R, C] (changed in place) with the
    Cholesky factors U; fills the grids `scale`/`lo` [L, R, C/g] as it reaches
    each group (act-order: they are given; else searched under hd [L, C], diag H, with
    `clip_grid` candidates, on `q4_grid`). Returns (codes, dequantized) [L, R, C]."""
    n, R, C = Wd.shape
    dev = Wd.device
    layer = torch.arange(n, device=dev)
    codes = torch.zeros(n, R, C, dtype=torch.float32, device=dev)
    Q = torch.zeros_like(Wd)
    for i1 in range(0, C, B):
        i2 = min(i1 + B, C)
        W1 = Wd[:, :, i1:i2].clone()  # [L, R, b]
        E1 = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]  # [L, b, b]
        for i in range(i2 - i1):
            col = i1 + i
            if act_order:
                gi = col_group[:, col]  # [L]
                s_col, lo_col = scale[layer, :, gi], lo[layer, :, gi]  # [L, R]
            else:
                gi = col // g
                if col % g == 0:
                    h = hd[:, None, col : col + g].expand(n, R, g).reshape(n * R, g) if clip_grid > 1 else None
                    sg, lg = _searched_grid(codec_name, W1[:, :, i : i + g].reshape(n * R, g), h, clip_grid, q4_grid)
                    scale[:, :, gi], lo[:, :, gi] = sg.reshape(n, R), lg.reshape(n, R)
                s_col, lo_col = scale[:, :, gi], lo[:, :, gi]
            w = W1[:, :, i]  # [L, R]
            q, wq = _qdq(codec_name, w, s_col, lo_col)
            codes[:, :, col] = q
            Q[:, :, col] = wq
            err = (w - wq) / U1[:, i, i, None]  # [L, R]
            W1[:, :, i:] -= err[:, :, None] * U1[:, None, i, i:]
            E1[:, :, i] = err
        # the lazy update: later blocks see this block's errors at once
        Wd[:, :, i2:] -= E1 @ U[:, i1:i2, i2:]
    return codes, Q


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, codec_name: str = "q4", block: int = 128, damp: float = 0.01,
                  act_order: bool = False, dtype: torch.dtype = torch.float64, clip_grid: int = 1,
                  q4_grid: str = "asymmetric") -> GptqResult:
    """Quantize W [out, in] with the Hessian H = Σ x xᵀ [in, in] of its inputs."""
    if W.ndim != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise CortiqError(f"GPTQ: Hessian {list(H.shape)} does not match weight {list(W.shape)}")
    return gptq_quantize_layers(W[None], H[None], codec_name, block, damp, act_order, dtype, clip_grid, q4_grid)[0]


def gptq_quantize_layers(
    W: torch.Tensor,
    H: torch.Tensor,
    codec_name: str = "q4",
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    dtype: torch.dtype = torch.float64,
    clip_grid: int = 1,
    q4_grid: str = "asymmetric",
) -> list[GptqResult]:
    """Quantize a stack of layers W [L, out, in], each with its Hessian
    H [L, in, in], in one column loop; results per layer, on W's device
    (the stored bytes on the CPU). `clip_grid` > 1: each group's grid is
    searched among that many shrunk ranges (`_searched_grid`); `q4_grid`
    (codecs.Q4_GRIDS): where a q4 codec's blocks are placed."""
    g = _group(codec_name)
    if W.ndim != 3 or H.shape != (W.shape[0], W.shape[2], W.shape[2]):
        raise CortiqError(f"GPTQ: Hessian {list(H.shape[1:])} does not match weight {list(W.shape[1:])}")
    n, R, C = W.shape
    if C % g:
        # the codec's blocks straddle rows: no per-row grid to optimise against
        c = codecs.encoder(codec_name, q4_grid)
        out = []
        for w in W:
            st = c.encode(w.cpu())
            out.append(GptqResult(st, c.decode(st, tuple(w.shape)).to(W.device), "rtn", 0.0))
        return out
    B = max(g, (block // g) * g)  # whole groups per lazy block
    dev = W.device
    H = H.to(dev)
    Wd = W.detach().to(dtype).clone()  # [L, R, C]
    perm = None
    n_groups = C // g
    scale = torch.zeros(n, R, n_groups, dtype=torch.float32, device=dev)
    lo = torch.zeros_like(scale)
    col_group = None
    hd = torch.diagonal(H, dim1=-2, dim2=-1).to(dtype)  # [L, C]: each input column's energy
    if act_order:
        # static groups: the grids of the original weights, in original column order
        h0 = hd.float()[:, None, :].expand(n, R, C).reshape(n * R * n_groups, g) if clip_grid > 1 else None
        s0, l0 = _searched_grid(codec_name, Wd.reshape(n * R * n_groups, g), h0, clip_grid, q4_grid)
        scale, lo = s0.reshape(n, R, n_groups), l0.reshape(n, R, n_groups)
        perm = torch.argsort(hd, dim=-1, descending=True, stable=True)  # [L, C]
        Wd = torch.take_along_dim(Wd, perm[:, None, :], 2)
        H = torch.take_along_dim(torch.take_along_dim(H, perm[:, :, None], 1), perm[:, None, :], 2)
        col_group = perm // g  # [L, C]: group of each permuted column, per layer
    U, lam = _prepare(Wd, H, damp, dtype)
    with _few_threads(dev):
        codes, Q = _columns(codec_name, Wd, U, scale, lo, g, B, act_order, col_group, hd, clip_grid, q4_grid)
    if perm is not None:
        inv = torch.argsort(perm, dim=-1)[:, None, :]
        codes, Q = torch.take_along_dim(codes, inv, 2), torch.take_along_dim(Q, inv, 2)
    codes, scale, lo, lams = codes.cpu(), scale.cpu(), lo.cpu(), lam.tolist()
    return [GptqResult(_pack(codec_name, codes[l], scale[l], lo[l], g), Q[l].to(torch.float32), "gptq", lams[l])
            for l in range(n)]


def gptq_reference(
    W: torch.Tensor, H: torch.Tensor, codec_name: str = "q4", damp: float = 0.01, dtype: torch.dtype = torch.float64,
    clip_grid: int = 1, q4_grid: str = "asymmetric",
) -> torch.Tensor:
    """The plain algorithm (no blocks, no act-order): each column rounded, its
    error spread at once over all later columns. Returns the dequantized W."""
    g = _group(codec_name)
    R, C = W.shape
    U = _prepare(W[None], H[None], damp, dtype)[0][0]
    Wd = W.detach().to(dtype).clone()
    Q = torch.zeros_like(Wd)
    s = lo = None
    for j in range(C):
        if j % g == 0:
            s, lo = _reference_grid(codec_name, Wd[:, j : j + g], torch.diagonal(H)[j : j + g], clip_grid, q4_grid)
        _, Q[:, j] = _qdq(codec_name, Wd[:, j], s, lo)
        err = (Wd[:, j] - Q[:, j]) / U[j, j]
        Wd[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q.to(torch.float32)


def _reference_grid(codec_name: str, w: torch.Tensor, h: torch.Tensor, clip_grid: int, q4_grid: str = "asymmetric"):
    """`_searched_grid`'s plain form: row by row, candidate by candidate, refit by refit, the first
    least error kept."""
    w32, h32 = w.to(torch.float32), h.to(torch.float32)
    s, lo = _grid(codec_name, w32, q4_grid)
    if clip_grid <= 1:
        return s, lo
    for r in range(w32.shape[0]):
        row, hr = w32[r : r + 1], h32[None, :]
        best = None
        for f in clip_factors(clip_grid).tolist():
            cs, clo = _grid(codec_name, row.clamp(f * row.min(), f * row.max()), q4_grid)
            for _ in range(REFITS + 1):
                q, wq = _qdq(codec_name, row, cs[:, None], clo[:, None])
                e = float((hr * (row - wq) ** 2).sum())
                if best is None or e < best:
                    best, s[r], lo[r] = e, cs[0], clo[0]
                cs, clo = _fit(codec_name, row, hr, q, cs, clo, q4_grid)
    return s, lo
