"""Gated DeltaNet linear attention (the Qwen3-Next / Qwen3.5 hybrid's `linear_attn`).

Per value head the layer keeps a state S [Dk, Dv] and, for each token,

    S ← exp(g_t) · S                      decay
    S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)       delta-rule write (β: write strength)
    o_t = Sᵀ (q_t · Dk^-½)

with q, k L2-normalised per head. Three implementations of that rule:

- `gated_delta_rule_ref`: the recurrence above, one token at a time (the
  reference, and the one-token decoding step);
- `gated_delta_rule_chunked`: the WY/UT chunked form for training — within a
  chunk everything is matrix products, across chunks one state carry;
- fla's Triton kernels (`chunk_gated_delta_rule`) on CUDA when `import fla`
  works.

`GatedDeltaNet` is the layer, in the split projection layout (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`; the converter splits Qwen3-Next's fused
`in_proj_qkvz` / `in_proj_ba` into it), with a causal depthwise conv1d whose
last K−1 inputs are carried as state when decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_FLA = None  # None: not probed yet; False: unavailable; else the kernel


def _fla_kernel():
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _FLA = chunk_gated_delta_rule
        except Exception:  # fla absent or its Triton build broken: torch path
            _FLA = False
    return _FLA or None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # same form as fla and transformers: x / sqrt(|x|² + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(q, k, v, g, beta, initial_state=None):
    """Plain recurrence, token by token (reference and single-step decode).

    q, k [B, T, H, Dk] (L2-normalised), v [B, T, H, Dv], g (log decay ≤ 0) and
    beta [B, T, H]; initial_state [B, H, Dk, Dv] or None.
    Returns (o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] f32)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * Dk**-0.5
    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", S, k[:, t])  # [B, H, Dv]: what S already predicts for k_t
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, Dv).float()
    return o.to(v.dtype), S


def gated_delta_rule_chunked(q, k, v, g, beta, chunk: int = 64, initial_state=None):
    """The same rule in chunks of `chunk` tokens (same arguments and results as
    the reference). Within a chunk the T sequential delta-rule writes are one
    unit-lower-triangular solve (the UT transform); across chunks the state is
    carried once per chunk."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dt = v.dtype
    # [B, H, T, *] in f32: the cumulative decays and the triangular solve need it
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    q = q * Dk**-0.5
    pad = (-T) % chunk
    if pad:  # zero k/v/β and zero log-decay: padded steps change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, N, chunk, -1) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(B, H, N, chunk) for x in (g, beta))  # [B, H, N, C]

    gc = g.cumsum(-1)  # [B, H, N, C]: log decay from chunk start through position i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay between positions j ≤ i of a chunk, 0 above the diagonal; masked before exp (no overflow)
    dec = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]

    kb = k * beta[..., None]
    # A[i, j] = β_i (k_i·k_j) decay(j→i) for j < i: how write j changes what write i sees
    A = (kb @ k.transpose(-1, -2)) * dec
    A = A.tril(-1) + torch.eye(chunk, device=q.device)
    # u = (I + A)⁻¹ β v and w = (I + A)⁻¹ β k e^{gc}: the chunk's writes with intra-chunk deltas resolved
    u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * dec  # [B, H, N, C, C] intra-chunk read, causal incl. diagonal
    q_dec = q * gc.exp()[..., None]  # reads of the carried state decay from the chunk start
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]  # writes decay to the chunk end
    chunk_dec = gc[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    S = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.float()
    outs = []
    for n in range(N):  # one carry per chunk; everything inside is matrix products
        v_new = u[:, :, n] - w[:, :, n] @ S  # [B, H, C, Dv]: the writes' residuals against the carried state
        outs.append(q_dec[:, :, n] @ S + attn[:, :, n] @ v_new)
        S = S * chunk_dec[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, H, N * chunk, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dt), S


def _fla_backward_broken(device) -> bool:
    """fla refuses its backward on Hopper under Triton 3.4 ≤ v < 3.7.1 (wrong
    results there, fla issue #640): training takes the torch path instead."""
    try:
        import triton

        ver = tuple(int(x) for x in triton.__version__.split(".")[:3] if x.isdigit())
    except Exception:
        return True
    return torch.cuda.get_device_capability(device)[0] == 9 and (3, 4, 0) <= ver < (3, 7, 1)


def gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = 64):
    """Dispatch: one token → the recurrence; CUDA with fla → its kernel; else chunked torch."""
    if q.shape[1] == 1:
        return gated_delta_rule_ref(q, k, v, g, beta, initial_state)
    kern = _fla_kernel() if q.is_cuda else None
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if kern is not None and needs_grad and _fla_backward_broken(q.device):
        kern = None
    if kern is not None and (q.shape[-1] % 16 or v.shape[-1] % 16):
        kern = None  # fla's Triton tiles need head dims in multiples of 16
    if kern is not None:
        o, S = kern(q, k, v, g.float(), beta, scale=q.shape[-1] ** -0.5,
                    initial_state=None if initial_state is None else initial_state.float(),
                    output_final_state=True, use_qk_l2norm_in_kernel=False)
        return o.to(v.dtype), S.float()
    return gated_delta_rule_chunked(q, k, v, g, beta, chunk=chunk, initial_state=initial_state)


class GatedRMSNorm(nn.Module):
    """RMSNorm over Dv then × silu(z). Always w·x̂ (HF Qwen3NextRMSNormGated),
    whatever the model's norm_style."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GDNState:
    """Decoding state of one GDN layer: conv inputs [B, C, K-1] and S [B, Hv, Dk, Dv] f32."""

    __slots__ = ("conv", "rec")

    def __init__(self):
        self.conv = None
        self.rec = None

    def snapshot(self):
        return (self.conv, self.rec)

    def restore(self, snap):
        self.conv, self.rec = snap


class GatedDeltaNet(nn.Module):
    """HF Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet, split projections."""

    def __init__(self, arch):
        super().__init__()
        H = arch.hidden_size
        self.hk, self.hv = arch.linear_num_key_heads, arch.linear_num_value_heads
        self.dk, self.dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        C = 2 * self.key_dim + self.value_dim
        self.K = arch.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, self.K, groups=C, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, arch.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.chunk = 64

    def forward(self, x, state: GDNState | None = None):
        B, T, _ = x.shape  # x [B, T, H]
        qkv = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        # causal depthwise conv: the previous K-1 inputs (zeros at the start) prefix this call's
        prev = state.conv if state is not None and state.conv is not None else qkv.new_zeros(B, qkv.shape[1], self.K - 1)
        full = torch.cat([prev.to(qkv.dtype), qkv], -1)  # [B, C, K-1+T]
        if state is not None:
            state.conv = full[:, :, full.shape[-1] - (self.K - 1):].detach()
        qkv = F.silu(F.conv1d(full, self.conv1d.weight, groups=full.shape[1])).transpose(1, 2)  # [B, T, C]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = l2norm(q.reshape(B, T, self.hk, self.dk).float())
        k = l2norm(k.reshape(B, T, self.hk, self.dk).float())
        v = v.reshape(B, T, self.hv, self.dv)
        if self.hv != self.hk:  # each key head serves hv/hk consecutive value heads
            q = q.repeat_interleave(self.hv // self.hk, 2)
            k = k.repeat_interleave(self.hv // self.hk, 2)
        beta = self.in_proj_b(x).float().sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # [B, T, Hv]
        init = state.rec if state is not None else None
        o, S = gated_delta_rule(q.to(v.dtype), k.to(v.dtype), v, g, beta, initial_state=init, chunk=self.chunk)
        if state is not None:
            state.rec = S.detach()
        z = self.in_proj_z(x).reshape(B, T, self.hv, self.dv)
        o = self.norm(o, z).reshape(B, T, self.value_dim)
        return self.out_proj(o)
