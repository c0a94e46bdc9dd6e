"""Decoding engines for the server: independent slots decoded together.

A slot holds one sequence. The server's scheduler only uses this interface:

    prefill(slot, ids, draft)   the prompt into a free slot -> next-token logits [V] (f32)
    step(slots, tokens)         feed one token per slot, one forward for all -> logits [B, V] (f32)
    speculate(slots, tokens)    greedy round with the MTP draft: feed each slot's decided token,
                                draft `draft` tokens, verify them in one trunk forward
                                -> per slot the newly decided tokens (accepted drafts, then the
                                trunk's own next token, which is decided but not yet fed)
    release(slot)               the slot is free again
    length(slot)                positions the slot holds

Two implementations:
- `StaticEngine`: attention-only models. Keys and values live in one
  preallocated buffer per layer [slots, Hkv, max_len, D]; a step gathers the
  stepping slots, writes each row's new keys at its own position and masks
  every key past that position, so slots of different lengths share one
  forward, and a rejected draft is dropped by moving the slot's length back.
- `LoopEngine`: any model (Gated DeltaNet layers included) over the model's
  own per-sequence cache, one forward per slot. The plain reference the
  static engine is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..arch import LINEAR
from ..errors import CortiqError
from ..model.decoder import rotate


class Engine(ABC):
    """Slots 0..max_batch-1, each up to max_len positions."""

    def __init__(self, model, max_batch: int, max_len: int, draft: int = 0):
        if max_batch < 1 or max_len < 2:
            raise CortiqError(f"engine: max_batch {max_batch} and max_len {max_len} must be >= 1 and >= 2")
        if draft and model.mtp is None:
            raise CortiqError("speculative decoding needs an MTP draft block (model.mtp.*); this model has none")
        self.model = model
        self.max_batch, self.max_len, self.draft = max_batch, max_len, draft
        self.device = model.model.embed_tokens.weight.device
        self.vocab_size = model.arch.vocab_size

    @abstractmethod
    def prefill(self, slot: int, ids: Sequence[int], draft: bool = False) -> torch.Tensor: ...

    @abstractmethod
    def step(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor: ...

    @abstractmethod
    def speculate(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]: ...

    @abstractmethod
    def release(self, slot: int) -> None: ...

    @abstractmethod
    def length(self, slot: int) -> int: ...

    def _check_prompt(self, slot: int, ids: Sequence[int]):
        if not 0 <= slot < self.max_batch:
            raise CortiqError(f"engine: slot {slot} outside 0..{self.max_batch - 1}")
        if not ids or len(ids) >= self.max_len:
            raise CortiqError(f"engine: a prompt of {len(ids)} tokens (1..{self.max_len - 1} fit)")


def make_engine(model, max_batch: int, max_len: int, draft: int = 0, kind: str = "auto") -> Engine:
    """The static engine for attention-only models, the loop engine otherwise (or as asked)."""
    if kind == "auto":
        kind = "loop" if LINEAR in model.arch.layer_types else "static"
    if kind == "static":
        return StaticEngine(model, max_batch, max_len, draft)
    if kind == "loop":
        return LoopEngine(model, max_batch, max_len, draft)
    raise CortiqError(f"engine kind {kind!r} (choose auto, static or loop)")


class StaticEngine(Engine):
    def __init__(self, model, max_batch: int, max_len: int, draft: int = 0):
        super().__init__(model, max_batch, max_len, draft)
        if LINEAR in model.arch.layer_types:
            raise CortiqError("the static engine serves attention-only models; Gated DeltaNet layers need the loop engine")
        a, dev = model.arch, self.device
        dt = model.model.embed_tokens.weight.dtype
        shape = (max_batch, a.num_kv_heads, max_len, a.head_dim)
        # [slots, Hkv, max_len, D] keys and values per trunk layer (and for the MTP block's layer)
        self.kv = [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                   for _ in model.layers]
        self.mtp_kv = [] if model.mtp is None else [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in model.mtp.layers]
        self.h_last = torch.zeros(max_batch, a.hidden_size, dtype=dt, device=dev)  # [slots, H] last trunk row
        self.lens = [0] * max_batch  # trunk positions held per slot
        self.mtp_lens = [0] * max_batch  # MTP rows held (one fewer than the trunk's once prefilled)

    # ── the batched forward over slots ──
    def _layers(self, layers, store, h, slots_t, pos, contiguous):
        """Decoder layers over hidden input h [B, T, H] whose row b sits at
        positions pos[b] (int64 [B, T]) of slot slots_t[b]; keys and values go
        into `store` at those positions. -> [B, T, H]."""
        B, T, _ = h.shape
        S = int(pos.max()) + 1  # keys any query can see
        cos, sin = self.model.rope(pos.reshape(-1))
        rd = cos.shape[-1]
        cos, sin = cos.view(B, 1, T, rd).to(h.dtype), sin.view(B, 1, T, rd).to(h.dtype)
        key_pos = torch.arange(S, device=h.device)
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
        for layer, (K, V) in zip(layers, store):
            at = layer.self_attn
            x = layer.input_layernorm(h)
            q = at.q_proj(x)
            gate = None
            if at.gated:
                q, gate = q.view(B, T, at.hq, 2 * at.d).chunk(2, -1)
                gate = gate.reshape(B, T, at.hq * at.d)
            q = q.reshape(B, T, at.hq, at.d)
            k = at.k_proj(x).view(B, T, at.hkv, at.d)
            v = at.v_proj(x).view(B, T, at.hkv, at.d)
            if at.q_norm is not None:
                q, k = at.q_norm(q), at.k_norm(k)
            q = rotate(q.transpose(1, 2), cos, sin, at.rdim)  # [B, Hq, T, D]
            k = rotate(k.transpose(1, 2), cos, sin, at.rdim)  # [B, Hkv, T, D]
            rows = slots_t[:, None]  # [B, 1] broadcast against pos [B, T]: the written cells are [B, T, Hkv, D]
            K[rows, :, pos] = k.transpose(1, 2)
            V[rows, :, pos] = v
            if contiguous is not None:  # slots s0..s0+B-1: a view, no gather
                Ks, Vs = K[contiguous : contiguous + B, :, :S], V[contiguous : contiguous + B, :, :S]
            else:
                Ks, Vs = K[slots_t, :, :S], V[slots_t, :, :S]  # [B, Hkv, S, D]
            o = F.scaled_dot_product_attention(q, Ks, Vs, attn_mask=mask, enable_gqa=at.hq != at.hkv)
            o = o.transpose(1, 2).reshape(B, T, at.hq * at.d)
            if gate is not None:
                o = o * torch.sigmoid(gate)
            h = h + at.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _slots(self, slots: Sequence[int]):
        slots = list(slots)
        s0 = slots[0]
        contiguous = s0 if slots == list(range(s0, s0 + len(slots))) else None
        return torch.tensor(slots, device=self.device), contiguous

    def _trunk(self, ids, slots_t, contiguous, pos):
        h = self._layers(self.model.layers, self.kv, self.model.embed(ids), slots_t, pos, contiguous)
        return self.model.model.norm(h)  # [B, T, H]

    def _mtp(self, h_prev, next_ids, slots_t, contiguous, pos):
        """The MTP block's rows at positions pos [B, T] (normed draft hidden [B, T, H])."""
        m = self.model.mtp
        x = m.eh_proj(torch.cat([m.enorm(self.model.embed(next_ids)), m.hnorm(h_prev)], -1))
        return m.norm(self._layers(m.layers, self.mtp_kv, x, slots_t, pos, contiguous))

    def _logits(self, h):
        return self.model.logits(h).float()

    # ── the interface ──
    @torch.no_grad()
    def prefill(self, slot, ids, draft=False):
        self._check_prompt(slot, ids)
        if draft and self.model.mtp is None:
            raise CortiqError("speculative decoding needs an MTP draft block (model.mtp.*); this model has none")
        n = len(ids)
        slots_t, c = self._slots([slot])
        t = torch.tensor([list(ids)], device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        H = self._trunk(t, slots_t, c, pos)  # [1, n, H]
        self.lens[slot] = n
        self.h_last[slot] = H[0, -1]
        self.mtp_lens[slot] = 0
        if draft and n > 1:  # MTP rows 0..n-2: row p reads h_p and token p+1
            self._mtp(H[:, :-1], t[:, 1:], slots_t, c, pos[:, :-1])
            self.mtp_lens[slot] = n - 1
        return self._logits(H[0, -1])

    @torch.no_grad()
    def step(self, slots, tokens):
        slots = list(slots)
        for s in slots:
            if self.lens[s] + 1 > self.max_len:
                raise CortiqError(f"engine: slot {s} is full ({self.max_len} positions)")
        slots_t, c = self._slots(slots)
        pos = torch.tensor([self.lens[s] for s in slots], device=self.device)[:, None]  # [B, 1]
        H = self._trunk(torch.tensor(list(tokens), device=self.device)[:, None], slots_t, c, pos)
        for s in slots:
            self.lens[s] += 1
        self.h_last[slots_t] = H[:, 0]
        return self._logits(H[:, 0])

    @torch.no_grad()
    def speculate(self, slots, tokens):
        """One round for every slot (invariant at its start: the trunk holds
        positions 0..n-1, h_last is row n-1, the token at n is decided but not
        fed; the MTP block holds rows 0..n-2)."""
        if not self.draft:
            raise CortiqError("engine: built without a draft (draft=0)")
        slots, k, dev = list(slots), self.draft, self.device
        for s in slots:
            if self.lens[s] + k + 1 > self.max_len:
                raise CortiqError(f"engine: slot {s} has no room for a round of {k} drafts")
        slots_t, c = self._slots(slots)
        n = torch.tensor([self.lens[s] for s in slots], device=dev)  # [B]
        tok = torch.tensor(list(tokens), device=dev)[:, None]  # [B, 1]
        h_prev = self.h_last[slots_t][:, None]  # [B, 1, H]
        # draft: the MTP chain, step j at row n-1+j reads step j-1's output
        xh, xt, drafts = h_prev, tok, []
        for j in range(k):
            xh = self._mtp(xh, xt, slots_t, c, (n - 1 + j)[:, None])
            xt = self._logits(xh[:, -1]).argmax(-1, keepdim=True)  # [B, 1]
            drafts.append(xt)
        D = torch.cat(drafts, 1)  # [B, k]
        # verify: the trunk over [tok, d_0..d_{k-1}] at positions n..n+k
        block = torch.cat([tok, D], 1)  # [B, k+1]
        steps = torch.arange(k + 1, device=dev)
        Hv = self._trunk(block, slots_t, c, n[:, None] + steps)  # [B, k+1, H]
        pred = self._logits(Hv).argmax(-1)  # [B, k+1]: the trunk's token after block[:, i]
        a = (D == pred[:, :k]).long().cumprod(1).sum(1)  # [B] drafts accepted
        # the MTP rows n-1..n-1+k from the trunk's own rows; those past n-1+a are dropped by length
        self._mtp(torch.cat([h_prev, Hv[:, :k]], 1), block, slots_t, c, (n - 1)[:, None] + steps)
        self.h_last[slots_t] = Hv[torch.arange(len(slots), device=dev), a]
        a_l, D_l, pred_l = a.tolist(), D.tolist(), pred.tolist()
        out = []
        for i, s in enumerate(slots):
            ai = a_l[i]
            self.lens[s] += ai + 1
            self.mtp_lens[s] = self.lens[s] - 1
            out.append(D_l[i][:ai] + [pred_l[i][ai]])
        return out

    def release(self, slot):
        # the buffers stay: a later prefill overwrites from position 0 and masks the rest
        self.lens[slot] = self.mtp_lens[slot] = 0

    def length(self, slot):
        return self.lens[slot]


class LoopEngine(Engine):
    """One model cache per slot and one forward per slot: any layer type."""

    def __init__(self, model, max_batch: int, max_len: int, draft: int = 0):
        super().__init__(model, max_batch, max_len, draft)
        self.caches: list = [None] * max_batch
        self.h_last: list = [None] * max_batch  # [1, 1, H] per slot
        self.has_gdn = LINEAR in model.arch.layer_types

    @torch.no_grad()
    def prefill(self, slot, ids, draft=False):
        self._check_prompt(slot, ids)
        m = self.model
        cache = m.new_cache()
        t = torch.tensor([list(ids)], device=self.device)
        H, _ = m.forward_hidden(t, cache=cache)  # [1, n, H]
        if draft:
            if m.mtp is None:
                raise CortiqError("speculative decoding needs an MTP draft block (model.mtp.*); this model has none")
            if t.shape[1] > 1:
                m.mtp_forward(H[:, :-1], t[:, 1:], 0, cache.extra[0])
        self.caches[slot], self.h_last[slot] = cache, H[:, -1:]
        return m.logits(H[0, -1]).float()

    @torch.no_grad()
    def step(self, slots, tokens):
        rows = []
        for s, t in zip(slots, tokens):
            cache = self.caches[s]
            if cache.seen + 1 > self.max_len:
                raise CortiqError(f"engine: slot {s} is full ({self.max_len} positions)")
            H, _ = self.model.forward_hidden(torch.tensor([[t]], device=self.device), cache=cache)
            self.h_last[s] = H[:, -1:]
            rows.append(H[0, -1])
        return self.model.logits(torch.stack(rows)).float()

    @torch.no_grad()
    def speculate(self, slots, tokens):
        return [self._round(s, t) for s, t in zip(slots, tokens)]

    def _round(self, slot: int, tok: int) -> list[int]:
        """One draft-and-verify round of one slot, as model.generate.generate_speculative runs it."""
        m, dev, k = self.model, self.device, self.draft
        cache, h_prev = self.caches[slot], self.h_last[slot]
        n = cache.seen
        if n + k + 1 > self.max_len:
            raise CortiqError(f"engine: slot {slot} has no room for a round of {k} drafts")
        mtp_state = cache.extra[0]
        mtp_snap = mtp_state.snapshot()
        drafts, xh, xt = [], h_prev, tok
        for j in range(k):
            xh = m.mtp_forward(xh, torch.tensor([[xt]], device=dev), n - 1 + j, mtp_state)
            xt = int(m.logits(xh[0, -1]).argmax())
            drafts.append(xt)
        snap = cache.snapshot()
        block = torch.tensor([[tok] + drafts], device=dev)
        Hv, _ = m.forward_hidden(block, cache=cache)  # [1, k+1, H]
        pred = m.logits(Hv[0]).argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == pred[a]:
            a += 1
        if a < k:
            if self.has_gdn:  # a recurrent state cannot be cut: re-run the accepted tokens
                cache.restore(snap)
                Hv, _ = m.forward_hidden(block[:, : a + 1], cache=cache)
            else:
                for st in cache.states:
                    st.restore(n + a + 1)
                cache.seen = n + a + 1
        mtp_state.restore(mtp_snap)
        m.mtp_forward(torch.cat([h_prev, Hv[:, :a]], 1), block[:, : a + 1], n - 1, mtp_state)
        self.h_last[slot] = Hv[:, a : a + 1]
        return drafts[:a] + [pred[a]]

    def release(self, slot):
        self.caches[slot] = self.h_last[slot] = None

    def length(self, slot):
        c = self.caches[slot]
        return 0 if c is None else c.seen
