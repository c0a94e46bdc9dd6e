"""GPTQ (Frantar et al. 2022) into cortiq's block codecs.

The quantization grid is the codec's own: blocks of `g` (32 or 64) values
along the flattened row-major tensor, i.e. `g` consecutive input columns of
one output row when `in % g == 0`; q8 is symmetric (one f16 scale per block),
q4 asymmetric (f16 scale and min). A group's grid is fixed when GPTQ reaches
its first column, from the error-compensated weights at that moment (with
act-order the grids come from the original weights up front: "static
groups", since a group's columns are then visited out of order).

The result is the codec's exact byte layout, so `codec.decode` of the stored
bytes gives GPTQ's dequantized weights.

`gptq_quantize` is the blocked algorithm with lazy batch updates;
`gptq_reference` the plain column-by-column one it is tested against. The
loop over columns is inherent to GPTQ (each column's rounding depends on the
errors of the ones before); every step is vectorised over the rows.
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


def _grid(codec_name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's grid for groups w [R, g] → (scale f32 [R], min f32 [R]); min 0 for q8.
    Scale and min pass through f16 exactly as the codec stores them."""
    c = codecs.get(codec_name)
    b = w.to(torch.float32)
    if codec_name == "q8":
        _, scale = c.quantize(b)
        return scale.to(torch.float32), torch.zeros_like(scale, dtype=torch.float32)
    _, scale, lo = c.quantize(b)
    return scale.to(torch.float32), lo.to(torch.float32)


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
    propagates nowhere); then the upper Cholesky factor of (H + λI)⁻¹."""
    if W.ndim != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise CortiqError(f"GPTQ: Hessian {list(H.shape)} does not match weight {list(W.shape)}")
    H = H.to(dtype).clone()
    if not torch.isfinite(H).all():
        raise CortiqError("GPTQ: the Hessian has non-finite entries")
    d = torch.diagonal(H)
    dead = d <= 0
    d[dead] = 1.0
    if bool(dead.all()):
        raise CortiqError("GPTQ: the Hessian is all zero (no activations were captured)")
    lam = damp * float(d[~dead].mean())
    eye = torch.eye(H.shape[0], dtype=dtype, device=H.device)
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(H + lam * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info2) == 0:
                return U, lam
        lam *= 10.0
    raise CortiqError("GPTQ: the Hessian is not positive definite even with heavy damping")


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    codec_name: str = "q4",
    block: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    dtype: torch.dtype = torch.float64,
) -> GptqResult:
    """Quantize W [out, in] with the Hessian H = Σ x xᵀ [in, in] of its inputs."""
    g = _group(codec_name)
    R, C = W.shape
    if C % g:
        # the codec's blocks straddle rows: no per-row grid to optimise against
        c = codecs.get(codec_name)
        st = c.encode(W)
        return GptqResult(st, c.decode(st, tuple(W.shape)), "rtn", 0.0)
    B = max(g, (block // g) * g)  # whole groups per lazy block
    Wd = W.detach().to(dtype).clone()
    perm = None
    n_groups = C // g
    scale = torch.zeros(R, n_groups, dtype=torch.float32, device=W.device)
    lo = torch.zeros_like(scale)
    if act_order:
        # static groups: the grids of the original weights, in original column order
        s0, l0 = _grid(codec_name, Wd.reshape(R * n_groups, g))
        scale, lo = s0.reshape(R, n_groups), l0.reshape(R, n_groups)
        perm = torch.argsort(torch.diagonal(H).to(dtype), descending=True, stable=True)
        Wd = Wd[:, perm]
        H = H[perm][:, perm]
        col_group = perm // g  # [C]: group of each permuted column
    U, lam = _prepare(Wd, H, damp, dtype)
    codes = torch.zeros(R, C, dtype=torch.float32, device=W.device)
    Q = torch.zeros_like(Wd)
    for i1 in range(0, C, B):
        i2 = min(i1 + B, C)
        W1 = Wd[:, i1:i2].clone()  # [R, b]
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if act_order:
                gi = int(col_group[col])
            else:
                gi = col // g
                if col % g == 0:
                    scale[:, gi], lo[:, gi] = _grid(codec_name, W1[:, i : i + g])
            w = W1[:, i]
            q, wq = _qdq(codec_name, w, scale[:, gi], lo[:, gi])
            codes[:, col] = q
            Q[:, col] = wq
            err = (w - wq) / U1[i, i]  # [R]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        # the lazy update: later blocks see this block's errors at once
        Wd[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        inv = torch.argsort(perm)
        codes, Q = codes[:, inv], Q[:, inv]
    stored = _pack(codec_name, codes, scale, lo, g)
    return GptqResult(stored, Q.to(torch.float32), "gptq", lam)


def gptq_reference(
    W: torch.Tensor, H: torch.Tensor, codec_name: str = "q4", damp: float = 0.01, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The plain algorithm (no blocks, no act-order): each column rounded, its
    error spread at once over all later columns. Returns the dequantized W."""
    g = _group(codec_name)
    R, C = W.shape
    U, _ = _prepare(W, H, damp, dtype)
    Wd = W.detach().to(dtype).clone()
    Q = torch.zeros_like(Wd)
    s = lo = None
    for j in range(C):
        if j % g == 0:
            s, lo = _grid(codec_name, Wd[:, j : j + g])
        _, Q[:, j] = _qdq(codec_name, Wd[:, j], s, lo)
        err = (Wd[:, j] - Q[:, j]) / U[j, j]
        Wd[:, j:] -= err[:, None] * U[j, j:][None, :]
    return Q.to(torch.float32)
