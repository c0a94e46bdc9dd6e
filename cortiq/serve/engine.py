"""Decoding engines for the server: independent slots decoded together.

A slot holds one sequence. The server's scheduler only uses this interface:

    prefill(slot, ids)          the prompt into a free slot -> next-token logits [V] (f32)
    step(slots, tokens)         feed one token per slot, one forward for all -> logits [B, V] (f32)
    speculate(slots, tokens)    greedy round with the MTP draft: feed each slot's decided token,
                                draft `draft` tokens, verify them in one trunk forward
                                -> per slot the newly decided tokens (accepted drafts, then the
                                trunk's own next token, which is decided but not yet fed)
    release(slot)               the slot is free again
    length(slot)                positions the slot holds

`steps_all`: True when step and speculate must be given every active slot
(the engine advances all of them together).

Two implementations:
- `DecodeAdapter`: cortiq.model.decode.DecodeEngine behind this interface
  (preallocated KV and Gated DeltaNet state per slot, one batched forward
  over slots of different lengths, CUDA graphs on CUDA); the default.
- `LoopEngine`: the model's own per-sequence cache, one forward per slot,
  speculative rounds as model.generate.generate_speculative runs them. The
  plain reference the decode adapter is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..arch import LINEAR
from ..errors import CortiqError


class Engine(ABC):
    """Slots 0..max_batch-1, each up to max_len positions."""

    steps_all = False
    #: the engine's own greedy tokens for the rows of the last prefill or step, or None
    picked = None

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
    def prefill(self, slot: int, ids: Sequence[int]) -> torch.Tensor: ...

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
    """The decode engine by default; the loop engine when asked."""
    if kind in ("auto", "decode"):
        return DecodeAdapter(model, max_batch, max_len, draft)
    if kind == "loop":
        return LoopEngine(model, max_batch, max_len, draft)
    raise CortiqError(f"engine kind {kind!r} (choose auto, decode or loop)")


def _row_keeping_engine():
    """DecodeEngine, keeping the trunk's last final hidden row per slot: the
    row its own next-token choice reads (prefill's last prompt row, each plain
    step's row), copied into a buffer made before the engine captures its
    step, so the captured graph refreshes it at every replay."""
    from ..model.decode import DecodeEngine

    class RowKeeping(DecodeEngine):
        def __init__(self, model, slots: int, **kw):
            w = model.model.embed_tokens.weight
            self.serve_rows = torch.zeros(slots, model.arch.hidden_size, dtype=w.dtype, device=w.device)  # [S, H]
            self._prefill_slot = None
            super().__init__(model, slots=slots, **kw)

        def prefill(self, slot, ids, temperature=0.0):
            self._prefill_slot = slot
            try:
                return super().prefill(slot, ids, temperature)
            finally:
                self._prefill_slot = None

        def _pick(self, h, temp=None):
            if temp is not None:  # the trunk's next-token choice: h [S, 1, H], or [1, 1, H] in prefill
                if self._prefill_slot is not None:
                    self.serve_rows[self._prefill_slot] = h[0, -1]
                else:
                    self.serve_rows.copy_(h[:, -1])
            return super()._pick(h, temp)

    return RowKeeping


class DecodeAdapter(Engine):
    """cortiq.model.decode.DecodeEngine behind this interface. That engine
    keeps each slot's pending token and advances every active slot at once;
    the server decides tokens itself (top-p, a seed per request), so each call
    first sets the pending tokens to the scheduler's, and the logits come from
    the trunk's last hidden row per slot through the head. `picked` holds the
    engine's own greedy tokens of the last call, which the scheduler takes
    for greedy requests (the same argmax, from the engine's own product)."""

    steps_all = True

    def __init__(self, model, max_batch: int, max_len: int, draft: int = 0, graphs: bool | None = None):
        super().__init__(model, max_batch, max_len, draft)
        self.eng = _row_keeping_engine()(model, slots=max_batch, max_len=max_len, draft=draft, sampling=False,
                                         graphs=graphs)
        # the engine keeps room for a verify block of draft+1 past every slot's next step
        self.max_len = max_len - draft
        self.lens = [0] * max_batch
        self.on: set[int] = set()
        self.picked: torch.Tensor | None = None

    def _logits(self, slots_t):
        return self.model.logits(self.eng.serve_rows[slots_t]).float()  # [B, V]

    def _feed(self, slots, tokens):
        if set(slots) != self.on:
            raise CortiqError(f"engine: steps every active slot together ({sorted(self.on)}), not {sorted(slots)}")
        slots_t = torch.tensor(list(slots), device=self.device)
        self.eng.pend[slots_t] = torch.tensor(list(tokens), device=self.device)
        return slots_t

    @torch.no_grad()
    def prefill(self, slot, ids):
        self._check_prompt(slot, ids)
        first = self.eng.prefill(slot, list(ids), 0.0)
        self.lens[slot] = len(ids)
        self.on.add(slot)
        self.picked = torch.tensor([first], device=self.device)
        return self._logits(torch.tensor([slot], device=self.device))[0]

    @torch.no_grad()
    def step(self, slots, tokens):
        slots_t = self._feed(slots, tokens)
        self.picked = self.eng.step()[slots_t]
        for s in slots:
            self.lens[s] += 1
        return self._logits(slots_t)

    @torch.no_grad()
    def speculate(self, slots, tokens):
        slots_t = self._feed(slots, tokens)
        pred, n = self.eng.spec_step()
        p, k = pred[slots_t].tolist(), n[slots_t].tolist()
        for s, ki in zip(slots, k):
            self.lens[s] += ki
        return [row[:ki] for row, ki in zip(p, k)]

    def release(self, slot):
        self.eng.release(slot)
        self.on.discard(slot)
        self.lens[slot] = 0

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
    def prefill(self, slot, ids):
        self._check_prompt(slot, ids)
        m = self.model
        cache = m.new_cache()
        t = torch.tensor([list(ids)], device=self.device)
        H, _ = m.forward_hidden(t, cache=cache)  # [1, n, H]
        if self.draft and t.shape[1] > 1:
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
            n = cache.seen
            tt = torch.tensor([[t]], device=self.device)
            H, _ = self.model.forward_hidden(tt, cache=cache)
            if self.draft:  # the MTP row of the fed token
                self.model.mtp_forward(self.h_last[s], tt, n - 1, cache.extra[0])
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
