"""The model's forward over the engine's static buffers: the trunk, the draft layer, and each
layer kind, eager or through the compiled layer halves (`layers._fused_fns`). The eager path is
the reference the tests compare the compiled one with (caches, hidden rows and logits, every
step and round kind)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import (_Attn, _Norm, _add_linear, _ctx_rows, _ctx_tree_rows, _dyn, _fused_fns, _heads, _merge_heads,
                     _mtp_input)


class StaticForward:
    """The forward half of `DecodeEngine` (its base class): what a step or round runs, over the
    buffers and weights the engine's constructor sets up."""

    def _compiled(self):
        """The fused path's compiled functions and whether the MLP widths differ between layers
        (a fold of global scope: their width dims are then marked dynamic too, one graph for
        all widths), or (None, False) where the attention layers differ in geometry or norm
        style (never within one arch: the eager path then runs)."""
        layers = list(self.attn_weights.values()) + ([self.mtp_attn] if self.draft else [])
        keys = {(layer.geo, layer.styles()) for layer in layers}
        geo, styles = next(iter(keys), (None, None))
        if len(keys) != 1 or styles is None:
            return None, False
        # one graph per (shape class, geometry) and compiled function: raise dynamo's limit of
        # 8 per function, as `CausalLM.compile_layers` does, for several engines in a process
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        return _fused_fns(geo, *styles), len({layer.mlp.width for layer in layers}) > 1

    def _ctx(self, pos, T, off: int = 0):
        """Positions [S, T] from first positions pos [S] + off (clamped: inactive
        slots may point anywhere), with RoPE [S, T, 1, rdim], the KV write
        index [S, Hkv, T, D] and the additive mask [S, 1, G·T, L] (query row
        g·T + t of a KV head sees keys ≤ its position; L the key length of this step).
        (off shifts the arange, not pos: no kernel of its own for a chain step's position.)"""
        ar_t, ar_l = self.arange[off: off + T], self.arange[: self.key_len]
        if self._fns is None:
            return _ctx_rows(pos, ar_t, ar_l, self.cos, self.sin, self.kv_heads, self.group, self.head_dim)
        cos, sin, idx, mask = self._fns.ctx(_dyn(pos, 0), _dyn(ar_t, 0), _dyn(ar_l, 0), _dyn(self.cos, 0),
                                           _dyn(self.sin, 0))
        return _dyn(cos, 0, 1), _dyn(sin, 0, 1), idx, mask

    def _ctx_tree(self, pos, rows, dep, anc):
        """`_ctx` for rows of a tree block whose rows lie at cache positions pos.. (pos [S]):
        query rows `rows` [R] of the block, row r written at pos + rows[r] and roped at
        pos + dep[r]; every key before pos is seen, a key of the block where anc [R, Tb] says
        (its ancestors and itself). -> (cos, sin [S, R, 1, rdim], write index [S, Hkv, R, D],
        mask [S, 1, G·R, L]) as `_ctx`."""
        ar_l = self.arange[: self.key_len]
        if self._fns is None:
            return _ctx_tree_rows(pos, rows, dep, anc, ar_l, self.cos, self.sin, self.kv_heads, self.group,
                                  self.head_dim)
        cos, sin, idx, mask = self._fns.tree_ctx(_dyn(pos, 0), rows, dep, anc, _dyn(ar_l, 0), _dyn(self.cos, 0),
                                                _dyn(self.sin, 0))
        return _dyn(cos, 0, 1), _dyn(sin, 0, 1), idx, mask

    def _attn(self, layer: _Attn, h, ctx, k_cache, v_cache, norm: _Norm | None = None):
        """A full-attention decoder layer on h [S, T, H] (updated in place: the residual adds ride
        on the o and down products), writing its keys and values to k_cache, v_cache
        [S, Hkv, cache_len, D]; its output normed by `norm` where given."""
        if self._fns is not None:
            return self._attn_fused(layer, h, ctx, k_cache, v_cache, norm)
        cos, sin, idx, mask = ctx
        # the live part of the caches (views: writes land in them)
        K, V = k_cache[:, :, : self.key_len], v_cache[:, :, : self.key_len]
        qkv = F.linear(layer.ln1(h), layer.w_qkv, layer.b_qkv)  # [S, T, (Hq(·2) + 2·Hkv)·D]
        qg, k, v, gate = _heads(qkv, cos, sin, layer.qn, layer.kn, layer.geo)  # [S, Hkv, G·T, D], [S, Hkv, T, D] ×2
        K.scatter_(2, idx, k)
        V.scatter_(2, idx, v)
        o = F.scaled_dot_product_attention(qg, K, V, attn_mask=mask)  # [S, Hkv, G·T, D]
        h = _add_linear(h, _merge_heads(o, gate, layer.geo), layer.a.o_proj.weight)
        h = layer.mlp.add_to(h, layer.ln2(h))
        return h if norm is None else norm(h)

    def _attn_fused(self, layer: _Attn, h, ctx, k_cache, v_cache, norm: _Norm | None = None):
        """`_attn` through the compiled halves (`_fused_fns`): pre (which writes the caches) and
        post around the eager attention. -> a new h [S, T, H] (h itself is left as it was)."""
        cos, sin, idx, mask = ctx
        pre, post = self._fns.pre, self._fns.post
        # every weight detached: dynamo guards on requires_grad (a fused view of parameters may
        # carry it) and holds a parameter's shape static (a fold's MLP widths differ between
        # layers); the modules' own weights as they are now, as the eager path reads them
        qn, kn = (None, None) if layer.qn is None else (layer.qn.w, layer.kn.w)
        b_qkv = None if layer.b_qkv is None else layer.b_qkv.detach()
        q, gate = pre(_dyn(h, 0, 1), layer.ln1.w, layer.w_qkv.detach(), b_qkv, qn, kn, cos, sin, idx, _dyn(k_cache, 0),
                      _dyn(v_cache, 0))
        K, V = k_cache[:, :, : self.key_len], v_cache[:, :, : self.key_len]
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)  # [S, Hkv, G·T, D]
        m = layer.mlp.mlp
        w_gu, w_down = layer.mlp.w_gu.detach(), m.down_proj.weight.detach()
        nl = None if m.neuron_logits is None else m.neuron_logits.detach()
        if self._ragged:
            _dyn(w_gu, 0)
            _dyn(w_down, 1)
            if nl is not None:
                _dyn(nl, 0)
        wn, n_style = (None, None) if norm is None else (norm.w, (norm.eps, norm.f32))
        return post(h, _dyn(o, 0, 2), None if gate is None else _dyn(gate, 0, 1), layer.a.o_proj.weight.detach(),
                    layer.ln2.w, w_gu, w_down, nl, wn, n_style)

    def _gdn(self, i, h):
        """A GDN decoder layer on h [S, T, H] from the slot states; -> (h, conv
        window [S, C, K-1+T], state after each token [S, T, Hv, Dk, Dv]). The
        state is not written: the caller commits the accepted prefix's."""
        ln1, ln2, mlp, w_in, split = self.lin_weights[i]
        j = self.kind_index[i]
        g = self.model.layers[i].linear_attn
        S, T, _ = h.shape
        x = ln1(h)
        qkv, z, b, a = F.linear(x, w_in).split(split, -1)
        qkv = qkv.transpose(1, 2)  # [S, C, T]
        full = torch.cat([self.conv[j].to(qkv.dtype), qkv], -1)  # [S, C, K-1+T]
        # the causal depthwise conv as windows × taps (a CPU conv1d call on a few columns is slow:
        # bench/DECODE.md, "The engine's design notes")
        y = F.silu((full.unfold(2, g.K, 1) * g.conv1d.weight[:, 0, None, :]).sum(-1)).transpose(1, 2)  # [S, T, C]
        q, k, v = y.split([g.key_dim, g.key_dim, g.value_dim], -1)
        from ..gdn import l2norm

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
        hidden [S, T, H], the GDN layers' states not yet committed: `_commit`)."""
        T = tok.shape[1]
        ctx = self._ctx(pos, T) if ctx is None else ctx
        h = self.model.embed(tok)
        gdn = []
        last = len(self.kinds) - 1
        for i in range(len(self.kinds)):
            if i in self.attn_weights:
                j = self.kind_index[i]
                h = self._attn(self.attn_weights[i], h, ctx, self.k_cache[j], self.v_cache[j],
                               self.final if i == last else None)
            else:
                h, full, states = self._gdn(i, h)
                gdn.append((self.kind_index[i], full, states))
        return (h if last in self.attn_weights else self.final(h)), gdn

    def _commit(self, gdn, a):
        """GDN states after the first a[s]+1 tokens of the block (a [S]), from `_trunk`'s."""
        for j, full, states in gdn:
            K1 = self.conv.shape[-1]
            idx = (a + 1)[:, None, None] + torch.arange(K1, device=self.device)  # [S, 1, K-1]
            self.conv[j].copy_(full.gather(2, idx.expand(-1, full.shape[1], -1)))
            self.rec[j].copy_(states[self.slot_arange, a])

    def _mtp(self, hrows, toks, pos0, ctx=None, off: int = 0):
        """The MTP block on trunk rows hrows [S, T, H] and the tokens after them [S, T] at positions
        pos0 + off.. (or as `ctx` places them)."""
        ctx = self._ctx(pos0, toks.shape[1], off) if ctx is None else ctx
        ne, nh = self.mtp_enorm, self.mtp_hnorm
        x = self._twin(_mtp_input, _dyn(toks, 0, 1), self.model.model.embed_tokens.weight.detach(), _dyn(hrows, 0, 1),
                       ne.w, (ne.eps, ne.f32), nh.w, (nh.eps, nh.f32), self.model.mtp.eh_proj.weight.detach())
        return self._attn(self.mtp_attn, x, ctx, self.mtp_k_cache, self.mtp_v_cache, self.mtp_norm)

    def _twin(self, fn, *args):
        """fn(*args), or on the fused path its compiled twin in `_Fns` (the same name without the
        underscore), where its small operators become a kernel or two. The caller marks the
        args' dynamic dims (`_dyn`: slots, block rows; an eager call ignores the marks)."""
        return (fn if self._fns is None else getattr(self._fns, fn.__name__[1:]))(*args)

    def _by_slot(self, fn, *args):
        """`_twin` of a small function fn of tensors (or lists of them) whose first dim is the
        slot (`_kept`; `_plain_end`, `_round_end`, `_put_drafts`, which update buffers in place),
        that dim marked dynamic in each: one graph for all buckets ≥ 2."""
        return self._twin(fn, *[[_dyn(x, 0) for x in a] if isinstance(a, list) else _dyn(a, 0) for a in args])
