"""The decoder's layers over the engine's static buffers: each layer's weights fused for a step
(`_Attn`, `_Mlp`, `_Norm`), the pure functions a step is made of (RoPE, the grouped head
layouts, a step's positions and masks, the draft layer's input), and their compiled twins
(`_fused_fns`).

The q/k/v and gate/up projections run as one matrix product each: the engine re-points those
parameters of the model into one fused tensor per layer (`_fuse`; views, so the model computes
the same and no copy is kept).

The fused path (`DecodeEngine(fused=...)`, on by default on CUDA for attention-only models)
runs each full-attention layer as two torch.compile'd halves around the eager SDPA:
- `pre`: RMSNorm, the qkv product, q/k norms, RoPE and the grouped layouts, and the layer's
  key and value writes into its cache;
- `post`: the output gate, the o product and residual, RMSNorm, the MLP and residual, and the
  norm that closes the trunk's last layer or the draft layer.
Compiled too: a step's positions, RoPE rows and mask; the draft layer's input (its token
lookup, two norms, the concatenation and eh_proj); a round's count of kept drafts and a tree
round's choice of branch; the picks; the buffer updates that end a step or a round. A chain
step's positions are an offset into the compiled context's arange. So with one slot a step
costs its launches, and a round's own work (its draft passes and acceptance) is what it
launches beyond a plain step. The weights are arguments: every layer and the draft layer share
one graph per shape, and a fold's per-layer MLP widths are marked dynamic (one graph for all).
Why a step is built around its launches, and what each fusion saved: bench/DECODE.md, "The engine's design notes"."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .picks import _pick_greedy, _pick_top
from .speculative import _kept, _plain_end, _put_drafts, _round_end, _tree_choice


def _fuse(mods: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) whose row blocks are the modules'
    parameters again (as views), so the fused product and the modules agree."""
    ws = [m.weight for m in mods]
    base = ws[0]
    off, contiguous = 0, True
    for w in ws:  # already fused by an earlier engine: reuse the storage
        if w.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or \
                w.storage_offset() != base.storage_offset() + off * w.shape[1]:
            contiguous = False
        off += w.shape[0]
    if contiguous and len(ws) > 1:
        fused = base.as_strided((off, base.shape[1]), (base.shape[1], 1), base.storage_offset())
    else:
        fused = torch.cat([w.detach() for w in ws], 0)
        off = 0
        for m, w in zip(mods, ws):
            m.weight = nn.Parameter(fused[off: off + w.shape[0]], requires_grad=w.requires_grad)
            off += w.shape[0]
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([m.bias.detach() if m.bias is not None else fused.new_zeros(m.weight.shape[0]) for m in mods])
    return fused, bias


class _Norm:
    """An RMSNorm as one fused call. The weight style (w·x̂) runs in the compute
    dtype: torch's rms_norm normalises in f32 inside and equals the module's
    f32-then-cast result; the offset style ((1+w)·x̂) keeps the f32 path, since
    1+w rounded to bf16 would not. Weights are taken at construction."""

    __slots__ = ("w", "eps", "f32")

    def __init__(self, mod):
        self.f32 = mod.offset
        self.w = (1.0 + mod.weight.detach().float()) if mod.offset else mod.weight.detach()
        self.eps = mod.eps

    def __call__(self, x):
        return _rms(x, self.w, self.eps, self.f32)


def _rms(x, w, eps: float, f32: bool):
    """`_Norm`'s arithmetic on x [..., H] as a pure function (the compiled layer halves call it too)."""
    if f32 or x.dtype != w.dtype:
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class _Attn:
    """One full-attention decoder layer's weights, fused for the step."""

    def __init__(self, layer):
        a = layer.self_attn
        self.a = a
        self.ln1, self.ln2 = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
        self.qn = _Norm(a.q_norm) if a.q_norm is not None else None
        self.kn = _Norm(a.k_norm) if a.k_norm is not None else None
        self.w_qkv, self.b_qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        split = (a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0])
        self.geo = _Geo(a.hq, a.hkv, a.d, a.rdim, a.gated, split)
        self.mlp = _Mlp(layer.mlp)

    def styles(self) -> tuple[tuple, tuple | None] | None:
        """(eps, f32) of the layer norms and of the q/k norms (None without them), or None
        where the layer's two norms differ (the compiled halves take one style of each)."""
        ln = {(n.eps, n.f32) for n in (self.ln1, self.ln2)}
        qk = None if self.qn is None else {(n.eps, n.f32) for n in (self.qn, self.kn)}
        if len(ln) != 1 or (qk is not None and len(qk) != 1):
            return None
        return ln.pop(), None if qk is None else qk.pop()


class _Geo(NamedTuple):
    """A full-attention layer's head geometry (the same in every layer of a model)."""

    hq: int
    hkv: int
    d: int
    rdim: int  # rotary dims of a head (< d: partial rotary)
    gated: bool  # q_proj emits [query(D); gate(D)] per head
    split: tuple[int, int, int]  # the q, k, v column blocks of the fused qkv product


class _Mlp:
    def __init__(self, mlp):
        self.mlp = mlp
        self.w_gu, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        self.width = mlp.gate_proj.weight.shape[0]

    def add_to(self, h, x):
        """h += mlp(x), in place (the residual add rides on the down product). h, x [S, T, H]."""
        return _add_linear(h, _swiglu(x, self.w_gu, self.mlp.neuron_logits), self.mlp.down_proj.weight)


def _swiglu(x, w_gu, nl):
    """The MLP's activations silu(x·W_gateᵀ)·(x·W_upᵀ) [..., I] from x [..., H] and the fused
    [gate; up] weight w_gu [2I, H], times sigmoid(nl) [I] where the neurons have gates (nl not None)."""
    g, u = F.linear(x, w_gu).chunk(2, -1)
    a = F.silu(g) * u
    return a if nl is None else a * torch.sigmoid(nl).to(a.dtype)


def _merge_heads(o, gate, g: _Geo):
    """SDPA's output o [S, Hkv, G·T, D] (grouped rows) as [S, T, Hq·D], times sigmoid(gate)
    [S, T, Hq·D] where the layer gates its output (gate not None)."""
    S, T = o.shape[0], o.shape[2] // (g.hq // g.hkv)
    o = o.view(S, g.hkv, g.hq // g.hkv, T, g.d).permute(0, 3, 1, 2, 4).reshape(S, T, g.hq * g.d)
    return o if gate is None else o * torch.sigmoid(gate)


def _add_linear(h, x, w):
    """h + x·wᵀ written into h (one matrix product with β = 1, no separate add). h [S, T, H], x [S, T, K]."""
    h.view(-1, h.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), w.t())
    return h


def _rope(x, cos, sin, rdim: int):
    """x [S, T, h, D]; cos [S, T, 1, rdim] and sin [S, T, 1, rdim] with its first
    half negated, in x's dtype (half-split pairing, partial rotary):
    x·cos + rotate_half(x)·sin as x·cos + [x2, x1]·[-sin, sin] (sign flips are exact)."""
    D = x.shape[-1]
    xr = x[..., :rdim] if rdim < D else x
    out = torch.addcmul(xr * cos, torch.cat([xr[..., rdim // 2:], xr[..., : rdim // 2]], -1), sin)
    return out if rdim == D else torch.cat([out, x[..., rdim:]], -1)


def _heads(qkv, cos, sin, qn, kn, g: _Geo, joint: bool = True):
    """The qkv product's rows qkv [S, T, (Hq(·2) + 2·Hkv)·D] as attention inputs: q in the
    grouped layout [S, Hkv, G·T, D] (query heads of one KV head as extra rows: no copy of the
    cache per group), k and v [S, Hkv, T, D] (q and k normed by the callables qn, kn where
    not None, then roped), and the output gate [S, T, Hq·D] (None where not gated).
    joint: where q and k lie side by side in the product, one rotation for both (eager, one
    launch of each op); compiled, joint=False ropes each alone, so each rotation has one
    reader and is computed in that reader's kernel: q's in the copy to the grouped layout
    (a copy from T = 2 on), k's in its cache write, where the shared rotation was a kernel of
    its own and q's copy another."""
    S, T, _ = qkv.shape
    q, k, v = qkv.split(g.split, -1)
    v = v.view(S, T, g.hkv, g.d)
    gate = None
    if joint and qn is None and not g.gated:  # q and k side by side in the product: one rotation for both
        qk = _rope(qkv[..., : g.split[0] + g.split[1]].view(S, T, g.hq + g.hkv, g.d), cos, sin, g.rdim)
        q, k = qk[:, :, : g.hq], qk[:, :, g.hq:]
    else:
        if g.gated:
            q, gate = q.view(S, T, g.hq, 2 * g.d).chunk(2, -1)
            gate = gate.reshape(S, T, g.hq * g.d)
        q = q.reshape(S, T, g.hq, g.d)
        k = k.view(S, T, g.hkv, g.d)
        if qn is not None:
            q, k = qn(q), kn(k)
        q, k = _rope(q, cos, sin, g.rdim), _rope(k, cos, sin, g.rdim)
    qg = q.view(S, T, g.hkv, g.hq // g.hkv, g.d).permute(0, 2, 3, 1, 4).reshape(S, g.hkv, g.hq // g.hkv * T, g.d)
    return qg, k.transpose(1, 2), v.transpose(1, 2), gate


def _ctx_rows(pos, ar_t, ar_l, cos, sin, hkv: int, G: int, D: int):
    """`DecodeEngine._ctx` as a pure function: pos [S] first positions, ar_t = arange(T),
    ar_l = arange(L), cos and sin the RoPE tables [cache_len, rdim]."""
    S, T, L = pos.shape[0], ar_t.shape[0], ar_l.shape[0]
    # an active slot's positions lie below L (the entry points choose L from the host's
    # bound of the lengths); the clamp only moves inactive slots' rows, which nothing reads
    p = (pos[:, None] + ar_t).clamp(0, L - 1)  # [S, T]
    cos, sin = cos[p][:, :, None], sin[p][:, :, None]
    idx = p[:, None, :, None].expand(S, hkv, T, D)
    ok = ar_l[None, None, :] <= p[:, :, None]  # [S, T, L]
    mask = torch.zeros(S, T, L, dtype=cos.dtype, device=pos.device).masked_fill(~ok, float("-inf"))
    mask = mask[:, None].expand(S, G, T, L).reshape(S, 1, G * T, L)
    return cos, sin, idx, mask


def _ctx_tree_rows(pos, rows, dep, anc, ar_l, cos, sin, hkv: int, G: int, D: int):
    """`DecodeEngine._ctx_tree` as a pure function (ar_l = arange(L), cos and sin the RoPE tables)."""
    S, L, R, Tb = pos.shape[0], ar_l.shape[0], rows.shape[0], anc.shape[1]
    # (clamped as in `_ctx_rows`: only inactive slots' rows move, which nothing reads)
    p = (pos[:, None] + dep).clamp(0, L - 1)  # [S, R]
    w = (pos[:, None] + rows).clamp(0, L - 1)
    cos, sin = cos[p][:, :, None], sin[p][:, :, None]
    idx = w[:, None, :, None].expand(S, hkv, R, D)
    rel = ar_l[None] - pos[:, None]  # [S, L] a key's row in the block (< 0: before it)
    seen = anc[:, rel.clamp(0, Tb - 1)].permute(1, 0, 2)  # [S, R, L]
    ok = (rel < 0)[:, None] | (seen & (rel < Tb)[:, None])
    mask = torch.zeros(S, R, L, dtype=cos.dtype, device=pos.device).masked_fill(~ok, float("-inf"))
    return cos, sin, idx, mask[:, None].expand(S, G, R, L).reshape(S, 1, G * R, L)


def _dyn(t, *dims):
    """t with `dims` marked dynamic for torch.compile (batch, block and key-length dims: one
    graph for every size ≥ 2 of them, sizes of 1 get their own). -> t"""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


def _mtp_input(toks, w_emb, hrows, we, e_style, wh, h_style, w_eh):
    """The draft layer's input: its tokens' embeddings (toks [S, T] rows of w_emb [V, H]) and
    the row each continues hrows [S, T, H] (the trunk's final row, or its own previous
    output), each normed (styles (eps, f32)), side by side through eh_proj w_eh [H, 2H]
    -> [S, T, H]. (The lookup inside: compiled, it is read by the norm's kernel, not a
    kernel of its own.)"""
    e = F.embedding(toks, w_emb)  # [S, T, H]
    return F.linear(torch.cat([_rms(e, we, *e_style), _rms(hrows, wh, *h_style)], -1), w_eh)

class _Fns(NamedTuple):
    """The fused path's compiled functions (`_fused_fns`)."""

    pre: object
    post: object
    ctx: object
    tree_ctx: object
    mtp_input: object
    kept: object
    tree_choice: object
    plain_end: object
    round_end: object
    put_drafts: object
    pick_greedy: object
    pick_top: object


@functools.lru_cache(maxsize=None)
def _fused_fns(g: _Geo, ln: tuple[float, bool], qk: tuple[float, bool] | None) -> _Fns:
    """The compiled per-step functions of the fused path for one head geometry and norm style
    ((eps, f32) of the layer norms and of the q/k norms, or None).
    Weights come in as tensor arguments, so every layer of a model (and its draft layer)
    shares one graph per shape; what they specialise on is this key, held in the closures.
    Compiled with static shapes but the dims `_dyn` marks (dynamic=True would make every
    weight's dims symbolic too); the attention stays eager between pre and post."""

    def pre(h, ln1, w_qkv, b_qkv, qn, kn, cos, sin, idx, K, V):
        """h [S, T, H] -> `_heads` of its layer (rms_norm, qkv product, q/k norms, rope, layouts)
        as (q, gate), its k and v written to the caches K, V [S, Hkv, cache_len, D] at the rows the
        write index idx [S, Hkv, T, D] names.
        The writes are index_put_ into whole caches (a bucket's leading slots of the engine's
        contiguous cache are contiguous): inductor then writes k and v in place, in the kernel
        that ropes them, where the eager path launches a scatter for each. (A scatter into the
        key-length slice K[:, :, :L], a strided view, is compiled as a copy of the slice, the
        scatter and a copy back.)"""
        qkv = F.linear(_rms(h, ln1, *ln), w_qkv, b_qkv)  # [S, T, (Hq(·2) + 2·Hkv)·D]
        norms = (None, None) if qn is None else (lambda x: _rms(x, qn, *qk), lambda x: _rms(x, kn, *qk))
        q, k, v, gate = _heads(qkv, cos, sin, *norms, g, joint=False)
        S = h.shape[0]
        at = (torch.arange(S, device=h.device)[:, None, None], torch.arange(g.hkv, device=h.device)[None, :, None],
              idx[:, :, :, 0])  # [S, Hkv, T] each, broadcast
        K.index_put_(at, k)
        V.index_put_(at, v)
        return q, gate

    def post(h, o, gate, w_o, ln2, w_gu, w_down, nl, wn=None, n_style=None):
        """The layer after the attention: h [S, T, H], o [S, Hkv, G·T, D] (SDPA's), gate
        [S, T, Hq·D] or None -> the new h [S, T, H] (the residual adds ride on the o and down
        products, as `_add_linear` does in place), normed by wn (style n_style) where given:
        the trunk's last layer and the draft layer end in a norm, fused here, not launched alone."""
        S, T, H = h.shape
        o = _merge_heads(o, gate, g).reshape(S * T, g.hq * g.d)
        h = torch.addmm(h.reshape(S * T, H), o, w_o.t())  # [S·T, H]
        h = torch.addmm(h, _swiglu(_rms(h, ln2, *ln), w_gu, nl), w_down.t()).view(S, T, H)
        return h if wn is None else _rms(h, wn, *n_style)

    def ctx(pos, ar_t, ar_l, cos, sin):
        return _ctx_rows(pos, ar_t, ar_l, cos, sin, g.hkv, g.hq // g.hkv, g.d)

    def tree_ctx(pos, rows, dep, anc, ar_l, cos, sin):
        return _ctx_tree_rows(pos, rows, dep, anc, ar_l, cos, sin, g.hkv, g.hq // g.hkv, g.d)

    return _Fns(*(torch.compile(f, fullgraph=True, dynamic=False) for f in (pre, post, ctx, tree_ctx, _mtp_input, _kept,
                                                                                _tree_choice, _plain_end, _round_end,
                                                                                _put_drafts, _pick_greedy, _pick_top)))
