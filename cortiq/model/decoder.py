"""The decoder family cortiq runs: Llama, Qwen2, Qwen3 and the Qwen3-Next /
Qwen3.5 hybrid, as one readable torch module.

Parameter names are the canonical CMF names (docs/internals.md), so
`model.state_dict()` keys are the tensor names of the file. Differences from
the Hugging Face reference models are named where they occur.

Shapes: B batch, T tokens, H hidden, Hq/Hkv attention heads, D head_dim,
V vocabulary, I MLP width (per layer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..arch import FULL, LINEAR, Arch
from ..errors import CortiqError
from .gdn import GatedDeltaNet, GDNState


class RMSNorm(nn.Module):
    """RMSNorm in both styles: "weight" w·x̂ (Llama, Qwen3), "offset" (1+w)·x̂
    (Qwen3-Next, Qwen3.5; weights stored as HF stores them, zeros = identity).
    Normalises in f32 whatever the compute dtype."""

    def __init__(self, dim: int, eps: float, offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (xf * (1.0 + w) if self.offset else xf * w).to(x.dtype)


def rope_inv_freq(arch: Arch, device=None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2], with Llama-3 / linear rope scaling."""
    dim = arch.rotary_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
    sc = arch.rope_scaling
    if sc:
        kind = sc.get("rope_type", sc.get("type"))
        if kind == "linear":
            inv = inv / float(sc["factor"])
        elif kind == "llama3":
            factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
            old = float(sc["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - lo) / (hi - lo)
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            mid = (wavelen <= old / lo) & (wavelen >= old / hi)
            inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        else:
            raise CortiqError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")
    return inv.float()


def rotate(x, cos, sin, rdim: int):
    """Rotary embedding on the first `rdim` dims of each head (partial rotary),
    half-split pairing (HF rotate_half). x [B, h, T, D]; cos/sin [T, rdim] or [B, 1, T, rdim]."""
    xr, xp = x[..., :rdim], x[..., rdim:]
    x1, x2 = xr[..., : rdim // 2], xr[..., rdim // 2 :]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


class KVState:
    """Decoding state of one attention layer: keys and values [B, Hkv, S, D]."""

    __slots__ = ("k", "v")

    def __init__(self):
        self.k = self.v = None

    def snapshot(self):
        return None if self.k is None else self.k.shape[2]

    def restore(self, n):
        if n is None:
            self.k = self.v = None
        else:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class Attention(nn.Module):
    """Full causal attention: GQA, RoPE (partial), optional q/k RMSNorm over
    head_dim, optional sigmoid output gate (Qwen3-Next: q_proj emits per head
    [query(D); gate(D)], kept in that interleaved layout as HF stores it)."""

    def __init__(self, arch: Arch):
        super().__init__()
        H, D = arch.hidden_size, arch.head_dim
        self.hq, self.hkv, self.d = arch.num_heads, arch.num_kv_heads, D
        self.gated = arch.attn_output_gate
        bias = arch.attention_bias
        self.q_proj = nn.Linear(H, self.hq * D * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(H, self.hkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.hkv * D, bias=bias)
        self.o_proj = nn.Linear(self.hq * D, H, bias=False)
        if arch.qk_norm:
            off = arch.norm_style == "offset"
            self.q_norm = RMSNorm(D, arch.rms_norm_eps, off)
            self.k_norm = RMSNorm(D, arch.rms_norm_eps, off)
        else:
            self.q_norm = self.k_norm = None
        self.rdim = arch.rotary_dim

    def qkv(self, x, cos, sin):
        """q [B, hq, T, D], k, v [B, hkv, T, D] (normed, roped) and the output gate ([B, T, hq·D] or
        None) of x [B, T, H]; the MTP measure's own attention walk takes them from here too."""
        B, T, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.hq, 2 * self.d).chunk(2, -1)  # each [B, T, Hq, D]
            gate = gate.reshape(B, T, self.hq * self.d)
        q = q.reshape(B, T, self.hq, self.d)
        k = self.k_proj(x).view(B, T, self.hkv, self.d)
        v = self.v_proj(x).view(B, T, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, T, D]
        q = rotate(q, cos.to(q.dtype), sin.to(q.dtype), self.rdim)
        k = rotate(k, cos.to(k.dtype), sin.to(k.dtype), self.rdim)
        return q, k, v, gate

    def forward(self, x, cos, sin, state: KVState | None = None):
        B, T, _ = x.shape  # x [B, T, H]
        q, k, v, gate = self.qkv(x, cos, sin)
        past = 0
        if state is not None:
            if state.k is not None:
                past = state.k.shape[2]
                k, v = torch.cat([state.k, k], 2), torch.cat([state.v, v], 2)
            state.k, state.v = k.detach(), v.detach()
        if past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.hq != self.hkv)
        else:
            # new query i sits at position past+i: it sees keys 0..past+i (SDPA's is_causal aligns top-left)
            S = k.shape[2]
            mask = torch.arange(S, device=x.device)[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.hq != self.hkv)
        o = o.transpose(1, 2).reshape(B, T, self.hq * self.d)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), width I per layer; with neuron gates
    (DTG-MA) down(σ(m) · silu(gate(x)) · up(x))."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.neuron_logits: nn.Parameter | None = None

    def forward(self, x, weights=None):
        """weights: (gate, up, down) to use in place of the modules' own (the same tensors,
        passed in by `CausalLM.compile_layers` so that a compiled body sees them as inputs)."""
        if weights is None:
            a = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [B, T, I]
        else:
            a = F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1])
        if self.neuron_logits is not None:
            a = a * torch.sigmoid(self.neuron_logits).to(a.dtype)
        return self.down_proj(a) if weights is None else F.linear(a, weights[2])

    def bare_linears(self) -> bool:
        """Whether its three projections are plain linears (no forward of their own, as QAT
        attaches), so that passing their weights computes what calling them does."""
        return all(type(m) is nn.Linear and "forward" not in m.__dict__ and not m._forward_hooks
                   and not m._forward_pre_hooks for m in (self.gate_proj, self.up_proj, self.down_proj))


class _WeightsIn:
    """A compiled layer body called with its MLP's weights as arguments (read at each
    call, so FSDP2's unsharded tensors are the ones passed): see CausalLM.compile_layers."""

    def __init__(self, body, mlp: MLP):
        self.body, self.mlp = body, mlp

    def __call__(self, h, cos, sin, state=None):
        m = self.mlp
        return self.body(h, cos, sin, state, (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight))


def run_body(layer: nn.Module, *args):
    """`layer`'s body on `args`: the compiled one when `layer.compiled` is set, else
    `layer._forward`; wrapped in a checkpoint when `layer.recompute` is set and a
    gradient is being recorded (non-reentrant: works under autocast, with compiled
    bodies and with inputs that need no gradient). See DecoderLayer.recompute for
    why the checkpoint sits here."""
    body = layer.compiled or layer._forward
    if layer.recompute and torch.is_grad_enabled():
        return checkpoint(body, *args, use_reentrant=False)
    return body(*args)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)), then + mlp(norm(h))."""

    def __init__(self, arch: Arch, kind: str, width: int):
        super().__init__()
        off = arch.norm_style == "offset"
        self.kind = kind
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, off)
        if kind == FULL:
            self.self_attn = Attention(arch)
        else:
            self.linear_attn = GatedDeltaNet(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, off)
        self.mlp = MLP(arch.hidden_size, width)

    def new_state(self):
        return KVState() if self.kind == FULL else GDNState()

    #: recompute this layer's activations in the backward instead of keeping them
    #: (heal's memory "checkpoint": only the input [B, T, H] is saved). The
    #: checkpoint is taken here, inside the module's call, so FSDP2's hooks on the
    #: call stay outside it, and around the compiled body, not inside it:
    #: - FSDP2's hooks inside a checkpoint made its recompute save other tensors
    #:   than the forward did (CheckpointError, "different metadata") at the 1.7B
    #:   and 8B geometries on the GPU (torch 2.11);
    #: - a checkpoint inside the compiled region (the module's call compiled)
    #:   gave gradients off the plain step's, on the GPU under bf16 autocast
    #:   (inductor) and on a CPU; around the compiled body the recompute
    #:   runs the same compiled graph, and the CPU gives the plain gradients
    #:   exactly (tests/heal/test_memory.py; the three placements measured:
    #:   bench/RESULTS.md, "The sharded step's CPU cost").
    recompute = False
    #: `_forward` compiled by `CausalLM.compile_layers`, else None (eager)
    compiled = None

    def forward(self, h, cos, sin, state=None):
        if state is None:
            return run_body(self, h, cos, sin)  # [B, T, H]
        return (self.compiled or self._forward)(h, cos, sin, state)  # decoding: never recomputed

    def _forward(self, h, cos, sin, state=None, mlp_weights=None):
        x = self.input_layernorm(h)
        if self.kind == FULL:
            h = h + self.self_attn(x, cos, sin, state)
        else:
            h = h + self.linear_attn(x, state)
        return h + self.mlp(self.post_attention_layernorm(h), mlp_weights)


class Cache:
    """Per-layer decoding state (KV for attention, conv + recurrent for GDN) and
    the number of positions already seen. `snapshot`/`restore` roll it back
    (speculative decoding rejects drafts)."""

    def __init__(self, layers, extra=()):
        self.states = [l.new_state() for l in layers]
        self.extra = [l.new_state() for l in extra]  # the MTP block's own layer
        self.seen = 0

    def snapshot(self):
        return (self.seen, [s.snapshot() for s in self.states])

    def restore(self, snap):
        self.seen, ss = snap
        for s, x in zip(self.states, ss):
            s.restore(x)


class MTPBlock(nn.Module):
    """The multi-token-prediction (MTP) draft block, `model.mtp.*`.

    Row p of the block reads the trunk's final hidden row h_p (after model.norm)
    and the embedding of token p+1, and predicts token p+2:

        x   = eh_proj · [enorm(embed(tok_{p+1})); hnorm(h_p)]     # [B, T, 2H] -> [B, T, H]
        x   = layers.0(x)                                         # one full-attention decoder layer
        out = norm(x)                                             # logits = the shared head on out

    `out` has the same role as a trunk final hidden row, so drafts chain: step
    j+1 reads step j's `out` in place of h. Positions are the row indices p, as
    the trunk's (the block runs over the same rows).
    """

    def __init__(self, arch: Arch):
        super().__init__()
        H, off = arch.hidden_size, arch.norm_style == "offset"
        width = arch.mtp_intermediate_size or arch.intermediate_sizes[-1]
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.enorm = RMSNorm(H, arch.rms_norm_eps, off)
        self.hnorm = RMSNorm(H, arch.rms_norm_eps, off)
        self.layers = nn.ModuleList([DecoderLayer(arch, FULL, width)])
        self.norm = RMSNorm(H, arch.rms_norm_eps, off)

    def forward(self, h_prev, next_emb, cos, sin, state=None):
        """h_prev [B, T, H] trunk final hidden rows, next_emb [B, T, H] embeddings
        of the tokens after them; cos/sin [T, rotary_dim] for the rows' positions.
        -> normed draft hidden [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h_prev)], -1))
        x = self.layers[0](x, cos, sin, state)
        return self.norm(x)


class Backbone(nn.Module):
    """HF `model.*`: embed_tokens, layers, norm (and, ours, the MTP block)."""

    def __init__(self, arch: Arch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, kind, w) for kind, w in zip(arch.layer_types, arch.intermediate_sizes)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_style == "offset")
        self.mtp = None
        if arch.mtp_layers:
            self.mtp = MTPBlock(arch)


class CausalLM(nn.Module):
    """The model: `model(ids [B, T]) -> logits [B, T, V]`, plus the entry points
    the stages need (docs/internals.md, "The model API")."""

    def __init__(self, arch: Arch):
        super().__init__()
        if LINEAR in arch.layer_types and arch.linear_num_value_heads % max(arch.linear_num_key_heads, 1):
            raise CortiqError(f"{arch.linear_num_value_heads} GDN value heads do not group over {arch.linear_num_key_heads} key heads")
        self.arch = arch
        self.model = Backbone(arch)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # not a buffer: a model.to(bfloat16) must not round the frequencies
        self._inv_freq = rope_inv_freq(arch)

    # ── structure ──
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def mtp(self):
        return self.model.mtp

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_neuron_gates(self, on: bool, init: float = 2.0):
        """Add (σ(init) everywhere) or remove the DTG-MA gate logits m [I_i] on every trunk MLP."""
        for layer in self.layers:
            mlp = layer.mlp
            if on:
                w = mlp.down_proj.weight
                mlp.neuron_logits = nn.Parameter(torch.full((w.shape[1],), float(init), device=w.device, dtype=torch.float32))
            else:
                mlp.neuron_logits = None

    # ── entry points ──
    def rope(self, positions: torch.Tensor):
        """cos, sin [T, rotary_dim] (f32) for integer positions [T]."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        f = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)  # [B, T, H]

    def run_layers(self, h, start: int, end: int, cache: Cache | None = None):
        """Layers start..end-1 on hidden input h [B, T, H] -> [B, T, H]."""
        return self._run(h, start, end, cache, ())[0]

    def _run(self, h, start, end, cache, capture):
        T = h.shape[1]
        p0 = cache.seen if cache is not None else 0
        cos, sin = self.rope(torch.arange(p0, p0 + T, device=h.device))
        caught = {}
        for i in range(start, end):
            h = self.layers[i](h, cos, sin, None if cache is None else cache.states[i])
            if i in capture:
                caught[i] = h
        return h, caught

    def forward_hidden(self, ids, capture=(), cache: Cache | None = None):
        """(final hidden after model.norm [B, T, H], {i: layer i output [B, T, H]})."""
        h, caught = self._run(self.embed(ids), 0, len(self.layers), cache, set(capture))
        if cache is not None:
            cache.seen += ids.shape[1]
        return self.model.norm(h), caught

    def mtp_forward(self, h_prev, next_ids, p0: int = 0, state=None):
        """The MTP block on trunk final hidden rows h_prev [B, T, H] (positions
        p0..p0+T-1) and the tokens after them next_ids [B, T] -> draft hidden [B, T, H]
        (normed; `logits` of it predicts the token after next_ids)."""
        cos, sin = self.rope(torch.arange(p0, p0 + h_prev.shape[1], device=h_prev.device))
        return self.mtp(h_prev, self.embed(next_ids), cos, sin, state)

    def logits(self, h_final):
        return F.linear(h_final, self.head_weight.to(h_final.dtype))  # [B, T, V]

    def forward(self, ids, cache: Cache | None = None):
        return self.logits(self.forward_hidden(ids, cache=cache)[0])

    @torch.no_grad()
    def topk_next(self, h_final, k: int, chunk: int = 1024, vocab: torch.Tensor | None = None):
        """Top-k of the next-token distribution per row: (ids int64 [B, T, k],
        probs f32 [B, T, k] renormalised over the k). Rows go `chunk` at a time,
        so [B·T, V] logits never exist at once. `vocab` (token ids [N]): the top-k
        among those tokens alone (a draft's narrowed head, cortiq.mtp.vocab)."""
        B, T, H = h_final.shape
        rows = h_final.reshape(B * T, H)
        head = self.head_weight if vocab is None else self.head_weight[vocab.to(self.head_weight.device)]
        head = head.to(rows.dtype)
        ids = torch.empty(B * T, k, dtype=torch.long, device=rows.device)
        probs = torch.empty(B * T, k, dtype=torch.float32, device=rows.device)
        for s in range(0, B * T, chunk):
            # top-k in the logits' own dtype: a bf16 head's logits are bf16
            # already, and a float copy of [chunk, V] costs more than the head
            top, idx = F.linear(rows[s : s + chunk], head).topk(k, -1)  # [chunk, k]
            probs[s : s + chunk] = torch.softmax(top.float(), -1)  # renormalised over the k kept
            ids[s : s + chunk] = idx
        if vocab is not None:
            ids = vocab.to(ids.device)[ids]
        return ids.view(B, T, k), probs.view(B, T, k)

    def compile_layers(self, layers=None, **kw) -> "CausalLM":
        """torch.compile each decoder layer on its own (regional compilation:
        one graph per layer kind, reused by every layer of that kind). On a
        GPU this fuses the norms, RoPE, SwiGLU and residual adds, which nearly
        halves the trunk forward of a Qwen3-1.7B geometry (bench/RESULTS.md,
        "What bounds the misses"). CUDA runs use it; the CPU path stays eager.

        `layers`: the indices of the trunk layers that will run (default all).
        A heal whose frozen prefix is cached holds placeholders where the
        prefix layers were; they never run, so they are not compiled."""
        import torch._dynamo

        # one graph per (layer kind, grad mode, autocast, shape): a teacher and a
        # student in one process pass dynamo's default limit of 8 and fall back
        # to eager without it
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        trunk = list(self.layers) if layers is None else [self.layers[i] for i in layers]
        every = trunk + ([] if self.mtp is None else list(self.mtp.layers))
        # Layers of several MLP widths (a fold of global scope keeps a width of its own in
        # every layer): with static shapes each width is a graph of its own per grad mode,
        # and a heal of SmolLM2 with 30 widths took several times as long as with one
        # (bench/QUALITY.md, "Activation score and global scope"). Dynamo keeps a module's
        # parameters static whatever `dynamic` says, so the MLP weights go in as arguments
        # (`_WeightsIn`), parameters may be dynamic, and the width that changes at the second
        # compile turns symbolic: two graphs per grad mode for any number of widths.
        ragged = len({int(layer.mlp.gate_proj.weight.shape[0]) for layer in every}) > 1
        if ragged:
            cfg.force_parameter_static_shapes = False
            kw.setdefault("dynamic", None)
        kw.setdefault("dynamic", False)
        for layer in every:
            # the body, not the module's call: hooks on the call (FSDP2's) and the
            # layer's checkpoint stay outside the compiled region (DecoderLayer.recompute)
            body = torch.compile(layer._forward, **kw)
            layer.compiled = _WeightsIn(body, layer.mlp) if ragged and layer.mlp.bare_linears() else body
        return self

    def new_cache(self) -> Cache:
        return Cache(self.layers, [] if self.mtp is None else self.mtp.layers)
