"""A static-cache decoding engine: every buffer preallocated, one step a
fixed-shape function, captured as a CUDA graph on CUDA (eager elsewhere).

The reference loop (`cortiq.model.generate.generate`) grows its caches with
`torch.cat` and launches every kernel from Python: on an H200 a 135M model ran
at 30 tokens/s there, bound by ~1000 kernel launches a token. Here a token is
one `CUDAGraph.replay()` over static buffers, and nothing waits for the host
except reading the new tokens to stream them.

API (the contract a server builds on; slots are independent requests)
---------------------------------------------------------------------

    eng = DecodeEngine(model, slots=8, max_len=2048, draft=0, sampling=False, graphs=None,
                       buckets=None, kv_buckets=None)
        buckets: batch sizes b the bucketed steps (`step_on(b)`, `spec_on(b, depth)`) run slots
        0..b-1 at; kv_buckets: key lengths those steps' attention may read the caches up to
        (each rounded up to a multiple of 16; max_len is always one). A bucketed step attends
        over the shortest that holds every position its active slots write or read, found from
        the host's upper bound of their lengths; one CUDA graph per batch bucket, key length
        and kind of step. The full-width `step`/`spec_step` read the whole cache.

    first = eng.prefill(slot, ids, temperature=0.0)   # -> int, the slot's first new token
        Runs the prompt `ids` (a list of ints) through the model (the reference
        forward) and writes that slot's caches; the slot becomes active. Other
        slots keep their state: prefill between steps (continuous batching).
        The returned token is "pending": decided, not yet fed to the model.
    firsts = eng.prefill_many(slots, prompts, temperature=0.0)   # -> list[int]
        `prefill` of several slots in one forward, prompts of different lengths.
    toks = eng.step()                # -> LongTensor [slots] on the model's device
        Feeds every active slot's pending token and decides the next one (one
        token per active slot). -1 for inactive slots. The tensor is the
        engine's output buffer: `.tolist()` (the one host sync) or clone it
        before the next step.
    block = eng.steps(n)             # -> LongTensor [n, slots] on the device: n steps, no host sync between
    pred, n = eng.spec_step()        # -> LongTensor [slots, draft+1], LongTensor [slots]
        One speculative round (engine built with draft=k ≥ 1, greedy): the MTP
        block drafts k tokens as a chain, the trunk verifies pending + drafts in
        one forward, and slot s emits the n[s] tokens pred[s, :n[s]]
        (1 ≤ n ≤ k+1; 0 for inactive slots): the accepted drafts and the
        trunk's own next token, which becomes the new pending token. Greedy
        speculative output equals `step()`'s greedy output token for token
        (exactly in f32; in bf16 see below). Same buffer rule as `step`.
    eng.release(slot)                # the slot stops advancing; prefill reuses it
    eng.free_slots() -> list[int];  eng.lengths() -> list[int] (tokens each slot's trunk has seen; syncs)

  `step()` and `spec_step()` may be mixed on a draft engine (its `step` also
  chains the next round's drafts: k draft-layer passes). Slots share one temperature rule: 0 is greedy;
  > 0 samples softmax(logits / T) (engine built with sampling=True; Gumbel-max
  on device). `spec_step` always verifies greedily, whatever the slot's
  temperature. A slot needs room for its prompt plus the tokens it will
  decode plus draft+1 (`max_len`); a step that would overrun raises
  CortiqError naming the slot. Inactive slots compute masked garbage in their
  own rows only (static shapes); prefill overwrites everything of a slot that
  is read.

Layout
------
- Attention KV: K, V [attn_layers, slots, kv_heads, max_len, head_dim] in the
  compute dtype; a slot's entries past its length are stale and masked.
- Gated DeltaNet: conv inputs [lin_layers, slots, C, K-1] and recurrent
  state [lin_layers, slots, Hv, Dk, Dv] f32.
- MTP draft layer: its own K, V [slots, kv_heads, max_len, head_dim].
- Per slot on the device: pending token, trunk length (= position of the
  pending token), the next round's drafts, active flag, temperature.

A speculative round: the trunk verifies [pending, d_1..d_k] (drafted at the
end of the previous round, or by prefill) in one forward; a = the drafts
that equal the trunk's own choices; then one draft-layer pass over the k+1
verified rows (the trunk's hidden rows and tokens) writes the draft's rows
for the accepted positions and is, at row a, the next round's chain step 0;
chain steps 1..k-1 follow. So a round costs one trunk pass and k draft-layer
passes, and the accept count never leaves the device: one graph, one sync.
Rollback: attention entries of rejected drafts are left beyond the slot's new
length (the next round overwrites them before any query can see them); each
GDN layer keeps the state after every token of the verify block and the
state after the accepted prefix is selected on the device.

Why bf16 can differ: the verify forward multiplies k+1 rows at once where
`step` multiplies one; in bf16 the matrix kernels round those products
differently, and where the top two logits are within a rounding step of each
other the argmax can flip. From that token on both outputs are valid greedy
continuations of slightly different numbers. In f32 the rounding is far below
any real logit gap, and the outputs agree.

Speed: q/k/v and gate/up projections run as one matrix product each. The
engine re-points those parameters of the model into one fused tensor per
layer (views: the model computes the same, no copy is kept).

Fused path (`fused`, on by default on CUDA for attention-only models): each
full-attention layer runs as two torch.compile'd halves around the eager SDPA:
`pre` (RMSNorm, the qkv product, q/k norms, RoPE and the grouped layouts, and
the layer's key and value writes into its cache) and `post` (the output gate, the o product and residual, RMSNorm,
the MLP and residual, and the norm that closes the trunk's last layer or the
draft layer), and the step's positions, RoPE rows and mask as a third; the
draft layer's input (its token lookup, two norms, the concatenation and
eh_proj), a round's count of kept drafts, a tree round's choice of branch and
the buffer updates that end a step or a round are compiled too, and a chain
step's positions are an offset into the compiled context's arange: with one slot
a step costs its launches, and a speculative round's own work (its draft passes
and acceptance) is what it launches beyond a plain step (bench/DECODE.md: on
an H100 with one slot a chain round of 3 drafts costs 1.21 plain steps, a tree
round of 4 branches 1.28). The picks (the head's argmax, a tree's top guesses)
reduce a row of logits in two stages (`_argmax`): one reduction of a long row
is one CUDA block, 13 µs of a 1.3 ms step, and a round picks four times.
The weights are arguments, so every layer and the draft layer share one graph
per shape, and a fold's per-layer MLP widths are marked dynamic (one graph for
all). A 135M model's step is bound by kernel launches and small kernels, not by
reading weights: fusing the elementwise work into the products' neighbours cut
the step by about a sixth on an H200 (SmolLM2-135M geometry, bf16, CUDA graphs:
635 -> 752 tok/s at batch 1, 4593 -> 5502 at 8, 17260 -> 20957 at 32;
bench/DECODE.md). The eager methods beside it are the reference the tests
compare it with (caches, hidden rows and logits, every step and round kind).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import FULL, LINEAR
from ..errors import CortiqError
from .decoder import KVState


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
    ar_l = arange(L), cos and sin the RoPE tables [M, rdim]."""
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


class _Tree(NamedTuple):
    """The fixed shape of a draft tree of `nb` branches at the root, each a chain of k drafts
    (`_tree_tables`): the tables its verify blocks and chain steps index with."""

    verify: dict  # depth d -> (rope offsets [T], ancestry [T, T] bool, paths [nb, d+1]); T = 1 + nb·d
    chain: dict  # chain step j (1..k-1) -> (block rows [nb], rope offsets [nb], ancestry rows [nb, nb·(k-1)])


def _tree_tables(nb: int, k: int, dev) -> _Tree:
    """A root-branching draft tree: the draft's top `nb` guesses for the first token, each
    continued greedily to a chain of k (EAGLE-2's tree, cut to its widest level: on a SmolLM2
    draft, measured offline, `nb` chains of the top `nb` first guesses kept more drafts per
    verified row than trees that branch deeper, and four of them twice the chain's drafts a
    round; bench/DECODE.md, "A draft tree"). One verify block holds the pending token
    (row 0) and branch b's drafts 1..d at rows 1 + b·d ..; each row sees row 0 and its own
    branch up to itself, at position pending + its depth. The chain's rows of steps 1..k-1
    lie in a block of nb·(k-1) rows past the chain's first position, branch b's at b·(k-1) ..;
    each sees its own branch's earlier rows."""
    verify = {}
    for d in range(1, k + 1):
        T = 1 + nb * d
        br = torch.cat([torch.tensor([-1]), torch.arange(nb).repeat_interleave(d)])  # [T] branch of a row
        dep = torch.cat([torch.tensor([0]), torch.arange(1, d + 1).repeat(nb)])  # [T] depth of a row
        anc = ((br[:, None] == br[None]) & (dep[None] <= dep[:, None])) | (torch.arange(T) == 0)[None]
        paths = torch.cat([torch.zeros(nb, 1, dtype=torch.long),
                           1 + torch.arange(nb)[:, None] * d + torch.arange(d)[None]], 1)  # [nb, d+1]
        verify[d] = (dep.to(dev), anc.to(dev), paths.to(dev))
    chain = {}
    if k > 1:
        C = k - 1
        br = torch.arange(nb).repeat_interleave(C)  # [nb·C]
        dep = torch.arange(C).repeat(nb)
        anc = (br[:, None] == br[None]) & (dep[None] <= dep[:, None])  # [nb·C, nb·C]
        for j in range(1, k):
            rows = torch.arange(nb) * C + (j - 1)
            chain[j] = (rows.to(dev), dep[rows].to(dev), anc[rows].to(dev))
    return _Tree(verify, chain)


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


def _split(V: int) -> int:
    """The chunk width of `_argmax` and `_topk` over a vocabulary of V: its smallest divisor in
    1024..4096, or 0 (one reduction over the row) where it has none."""
    return next((c for c in range(1024, 4097) if V % c == 0), 0)


def _argmax(x, c: int):
    """x [..., V] -> [...] the index of the largest, the first of equals (as argmax), in two
    stages over chunks of c (`_split`: c divides V): each chunk's maximum, then the first chunk
    holding the largest. One reduction over a long row runs as one CUDA block per row: 13 µs
    for SmolLM2's 49152 logits on an H100 at one slot, launched by every pick of a step."""
    if not c:
        return x.argmax(-1)
    v, i = x.unflatten(-1, (-1, c)).max(-1)  # [..., V/c]: each chunk's maximum, first of equals
    j = v.argmax(-1, keepdim=True)  # [..., 1]
    return (j * c + i.gather(-1, j))[..., 0]


def _topk(x, k: int, c: int):
    """x [..., V] -> [..., k] the indices of the k largest, largest first (as topk), in two
    stages as `_argmax`: each chunk's top k, then the top k of those candidates."""
    if not c:
        return x.topk(k, -1).indices
    v, i = x.unflatten(-1, (-1, c)).topk(k, -1)  # [..., V/c, k]
    i = i + torch.arange(0, x.shape[-1], c, device=x.device)[:, None]  # indices into the row
    j = v.flatten(-2).topk(k, -1).indices  # [..., k] into the candidates
    return i.flatten(-2).gather(-1, j)


def _pick_greedy(h, head, c: int):
    """h [S, T, H] -> the head's argmax [S, T] (`_argmax`)."""
    return _argmax(F.linear(h, head), c)


def _pick_top(h, head, k: int, c: int):
    """h [S, H] -> the head's top k [S, k], largest first (`_topk`)."""
    return _topk(F.linear(h, head), k, c)


def _kept(tok, pred):
    """Drafts kept along the last dim: tok [..., d+1] a verify block's tokens (the pending one,
    then the drafts), pred [..., d+1] the trunk's token after each -> [...] the length of the
    agreeing prefix."""
    return (tok[..., 1:] == pred[..., :-1]).long().cumprod(-1).sum(-1)


def _tree_choice(block, pred, paths, pos, ar_d, top: int):
    """A tree round's verdict, from the verify block's tokens block [S, T], the trunk's token
    after each pred [S, T] and each branch's block rows paths [nb, d+1] in order: the branch
    keeping the most drafts (the first of equals) -> (its rows path [S, d+1], its trunk tokens
    [S, d+1], its drafts kept [S], and the cache positions its keys and values move from and
    to, src and dst [S, d+1], after the pending positions pos [S]; ar_d = arange(d+1); clamped
    to top, as an inactive slot may point anywhere)."""
    tok_b, pred_b = block[:, paths], pred[:, paths]  # [S, nb, d+1]: each branch's rows in order
    kept = _kept(tok_b, pred_b)  # [S, nb]
    best = kept.argmax(-1)  # [S]
    path = paths[best]  # [S, d+1]
    pred_k = pred_b.gather(1, best[:, None, None].expand(-1, 1, pred_b.shape[-1]))[:, 0]  # [S, d+1]
    return (path, pred_k, kept.gather(1, best[:, None])[:, 0], (pos[:, None] + path).clamp(max=top),
            (pos[:, None] + ar_d).clamp(max=top))


def _plain_end(pend, pos, out_tok, act, nxt):
    """The end of a plain step, on the engine's buffers in place: an active slot's pending
    token pend [S] and output out_tok [S] become nxt [S] (an inactive slot's output -1), its
    position pos [S] moves on by one."""
    pend.copy_(torch.where(act, nxt, pend))
    pos.add_(act.long())
    out_tok.copy_(torch.where(act, nxt, -1))


def _round_end(pend, pos, out_pred, out_n, mtp_last, act, pred, a, row):
    """The end of a round, on the engine's buffers in place, from the verified block's trunk
    tokens pred [S, d+1], the drafts kept a [S] and the draft's row after the last kept one,
    row [S, 1, H] (the next chain's step 0, kept in mtp_last): an active slot's pending token
    becomes the trunk's token after its last kept row, its position moves on by a+1;
    out_pred[:, :d+1] and out_n [S] (0 where inactive) say what the round decided."""
    n = (a + 1) * act.long()
    mtp_last.copy_(row)
    pend.copy_(torch.where(act, pred.gather(1, a[:, None])[:, 0], pend))
    pos.add_(n)
    out_pred[:, : pred.shape[1]].copy_(pred)
    out_n.copy_(n)


def _put_drafts(drafts, act, new):
    """A chain's drafts, the list new of [S, nb] per chain step, into drafts [S, nb·k] in place
    (branch b's chain at b·k..), an active slot's only."""
    S = drafts.shape[0]
    drafts.copy_(torch.where(act[:, None], torch.stack(new, 2).reshape(S, -1), drafts))


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
        as (q, gate), its k and v written to the caches K, V [S, Hkv, M, D] at the rows the
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


def auto_branches(arch, dev) -> int:
    """A draft tree's branches where a command's setting leaves them to the engine (0): 4 where a
    tree runs and pays, a CUDA device and a model of attention layers only (on an H100,
    SmolLM2-135M, 3 drafts a round: a tree of 4 served ×1.60 of plain to one chat client where
    the chain served ×1.43, ×1.14 at 32 where the chain served ×1.06; bench/DECODE.md),
    else 1, the chain (a CPU pays for the verify rows in compute; a Gated DeltaNet state holds
    one branch)."""
    return 4 if torch.device(dev).type == "cuda" and LINEAR not in arch.layer_types else 1


def cache_len(max_len: int, draft: int = 0, branches: int = 1) -> int:
    """Positions the engine's caches hold a slot (its M): max_len, and for a draft tree the
    rows a round writes past it (a tree round writes up to nb·(depth + k) positions past a
    slot's length, its verify block and its branches' chain rows, where a chain writes
    depth + k), 16-aligned (the key length of the attention masks)."""
    return -(-(max_len + (branches - 1) * 2 * draft) // 16) * 16


class DecodeEngine:
    """Static-cache decoding over `slots` independent sequences (module docstring: the API)."""

    def __init__(self, model, slots: int = 1, max_len: int = 1024, draft: int = 0, sampling: bool = False,
                 graphs: bool | None = None, seed: int = 0, buckets: list[int] | None = None,
                 kv_buckets: list[int] | None = None, fused: bool | None = None, branches: int = 1):
        arch = model.arch
        if slots < 1:
            raise CortiqError(f"decode engine: {slots} slots, need at least 1")
        if draft < 0:
            raise CortiqError(f"decode engine: draft {draft}, need 0 (plain) or more")
        if draft and model.mtp is None:
            raise CortiqError("speculative decoding needs an MTP draft block (model.mtp.*); this model has none")
        if max_len < draft + 2:
            raise CortiqError(f"decode engine: max_len {max_len} leaves no room to decode")
        if branches < 1 or (branches > 1 and not draft):
            raise CortiqError(f"decode engine: {branches} draft branches need a draft (draft ≥ 1, branches ≥ 1)")
        if branches > 1 and LINEAR in arch.layer_types:
            raise CortiqError("decode engine: a draft tree (branches > 1) runs attention-only models (a Gated "
                              "DeltaNet state cannot hold several branches)")
        self.model, self.arch = model, arch
        w = model.model.embed_tokens.weight
        self.dev, self.dt = w.device, w.dtype
        self.S, self.k, self.nb = slots, draft, branches
        self.M = M = cache_len(max_len, draft, branches)
        # key lengths a bucketed step attends over (each 16-aligned, the last M): a step whose
        # slots all lie below L reads only the first L positions of the caches
        kv = sorted({min(M, -(-int(x) // 16) * 16) for x in (kv_buckets or []) if int(x) > 0} | {M})
        self.kv_sizes = kv
        self.L = M  # the key length the next step's attention reads (set by each entry point)
        self.max_len = max_len
        self.sampling = sampling
        self.graphs = (self.dev.type == "cuda") if graphs is None else graphs
        if self.graphs and self.dev.type != "cuda":
            raise CortiqError("decode engine: CUDA graphs need a CUDA device")
        dev, dt = self.dev, self.dt
        layers = list(model.layers)
        self.kinds = list(arch.layer_types)
        self.attn_idx = [i for i, t in enumerate(self.kinds) if t == FULL]
        self.lin_idx = [i for i, t in enumerate(self.kinds) if t == LINEAR]
        self.slot_of = {}  # layer index -> its index among layers of its kind
        for j, i in enumerate(self.attn_idx):
            self.slot_of[i] = j
        for j, i in enumerate(self.lin_idx):
            self.slot_of[i] = j
        with torch.no_grad():
            self.att = {i: _Attn(layers[i]) for i in self.attn_idx}
            self.lin = {}
            for i in self.lin_idx:
                g = layers[i].linear_attn
                mods = [g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a]  # one product for the four
                self.lin[i] = (_Norm(layers[i].input_layernorm), _Norm(layers[i].post_attention_layernorm),
                               _Mlp(layers[i].mlp), _fuse(mods)[0], [m.weight.shape[0] for m in mods])
            self.final = _Norm(model.model.norm)
            hkv, D = arch.num_kv_heads, arch.head_dim
            self.hkv, self.hq, self.D = hkv, arch.num_heads, D
            self.G = self.hq // hkv
            z = lambda *s, dtype=dt: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
            self.K = z(len(self.attn_idx), slots, hkv, M, D)
            self.V = z(len(self.attn_idx), slots, hkv, M, D)
            if self.lin_idx:
                g0 = layers[self.lin_idx[0]].linear_attn
                C = 2 * g0.key_dim + g0.value_dim
                self.conv = z(len(self.lin_idx), slots, C, g0.K - 1)
                self.rec = z(len(self.lin_idx), slots, g0.hv, g0.dk, g0.dv, dtype=torch.float32)
            if draft:
                mtp = model.mtp
                self.mtp_att = _Attn(mtp.layers[0])
                self.mtp_e, self.mtp_h, self.mtp_out = _Norm(mtp.enorm), _Norm(mtp.hnorm), _Norm(mtp.norm)
                self.MK, self.MV = z(slots, hkv, M, D), z(slots, hkv, M, D)
                # the draft's output row the next chain starts from (kept so a step that skipped
                # the chain can have it run later: `spec_on` after `step_on(chain=False)`)
                self.mtp_last = z(slots, 1, arch.hidden_size)
            # per-slot state
            self.pend = z(slots, dtype=torch.long)
            self.pos = z(slots, dtype=torch.long)  # tokens the trunk has seen = position of the pending token
            # the next round's drafts, chained ahead: branch-major [S, nb·k] (branch b's chain at b·k..)
            self.drafts = z(slots, max(draft, 1) * branches, dtype=torch.long)
            self.active = z(slots, dtype=torch.bool)
            self.temp = z(slots, dtype=torch.float32)
            self.out_tok = z(slots, dtype=torch.long)
            self.out_pred = z(slots, draft + 1, dtype=torch.long)
            self.out_n = z(slots, dtype=torch.long)
            self.ar = torch.arange(M + branches * draft + 1, device=dev)
            if branches > 1:
                self._tree = _tree_tables(branches, draft, dev)
            self.slot_ar = torch.arange(slots, device=dev)
            cos, sin = model.rope(torch.arange(M, device=dev))  # same values as the reference's per-call rope
            half = sin.shape[-1] // 2
            self.cos, self.sin = cos.to(dt), torch.cat([-sin[:, :half], sin[:, half:]], -1).to(dt)
        self.head = model.head_weight
        self._chunk = _split(self.head.shape[0])  # the picks' chunk width (`_argmax`)
        on = (self.dev.type == "cuda" and not self.lin_idx) if fused is None else bool(fused)
        self._fn, self._ragged = self._compiled() if on else (None, False)
        self.fused = self._fn is not None
        self.gen = torch.Generator(device=dev).manual_seed(seed) if (sampling and not self.graphs) else None
        if sampling and self.graphs:
            torch.cuda.manual_seed(seed)  # captured RNG draws from the default CUDA generator
        self._hi = [0] * slots  # host-side upper bound of each slot's length
        self.hi_reads = 0  # times that bound was read back from the device (it is exact then)
        self._on = [False] * slots
        self._g_step = self._g_spec = None
        self.buckets = sorted(set(buckets or [])) or [slots]
        if self.buckets[-1] != slots or self.buckets[0] < 1:
            raise CortiqError(f"decode engine: buckets {self.buckets} must lie in 1..{slots} and end at {slots}")
        self._views: dict[int, "DecodeEngine"] = {}
        self._bucket_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._stale = False  # a step skipped the chain: the drafts are not those of the current rows
        if self.graphs:
            self._capture_steps(bool(buckets))

    def _capture_steps(self, bucketed: bool) -> None:
        """The step graphs: one per bucket and kind of step, or the full step (and round)."""
        if bucketed:
            self._capture_buckets()
            self._g_step = self._bucket_graphs[("plain", self.S, True, self.M)]
            self._g_spec = self._bucket_graphs.get(("spec", self.S, self.k, self.M, True))
        else:
            self._g_step = self._capture(self._plain)
            if self.k:
                self._g_spec = self._capture(self._spec)

    # ── public API ──
    @torch.no_grad()
    def prefill(self, slot: int, ids, temperature: float = 0.0) -> int:
        job = self.prefill_job(slot, ids, temperature)
        first = None
        while first is None:
            first = job.run()
        return first

    def prefill_job(self, slot: int, ids, temperature: float = 0.0, chunk: int = 0) -> "PrefillJob":
        """`prefill` a chunk of `chunk` prompt tokens per `run()` (0: all at once), so a
        caller can interleave a long prompt's forwards with other slots' steps. The slot
        stays inactive (and its caches unread) until the last chunk installs it."""
        return PrefillJob(self, slot, ids, temperature, chunk)

    @torch.no_grad()
    def prefill_many(self, slots, prompts, temperature: float = 0.0) -> list[int]:
        """`prefill` of several slots at once, prompts of any lengths: one reference forward
        over the prompts right-padded to the longest (causal attention: a row's real tokens
        never see its padding), each slot's caches written from its own rows, its first token
        picked at its own last row. -> the first tokens, one host sync. A model with Gated
        DeltaNet layers (whose state would run on through the padding) prefills the prompts
        of each length together; an engine with a draft prefills slot by slot."""
        slots, prompts = [int(s) for s in slots], [[int(t) for t in p] for p in prompts]
        if len(slots) != len(prompts) or len(set(slots)) != len(slots):
            raise CortiqError(f"decode engine: slots {slots} for {len(prompts)} prompts (one distinct slot each)")
        if self.k:
            return [self.prefill(s, p, temperature) for s, p in zip(slots, prompts)]
        for s, p in zip(slots, prompts):
            self._check_prefill(s, p, temperature)
        groups = [list(range(len(prompts)))]
        if self.lin_idx:
            by: dict[int, list[int]] = {}
            for i, p in enumerate(prompts):
                by.setdefault(len(p), []).append(i)
            groups = list(by.values())
        first = [0] * len(prompts)
        for g in groups:
            for i, t in zip(g, self._prefill_rows([slots[i] for i in g], [prompts[i] for i in g], temperature)):
                first[i] = t
        return first

    def _check_prefill(self, slot: int, ids: list[int], temperature: float) -> None:
        if not 0 <= slot < self.S:
            raise CortiqError(f"decode engine: slot {slot} outside 0..{self.S - 1}")
        if not ids:
            raise CortiqError("generate: empty prompt")
        if len(ids) + self.k + 1 > self.max_len:
            raise CortiqError(f"decode engine: a prompt of {len(ids)} tokens leaves no room in max_len {self.max_len}")
        if temperature > 0 and not self.sampling:
            raise CortiqError("decode engine: temperature > 0 needs an engine built with sampling=True")
        if temperature < 0:
            raise CortiqError(f"temperature {temperature}: must be ≥ 0")

    def _prefill_rows(self, slots: list[int], prompts: list[list[int]], temperature: float) -> list[int]:
        """Prefill of plain (draft-less) slots from one padded forward (prefill_many)."""
        m, dev = self.model, self.dev
        lens = [len(p) for p in prompts]
        n = max(lens)
        t = torch.tensor([p + [p[-1]] * (n - len(p)) for p in prompts], device=dev)  # [B, n]
        cache = m.new_cache()
        H, _ = m.forward_hidden(t, cache=cache)  # [B, n, H]
        idx = torch.tensor(slots, device=dev)
        L = torch.tensor(lens, device=dev)
        for i in self.attn_idx:  # entries past a slot's length are stale and masked, as after any prefill
            st, j = cache.states[i], self.slot_of[i]
            self.K[j, idx, :, :n] = st.k
            self.V[j, idx, :, :n] = st.v
        for i in self.lin_idx:  # one length per group here: the state after its last token
            st, j = cache.states[i], self.slot_of[i]
            self.conv[j, idx] = st.conv
            self.rec[j, idx] = st.rec
        self.temp[idx] = temperature
        last = H[torch.arange(len(prompts), device=dev), L - 1][:, None]  # [B, 1, H]
        first = self._pick(last, self.temp[idx])[:, 0]
        self.pend[idx] = first
        self.pos[idx] = L
        self.active[idx] = True
        for s, k in zip(slots, lens):
            self._hi[s], self._on[s] = k, True
        return first.tolist()

    def _at(self, L: int, fn, *args):
        """fn(*args) with the attention reading the first L cache positions."""
        self.L = L
        return fn(*args)

    def _kv_for(self, b: int, depth: int) -> int:
        """The shortest key length that holds every position a step over slots 0..b-1 verifying
        `depth` drafts writes or reads: the trunk's block (the pending token and the drafts)
        and the draft's chain after it, from the host's upper bound of each active slot's length."""
        hi = max((self._hi[s] for s in range(b) if self._on[s]), default=0)
        need = hi + self.nb * (depth + self.k) + 1  # a tree's block and chain rows: nb times a chain's
        return next((L for L in self.kv_sizes if L >= need), self.M)

    @torch.no_grad()
    def steps(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`n` plain steps with no host sync between them: -> LongTensor [n, slots] on the device
        (row i: `step`'s tokens of step i; written into `out` when given). The room check runs
        once for all n."""
        if out is None:
            out = torch.empty(n, self.S, dtype=torch.long, device=self.dev)
        self._room(n)
        self.L = self.M
        for i in range(n):
            if self._g_step is not None:
                self._g_step.replay()
            else:
                self._plain()
            out[i].copy_(self.out_tok)
        for s in range(self.S):
            self._hi[s] += n * self._on[s]
        return out

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.S:
            raise CortiqError(f"decode engine: slot {slot} outside 0..{self.S - 1}")
        self.active[slot] = False
        self._on[slot] = False

    def free_slots(self) -> list[int]:
        return [s for s in range(self.S) if not self._on[s]]

    def lengths(self) -> list[int]:
        return self.pos.tolist()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        self._room(1)
        self.L = self.M
        if self._g_step is not None:
            self._g_step.replay()
        else:
            self._plain()
        for s in range(self.S):
            self._hi[s] += self._on[s]
        return self.out_tok

    @torch.no_grad()
    def spec_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.k:
            raise CortiqError("decode engine: spec_step needs an engine built with draft ≥ 1")
        self._room(self.k + 1)
        self.L = self.M
        if self._g_spec is not None:
            self._g_spec.replay()
        else:
            self._spec()
        for s in range(self.S):
            self._hi[s] += (self.k + 1) * self._on[s]
        return self.out_pred, self.out_n

    # ── internals ──
    def _compiled(self):
        """The fused path's compiled functions and whether the MLP widths differ between layers
        (a fold of global scope: their width dims are then marked dynamic too, one graph for
        all widths), or (None, False) where the attention layers differ in geometry or norm
        style (never within one arch: the eager path then runs)."""
        layers = list(self.att.values()) + ([self.mtp_att] if self.k else [])
        keys = {(L.geo, L.styles()) for L in layers}
        geo, styles = next(iter(keys), (None, None))
        if len(keys) != 1 or styles is None:
            return None, False
        # one graph per (shape class, geometry) and compiled function: raise dynamo's limit of
        # 8 per function, as `CausalLM.compile_layers` does, for several engines in a process
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        return _fused_fns(geo, *styles), len({L.mlp.width for L in layers}) > 1

    def _room(self, need: int) -> None:
        """Every active slot must fit `need` more positions (and the verify block) in max_len."""
        if not any(self._on[s] and self._hi[s] + need + self.k > self.max_len for s in range(self.S)):
            return
        self._hi = self.pos.tolist()  # the bound was loose (rejected drafts): read the exact lengths
        self.hi_reads += 1
        for s in range(self.S):
            if self._on[s] and self._hi[s] + need + self.k > self.max_len:
                raise CortiqError(f"decode engine: slot {s} is full ({self._hi[s]} of max_len {self.max_len} positions)")

    def _capture(self, fn, pool=None):
        """Warm up on a side stream (lazy cuBLAS/attention workspaces), then record one call.
        Done at construction, while every slot is inactive: the warm-up only writes masked rows."""
        s = torch.cuda.Stream(self.dev)
        s.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool), torch.no_grad():
            fn()
        torch.cuda.synchronize(self.dev)
        return g

    def _pick(self, h, temp=None):
        """h [S, T, H] -> next tokens [S, T]: argmax, or a Gumbel-max sample where temp [S] > 0."""
        head = self.head.to(h.dtype)
        if not self.sampling or temp is None:
            return self._twin(_pick_greedy, _dyn(h, 0, 1), head, self._chunk)
        lf = F.linear(h, head).float()  # [S, T, V]
        e = torch.empty_like(lf).exponential_(generator=self.gen)
        t = temp[:, None, None]
        scores = torch.where(t > 0, lf / t.clamp_min(1e-6) - e.log(), lf)
        return _argmax(scores, self._chunk)

    def _ctx(self, pos, T, off: int = 0):
        """Positions [S, T] from first positions pos [S] + off (clamped: inactive
        slots may point anywhere), with RoPE [S, T, 1, rdim], the KV write
        index [S, Hkv, T, D] and the additive mask [S, 1, G·T, L] (query row
        g·T + t of a KV head sees keys ≤ its position; L the key length of this step).
        (off shifts the arange, not pos: no kernel of its own for a chain step's position.)"""
        ar_t, ar_l = self.ar[off: off + T], self.ar[: self.L]
        if self._fn is None:
            return _ctx_rows(pos, ar_t, ar_l, self.cos, self.sin, self.hkv, self.G, self.D)
        cos, sin, idx, mask = self._fn.ctx(_dyn(pos, 0), _dyn(ar_t, 0), _dyn(ar_l, 0), _dyn(self.cos, 0),
                                           _dyn(self.sin, 0))
        return _dyn(cos, 0, 1), _dyn(sin, 0, 1), idx, mask

    def _ctx_tree(self, pos, rows, dep, anc):
        """`_ctx` for rows of a tree block whose rows lie at cache positions pos.. (pos [S]):
        query rows `rows` [R] of the block, row r written at pos + rows[r] and roped at
        pos + dep[r]; every key before pos is seen, a key of the block where anc [R, Tb] says
        (its ancestors and itself). -> (cos, sin [S, R, 1, rdim], write index [S, Hkv, R, D],
        mask [S, 1, G·R, L]) as `_ctx`."""
        ar_l = self.ar[: self.L]
        if self._fn is None:
            return _ctx_tree_rows(pos, rows, dep, anc, ar_l, self.cos, self.sin, self.hkv, self.G, self.D)
        cos, sin, idx, mask = self._fn.tree_ctx(_dyn(pos, 0), rows, dep, anc, _dyn(ar_l, 0), _dyn(self.cos, 0),
                                                _dyn(self.sin, 0))
        return _dyn(cos, 0, 1), _dyn(sin, 0, 1), idx, mask

    def _attn(self, L: _Attn, h, ctx, K, V, norm: _Norm | None = None):
        """A full-attention decoder layer on h [S, T, H] (updated in place: the residual
        adds ride on the o and down products), writing its keys and values to K, V [S, Hkv, M, D];
        its output normed by `norm` where given."""
        if self._fn is not None:
            return self._attn_fused(L, h, ctx, K, V, norm)
        cos, sin, idx, mask = ctx
        a = L.a
        K, V = K[:, :, : self.L], V[:, :, : self.L]  # the live part of the caches (views: writes land in them)
        x = L.ln1(h)
        qkv = F.linear(x, L.w_qkv, L.b_qkv)  # [S, T, (Hq(·2) + 2·Hkv)·D]
        qg, k, v, gate = _heads(qkv, cos, sin, L.qn, L.kn, L.geo)  # [S, Hkv, G·T, D], [S, Hkv, T, D] ×2
        K.scatter_(2, idx, k)
        V.scatter_(2, idx, v)
        o = F.scaled_dot_product_attention(qg, K, V, attn_mask=mask)  # [S, Hkv, G·T, D]
        h = _add_linear(h, _merge_heads(o, gate, L.geo), a.o_proj.weight)
        h = L.mlp.add_to(h, L.ln2(h))
        return h if norm is None else norm(h)

    def _attn_fused(self, L: _Attn, h, ctx, K, V, norm: _Norm | None = None):
        """`_attn` through the compiled halves (`_fused_fns`): pre (which writes the caches) and
        post around the eager attention. -> a new h [S, T, H] (h itself is left as it was)."""
        cos, sin, idx, mask = ctx
        pre, post = self._fn.pre, self._fn.post
        # every weight detached: dynamo guards on requires_grad (a fused view of parameters may
        # carry it) and holds a parameter's shape static (a fold's MLP widths differ between
        # layers); the modules' own weights as they are now, as the eager path reads them
        qn, kn = (None, None) if L.qn is None else (L.qn.w, L.kn.w)
        b_qkv = None if L.b_qkv is None else L.b_qkv.detach()
        q, gate = pre(_dyn(h, 0, 1), L.ln1.w, L.w_qkv.detach(), b_qkv, qn, kn, cos, sin, idx, _dyn(K, 0), _dyn(V, 0))
        o = F.scaled_dot_product_attention(q, K[:, :, : self.L], V[:, :, : self.L], attn_mask=mask)  # [S, Hkv, G·T, D]
        m = L.mlp.mlp
        w_gu, w_down = L.mlp.w_gu.detach(), m.down_proj.weight.detach()
        nl = None if m.neuron_logits is None else m.neuron_logits.detach()
        if self._ragged:
            _dyn(w_gu, 0)
            _dyn(w_down, 1)
            if nl is not None:
                _dyn(nl, 0)
        wn, n_style = (None, None) if norm is None else (norm.w, (norm.eps, norm.f32))
        return post(h, _dyn(o, 0, 2), None if gate is None else _dyn(gate, 0, 1), L.a.o_proj.weight.detach(),
                    L.ln2.w, w_gu, w_down, nl, wn, n_style)

    def _gdn(self, i, h):
        """A GDN decoder layer on h [S, T, H] from the slot states; -> (h, conv
        window [S, C, K-1+T], state after each token [S, T, Hv, Dk, Dv]). The
        state is not written: the caller commits the accepted prefix's."""
        ln1, ln2, mlp, w_in, split = self.lin[i]
        j = self.slot_of[i]
        g = self.model.layers[i].linear_attn
        S, T, _ = h.shape
        x = ln1(h)
        qkv, z, b, a = F.linear(x, w_in).split(split, -1)
        qkv = qkv.transpose(1, 2)  # [S, C, T]
        full = torch.cat([self.conv[j].to(qkv.dtype), qkv], -1)  # [S, C, K-1+T]
        # the causal depthwise conv as windows × taps (a CPU conv1d call on a few columns costs ~80 ms)
        y = F.silu((full.unfold(2, g.K, 1) * g.conv1d.weight[:, 0, None, :]).sum(-1)).transpose(1, 2)  # [S, T, C]
        q, k, v = y.split([g.key_dim, g.key_dim, g.value_dim], -1)
        from .gdn import l2norm

        q = l2norm(q.reshape(S, T, g.hk, g.dk).float())
        k = l2norm(k.reshape(S, T, g.hk, g.dk).float())
        v = v.reshape(S, T, g.hv, g.dv)
        if g.hv != g.hk:
            q = q.repeat_interleave(g.hv // g.hk, 2)
            k = k.repeat_interleave(g.hv // g.hk, 2)
        beta = b.float().sigmoid()  # [S, T, Hv]
        gl = -g.A_log.float().exp() * F.softplus(a.float() + g.dt_bias.float())  # [S, T, Hv]
        # the reference recurrence (gated_delta_rule_ref), keeping the state after every token
        q, k = q.to(v.dtype).float() * g.dk ** -0.5, k.to(v.dtype).float()
        vf = v.float()
        St = self.rec[j]
        outs, states = [], []
        for t in range(T):  # T ≤ draft+1: a fixed unroll inside the captured step
            St = St * gl[:, t].exp()[..., None, None]
            kv = torch.einsum("bhkv,bhk->bhv", St, k[:, t])
            delta = (vf[:, t] - kv) * beta[:, t, :, None]
            St = St + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", St, q[:, t]))
            states.append(St)
        o = torch.stack(outs, 1).to(v.dtype)  # [S, T, Hv, Dv]
        z = z.reshape(S, T, g.hv, g.dv)
        o = g.norm(o, z).reshape(S, T, g.value_dim)
        h = _add_linear(h, o, g.out_proj.weight)
        return mlp.add_to(h, ln2(h)), full, torch.stack(states, 1)

    def _trunk(self, tok, pos, ctx=None):
        """The trunk on tokens [S, T] at positions pos.. (or as `ctx` places them) -> (final
        hidden [S, T, H], GDN pending states)."""
        T = tok.shape[1]
        ctx = self._ctx(pos, T) if ctx is None else ctx
        h = self.model.embed(tok)
        pending = []
        last = len(self.kinds) - 1
        for i in range(len(self.kinds)):
            if i in self.att:
                j = self.slot_of[i]
                h = self._attn(self.att[i], h, ctx, self.K[j], self.V[j], self.final if i == last else None)
            else:
                h, full, states = self._gdn(i, h)
                pending.append((self.slot_of[i], full, states))
        return (h if last in self.att else self.final(h)), pending

    def _commit(self, pending, a):
        """GDN states after the first a[s]+1 tokens of the block (a [S])."""
        for j, full, states in pending:
            K1 = self.conv.shape[-1]
            idx = (a + 1)[:, None, None] + torch.arange(K1, device=self.dev)  # [S, 1, K-1]
            self.conv[j].copy_(full.gather(2, idx.expand(-1, full.shape[1], -1)))
            self.rec[j].copy_(states[self.slot_ar, a])

    def _mtp(self, hrows, toks, pos0, ctx=None, off: int = 0):
        """The MTP block on trunk rows hrows [S, T, H] and the tokens after them [S, T] at positions
        pos0 + off.. (or as `ctx` places them)."""
        ctx = self._ctx(pos0, toks.shape[1], off) if ctx is None else ctx
        ne, nh = self.mtp_e, self.mtp_h
        x = self._twin(_mtp_input, _dyn(toks, 0, 1), self.model.model.embed_tokens.weight.detach(), _dyn(hrows, 0, 1),
                       ne.w, (ne.eps, ne.f32), nh.w, (nh.eps, nh.f32), self.model.mtp.eh_proj.weight.detach())
        return self._attn(self.mtp_att, x, ctx, self.MK, self.MV, self.mtp_out)

    def _draft_pick(self, xh, j: int, base, slots):
        """Draft token of chain step j from the draft's row xh [S', 1, H] -> [S', 1]: greedy.
        (base [S']: position of the round's pending token, so step j guesses token base+1+j;
        slots [S']: whose rows. The tests override this to steer which drafts are right.)"""
        return self._pick(xh)

    def _draft_first(self, xh, base, slots):
        """Chain step 0's drafts from the draft's row xh [S', 1, H] -> [S', nb]: the greedy one
        (`_draft_pick`), or with a tree the draft's top nb, best first."""
        if self.nb == 1:
            return self._draft_pick(xh, 0, base, slots)
        return self._twin(_pick_top, _dyn(xh[:, 0], 0), self.head.to(xh.dtype), self.nb, self._chunk)

    def _chain(self, out0, base):
        """The next round's drafts from the draft's row out0 [S, 1, H] at position base-1
        (chain step 0): steps 1..k-1 each read the previous step's row and token. With a tree,
        each of the nb first guesses runs its own chain, the branches side by side as the rows
        of one block (`_tree_tables`): a step costs the launches of one chain's."""
        first = self._draft_first(out0, base, self.slot_ar)  # [S, nb]
        drafts = [first]
        xh, d = out0.expand(-1, self.nb, -1), first
        for j in range(1, self.k):
            ctx = None if self.nb == 1 else self._ctx_tree(base, *self._tree.chain[j])
            xh = self._mtp(xh, d, base, ctx, off=j - 1)  # at positions base-1+j
            d = self._draft_pick(xh, j, base, self.slot_ar)  # [S, nb]
            drafts.append(d)
        self._by_slot(_put_drafts, self.drafts, self.active, drafts)

    def _plain(self, chain: bool = True):
        act = self.active
        tok = self.pend[:, None]  # [S, 1]
        H, pending = self._trunk(tok, self.pos)
        nxt = self._pick(H, self.temp)  # [S, 1]
        if pending:
            self._commit(pending, torch.zeros_like(self.pos))
        if self.k:  # keep the draft ready: its row for the token just decided, then the chain
            out0 = self._mtp(H, nxt, self.pos)
            self.mtp_last.copy_(out0)
            if chain:
                self._chain(out0, self.pos + 1)
        self._by_slot(_plain_end, self.pend, self.pos, self.out_tok, act, nxt[:, 0])

    def _spec(self, depth: int | None = None, tree: bool = True):
        """One round, verifying the first `depth` drafts (default all k). At its start a slot's
        trunk has seen positions 0..n-1 (n = pos), its pending token n and the k drafts after it
        are decided, and the draft's rows up to n-1 read the trunk's own rows (rows past them,
        the chain's guesses)."""
        d = self.k if depth is None else depth
        if self.nb > 1 and tree:
            return self._spec_tree(d)
        # (a chain round: on a tree engine, branch 0's drafts, the greedy chain, lead the row)
        pos = self.pos
        block = torch.cat([self.pend[:, None], self.drafts[:, :d]], 1)  # [S, d+1] at positions n..n+d
        Hv, pending = self._trunk(block, pos)
        pred = self._pick(Hv)  # [S, d+1]: the trunk's token after each block token
        a = self._by_slot(_kept, block, pred)  # [S] drafts accepted
        self._commit(pending, a)
        self._verified(Hv, pred, a)

    def _spec_tree(self, d: int):
        """`_spec` over a draft tree: one trunk pass verifies every branch's first d drafts
        (`_tree_tables`), the branch keeping the most wins (the first of equals: branch 0, the
        greedy chain, so a tree never keeps fewer than the chain), its rows' keys and values
        move to follow the pending token, and the round ends as a chain's would on that branch."""
        S, pos, ar = self.S, self.pos, self.slot_ar
        dep, anc, paths = self._tree.verify[d]
        T = anc.shape[0]
        block = torch.cat([self.pend[:, None], self.drafts.view(S, self.nb, self.k)[:, :, :d].reshape(S, -1)], 1)
        Hv, _ = self._trunk(block, pos, self._ctx_tree(pos, self.ar[:T], dep, anc))  # [S, T, H]
        pred = self._pick(Hv)  # [S, T]
        # (compiled, one or two fused kernels where eager launches a dozen)
        path, pred_k, kept_k, src, dst = self._twin(_tree_choice, _dyn(block, 0), _dyn(pred, 0), paths, _dyn(pos, 0),
                                                    self.ar[: d + 1], self.M - 1)
        self._relocate(src, dst)  # the kept branch's rows then lie where a chain's would
        self._verified(Hv[ar[:, None], path], pred_k, kept_k)

    def _twin(self, fn, *args):
        """fn(*args), or on the fused path its compiled twin in `_Fns` (the same name without the
        underscore), where its small operators become a kernel or two. The caller marks the
        args' dynamic dims (`_dyn`: slots, block rows; an eager call ignores the marks)."""
        return (fn if self._fn is None else getattr(self._fn, fn.__name__[1:]))(*args)

    def _by_slot(self, fn, *args):
        """`_twin` of a small function fn of tensors (or lists of them) whose first dim is the
        slot (`_kept`; `_plain_end`, `_round_end`, `_put_drafts`, which update buffers in place),
        that dim marked dynamic in each: one graph for all buckets ≥ 2."""
        return self._twin(fn, *[[_dyn(x, 0) for x in a] if isinstance(a, list) else _dyn(a, 0) for a in args])

    def _relocate(self, src, dst):
        """Keys and values at cache positions src [S, d+1] to dst [S, d+1], every attention
        layer at once."""
        nA, S, Hkv, _, D = self.K.shape
        for C in (self.K, self.V):
            ix = [t[None, :, None, :, None].expand(nA, S, Hkv, t.shape[1], D) for t in (src, dst)]
            C.scatter_(3, ix[1], C.gather(3, ix[0]))

    def _verified(self, Hv, pred, a):
        """The end of a round: Hv [S, d+1, H] and pred [S, d+1], the trunk's rows and tokens
        along the verified block (the kept branch's, for a tree), a [S] the drafts kept."""
        act, pos = self.active, self.pos
        # the draft's rows n..n+d from the trunk's rows and tokens: rows ≤ n+a are the accepted
        # ones, row n+a is the next round's chain step 0 (rows past it are overwritten before use)
        out = self._mtp(Hv, pred, pos)
        row = out[self.slot_ar, a][:, None]
        self._chain(row, pos + a + 1)
        self._by_slot(_round_end, self.pend, pos, self.out_pred, self.out_n, self.mtp_last, act, pred, a, row)

    # ── steps over the first b slots (bucketed batch sizes) ──
    # Buffers whose first (or, for the layer-stacked caches, second) dimension is the slot: a
    # bucket's view slices them, so its step reads and writes the same storage for slots < b.
    _SLOT_DIM0 = ("pend", "pos", "drafts", "active", "temp", "out_tok", "out_pred", "out_n", "MK", "MV",
                  "mtp_last", "serve_rows")
    _SLOT_DIM1 = ("K", "V", "conv", "rec")

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding slots 0..rows-1."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise CortiqError(f"decode engine: {rows} rows, the largest bucket is {self.buckets[-1]}")

    def _view(self, b: int) -> "DecodeEngine":
        """This engine restricted to slots 0..b-1: the same weights and storage, S = b."""
        if b == self.S:
            return self
        v = self._views.get(b)
        if v is None:
            import copy

            v = copy.copy(self)
            v.S, v.slot_ar, v._views = b, self.slot_ar[:b], {}
            for name in self._SLOT_DIM0:
                if hasattr(self, name):
                    setattr(v, name, getattr(self, name)[:b])
            for name in self._SLOT_DIM1:
                if hasattr(self, name):
                    setattr(v, name, getattr(self, name)[:, :b])
            self._views[b] = v
        return v

    def _capture_buckets(self):
        """One graph per bucket and kind of step, sharing one memory pool (they replay one at a
        time and keep nothing between replays but the engine's own buffers)."""
        pool = torch.cuda.graph_pool_handle()
        G = self._bucket_graphs
        for b in reversed(self.buckets):
            v = self._view(b)
            for L in reversed(self.kv_sizes):  # (the key length is fixed in each graph)
                G[("plain", b, True, L)] = self._capture(lambda v=v, L=L: v._at(L, v._plain), pool)
                if self.k:
                    G[("plain", b, False, L)] = self._capture(lambda v=v, L=L: v._at(L, v._plain, False), pool)
                    # the chain a round runs first after plain steps that skipped it (--spec-auto):
                    # while it ran eagerly, its k-1 draft passes were launches on the host, and
                    # auto's rounds measured 10-18 ms at 8 and 32 slots on the H200 (2.3-2.9 at 1, 16)
                    G[("chain", b, L)] = self._capture(lambda v=v, L=L: v._at(L, v._chain, v.mtp_last, v.pos), pool)
                    for d in range(1, self.k + 1):
                        for t in {True, self.nb == 1}:  # a tree engine: its tree's rounds and the chain's
                            G[("spec", b, d, L, t)] = self._capture(lambda v=v, L=L, d=d, t=t: v._at(L, v._spec, d, t),
                                                                    pool)

    def _check_rows(self, b: int) -> None:
        if b not in self.buckets:
            raise CortiqError(f"decode engine: {b} rows is not a bucket ({self.buckets})")
        if any(self._on[b:]):
            raise CortiqError(f"decode engine: slot {self._on.index(True, b)} is active outside the first {b}")

    @torch.no_grad()
    def step_on(self, b: int, chain: bool = True) -> torch.Tensor:
        """`step()` over slots 0..b-1 (b a bucket; no active slot past them); rows past b of
        the output are left as they were. chain=False skips the draft's chain (the
        draft-layer row is still written): a plain step at plain cost, and the next
        `spec_on` chains first."""
        self._check_rows(b)
        self._room(1)
        L = self._kv_for(b, 0)
        g = self._bucket_graphs.get(("plain", b, bool(chain) or not self.k, L))
        if g is not None:
            g.replay()
        else:
            v = self._view(b)
            v._at(L, v._plain, chain)
        if self.k:
            self._stale = not chain
        for s in range(b):
            self._hi[s] += self._on[s]
        return self.out_tok

    def tree_round(self, tree: bool | None) -> bool:
        """Whether a round asked for with `tree` (None: the engine's own kind) verifies the tree."""
        return self.nb > 1 if tree is None else bool(tree) and self.nb > 1

    @torch.no_grad()
    def spec_on(self, b: int, depth: int | None = None, tree: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`spec_step()` over slots 0..b-1, verifying `depth` drafts (1..k, default k), on the
        draft tree (`tree`, default: when the engine has one) or on its greedy chain:
        pred[s, :n[s]] with n ≤ depth+1 (columns past depth+1 are stale)."""
        d = self.k if depth is None else depth
        t = self.tree_round(tree)
        if not 1 <= d <= self.k:
            raise CortiqError(f"decode engine: depth {d} outside 1..{self.k}")
        self._check_rows(b)
        self._room(d + 1)
        v = self._view(b)
        L = self._kv_for(b, d)
        if self._stale:  # the steps since the last chain left the drafts behind: chain from the kept rows
            gc = self._bucket_graphs.get(("chain", b, L))
            if gc is not None:
                gc.replay()
            else:
                v._at(L, v._chain, v.mtp_last, v.pos)
            self._stale = False
        g = self._bucket_graphs.get(("spec", b, d, L, t or self.nb == 1))
        if g is not None:
            g.replay()
        else:
            v._at(L, v._spec, d, t)
        for s in range(b):
            self._hi[s] += (d + 1) * self._on[s]
        return self.out_pred, self.out_n


class _PromptJob:
    """A prompt entering slot `slot` of `eng` a chunk per `run()`: the checks and the count."""

    def __init__(self, eng: DecodeEngine, slot: int, ids):
        ids = [int(t) for t in ids]
        eng._check_prefill(slot, ids, 0.0)  # the one-call prefill's checks (its rows are greedy or sampled later)
        self.slot, self.ids, self.n = slot, ids, len(ids)
        self.at = 0
        self.first = None  # the first token once the last chunk has run (an int, or a tensor [1] on the device)

    @property
    def left(self) -> int:
        """Prompt tokens not yet run."""
        return self.n - self.at


class PrefillJob(_PromptJob):
    """A prompt entering a slot a chunk at a time (`DecodeEngine.prefill_job`). Each `run()`
    runs the next chunk through the reference forward, continuing one cache (and the draft's
    rows over the same positions); the last one copies the caches into the slot, decides the
    first token and the first round's drafts, activates the slot and returns that token
    (None before). The same forward as a whole-prompt prefill, split at chunk boundaries."""

    def __init__(self, eng: DecodeEngine, slot: int, ids, temperature: float, chunk: int):
        super().__init__(eng, slot, ids)
        if temperature > 0 and not eng.sampling:
            raise CortiqError("decode engine: temperature > 0 needs an engine built with sampling=True")
        if temperature < 0:
            raise CortiqError(f"temperature {temperature}: must be ≥ 0")
        self.eng, self.temperature = eng, temperature
        self.chunk = chunk if chunk > 0 else self.n
        self.t = torch.tensor([self.ids], device=eng.dev)
        self.cache = eng.model.new_cache()
        self.ms = KVState() if eng.k else None

    @torch.no_grad()
    def run(self) -> int | None:
        eng, m, n, t = self.eng, self.eng.model, self.n, self.t
        if self.first is not None:
            return self.first
        a, b = self.at, min(self.at + self.chunk, n)
        H, _ = m.forward_hidden(t[:, a:b], cache=self.cache)  # [1, b-a, H]
        if eng.k:  # the draft's rows a..e-1: each reads its trunk row and the prompt token after it
            e = min(b, n - 1)
            if e > a:
                m.mtp_forward(H[:, : e - a], t[:, a + 1 : e + 1], a, self.ms)
        self.at = b
        if b < n:
            return None
        self.first = self._install(H[:, -1:])
        return self.first

    def _install(self, h_last) -> int:
        eng, m, n, slot, cache = self.eng, self.eng.model, self.n, self.slot, self.cache
        for i in eng.attn_idx:
            st, j = cache.states[i], eng.slot_of[i]
            eng.K[j, slot, :, :n] = st.k[0]
            eng.V[j, slot, :, :n] = st.v[0]
        for i in eng.lin_idx:
            st, j = cache.states[i], eng.slot_of[i]
            eng.conv[j, slot] = st.conv[0]
            eng.rec[j, slot] = st.rec[0]
        eng.temp[slot] = self.temperature
        first = eng._pick(h_last, eng.temp[slot: slot + 1])[0, 0]
        if eng.k:  # the first round's chain from row n-1 (each branch's, with a tree)
            ms, nb = self.ms, eng.nb
            base, which = torch.tensor([n], device=eng.dev), torch.tensor([slot], device=eng.dev)
            xh = m.mtp_forward(h_last, first.view(1, 1), n - 1, ms)  # [1, 1, H] chain step 0
            eng.mtp_last[slot] = xh[0]
            d = eng._draft_first(xh, base, which)  # [1, nb]
            drafts = [d]
            # the branches as a batch, each over its own copy of the draft's rows
            bs = KVState()
            bs.k, bs.v = ms.k.expand(nb, -1, -1, -1), ms.v.expand(nb, -1, -1, -1)
            xh = xh.expand(nb, -1, -1)
            for j in range(1, eng.k):
                xh = m.mtp_forward(xh, d.view(nb, 1), n - 1 + j, bs)
                d = eng._draft_pick(xh.reshape(1, nb, -1), j, base, which)  # [1, nb]
                drafts.append(d)
            # the committed rows, then branch 0's chain rows where the engine's own chain leaves them
            # (nothing reads those before a round writes them again; kept so both prefills leave equal caches)
            eng.MK[slot, :, : n - 1 + eng.k] = bs.k[0]
            eng.MV[slot, :, : n - 1 + eng.k] = bs.v[0]
            eng.drafts[slot] = torch.stack(drafts, 2).reshape(-1)
        eng.pend[slot] = first
        eng.pos[slot] = n
        eng.active[slot] = True
        eng._hi[slot], eng._on[slot] = n, True
        return int(first)


class StagedPrefill:
    """Prompts prefilled by captured graphs (attention-only models): a one-slot staging
    engine runs a prompt up to `max(sizes)` tokens at a time through the engine's own trunk
    (the chunk padded to the next of `sizes`; the padded rows lie past the prompt, where
    the next chunk or step overwrites them before anything reads them), the draft's rows
    with it, and on the last chunk the first token and the first round's drafts; `install`
    then copies the staging slot into a slot of `eng`. A prompt costs one replay per chunk
    and a few copies instead of the reference forward's thousands of launches.

    One prompt at a time: a job's chunks must run back to back (`job(...).run()` until it
    returns the first token) before another job starts."""

    def __init__(self, eng: DecodeEngine, sizes=(16, 32, 64, 128, 256)):
        if eng.lin_idx:
            raise CortiqError("decode engine: staged prefill runs attention-only models (a GDN layer's state "
                              "needs the reference forward)")
        self.eng = eng
        # a chunk never spans more positions than a prompt may have (it leaves the draft's k rows free)
        self.sizes = sorted({min(int(c), eng.max_len - eng.k) for c in sizes})
        C = self.sizes[-1]
        st = self.st = DecodeEngine(eng.model, slots=1, max_len=eng.max_len, draft=eng.k, graphs=False,
                                    branches=eng.nb)
        dev = eng.dev
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
        self.tok, self.nxt = z(1, C), z(1, C)  # the chunk's tokens and the token after each
        self.start, self.final = z(1), z(1, dtype=torch.bool)
        # the count of real rows starts at 1, not 0: each graph's capture runs the chunk before
        # any prompt is staged, and that run selects row nreal-1 (row -1 is out of range, on
        # CUDA a device-side assert that poisons every later call in the process)
        self.nreal = torch.ones(1, dtype=torch.long, device=dev)
        self.first = z(1)
        self.row = torch.zeros(1, eng.arch.hidden_size, dtype=eng.dt, device=dev)  # the prompt's last final row
        st.active.fill_(True)
        self.graphs = {}
        if eng.graphs:
            pool = torch.cuda.graph_pool_handle()
            for c in reversed(self.sizes):
                self.graphs[c] = st._capture(lambda c=c: self._chunk(c), pool)

    def _chunk(self, c: int):
        st = self.st
        tok, nxt = self.tok[:, :c], self.nxt[:, :c]
        H, _ = st._trunk(tok, self.start)  # [1, c, H]: K, V rows start..start+c-1
        last = H[0].index_select(0, self.nreal - 1)[None]  # [1, 1, H]
        first = st._pick(last)[:, 0]  # [1]
        if st.k:
            st._mtp(H, nxt, self.start)  # the draft's rows of the chunk (its last real one is redone below)
            # the last real row reads the token after it: the next chunk's first, or on the last
            # chunk the first decided token; that row is chain step 0 of the first round
            after = torch.where(self.final, first, nxt[0].index_select(0, self.nreal - 1))
            out0 = st._mtp(last, after[:, None], self.start + self.nreal - 1)
            st.mtp_last.copy_(out0)
            st._chain(out0, self.start + self.nreal)
        self.first.copy_(first)
        self.row.copy_(last[0])

    def job(self, slot: int, ids, chunk: int = 0) -> "StagedJob":
        return StagedJob(self, slot, ids, chunk)

    def install(self, slot: int, n: int) -> torch.Tensor:
        """The staged prompt of n tokens into `slot` of the engine, active -> its first token, a
        LongTensor [1] on the device (read it with int(): the host then waits for the device)."""
        e, st = self.eng, self.st
        e.K[:, slot, :, :n].copy_(st.K[:, 0, :, :n])
        e.V[:, slot, :, :n].copy_(st.V[:, 0, :, :n])
        if e.k:
            e.MK[slot, :, : n + e.k].copy_(st.MK[0, :, : n + e.k])
            e.MV[slot, :, : n + e.k].copy_(st.MV[0, :, : n + e.k])
            e.drafts[slot].copy_(st.drafts[0])
            e.mtp_last[slot].copy_(st.mtp_last[0])
        if hasattr(e, "serve_rows"):
            e.serve_rows[slot].copy_(self.row[0])
        e.temp[slot] = 0.0
        e.pend[slot: slot + 1].copy_(self.first)
        e.pos[slot] = n
        e.active[slot] = True
        e._hi[slot], e._on[slot] = n, True
        return self.first.clone()  # (the staging buffer is the next prompt's)


class StagedJob(_PromptJob):
    """One prompt through `StagedPrefill`: `run()` -> None per chunk, then the first token (a
    LongTensor [1] on the device: a server need not wait for it)."""

    def __init__(self, sp: StagedPrefill, slot: int, ids, chunk: int):
        super().__init__(sp.eng, slot, ids)
        self.sp = sp
        self.chunk = min(chunk, sp.sizes[-1]) if chunk > 0 else sp.sizes[-1]

    @torch.no_grad()
    def run(self) -> int | None:
        if self.first is not None:
            return self.first
        sp, ids, n = self.sp, self.ids, self.n
        a, b = self.at, min(self.at + self.chunk, n)
        L = b - a
        c = next(s for s in sp.sizes if s >= L)
        after = ids[a + 1: b + 1]
        host = torch.tensor([ids[a:b], after + [0] * (L - len(after))])  # [2, L]
        if sp.eng.dev.type == "cuda":
            # from pinned memory, queued behind the step in flight: a copy from pageable memory
            # would wait for that step (the caching host allocator keeps the buffer until the copy ran)
            host = host.pin_memory()
        sp.tok[0, :L].copy_(host[0], non_blocking=True)
        sp.nxt[0, :L].copy_(host[1], non_blocking=True)
        sp.start.fill_(a)
        sp.nreal.fill_(L)
        sp.final.fill_(b == n)
        g = sp.graphs.get(c)
        if g is not None:
            g.replay()
        else:
            sp._chunk(c)
        self.at = b
        if b < n:
            return None
        self.first = sp.install(self.slot, n)
        return self.first
