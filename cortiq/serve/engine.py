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

The scheduler's pipelined interface, on top of those:

    prefill_job(slot, ids, chunk)  a prompt a chunk per `run()` (None, then the logits [V])
    set_pending(slot, tok)      the token the slot's next step feeds (a sampled first token)
    launch(slots, depth, sample)
                                one step (depth 0) or a speculative round verifying `depth`
                                drafts for the slots, each feeding its pending token; rows in
                                `sample` ({slot: (temperature, top_p, u)}) sample their next
                                token, the others take the argmax -> a `Launched` whose
                                `wait()` gives each slot's new tokens; the engine keeps each
                                slot's last new token as its pending one, so the next launch
                                needs nothing back from the host (the decode adapter returns
                                before the device has finished)
    fits(slots, need)           every slot has room for `need` more positions past the launched ones
    step_key(rows)              what a step's cost depends on beside its kind, for slots 0..rows-1
                                (the decode adapter: its batch bucket and key length)
    step_times()                {(step key, depth, tree): seconds} of every kind of step at every
                                key, timed before any request runs ({}: none timed ahead)

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
    #: the draft tree's first guesses a round (1: chain rounds only)
    branches = 1
    #: the tokens the draft guesses among where its head is narrowed (`draft_vocab`); 0: every token
    draft_rows = 0

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
    def speculate(self, slots: Sequence[int], tokens: Sequence[int], depth: int = 0) -> list[list[int]]:
        """depth: drafts verified this round (0: all `draft`)."""

    @abstractmethod
    def release(self, slot: int) -> None: ...

    @abstractmethod
    def length(self, slot: int) -> int: ...

    # ── the pipelined interface (a synchronous default over the methods above) ──
    def prefill_job(self, slot: int, ids: Sequence[int], chunk: int = 0):
        self._check_prompt(slot, ids)
        return _WholePrefill(self, slot, list(ids))

    def set_pending(self, slot: int, tok) -> None:
        """tok: an int, or a one-element tensor (an engine that keeps it on the device reads it there)."""
        self._pending()[slot] = int(tok)

    def _pending(self) -> dict:
        if not hasattr(self, "_pend"):
            self._pend = {}
        return self._pend

    def bucket_for(self, rows: int) -> int:
        """The batch size a step over slots 0..rows-1 runs at (the policy times steps by it)."""
        return rows

    def fits(self, slots: Sequence[int], need: int) -> bool:
        return all(self.length(s) + need <= self.max_len for s in slots)

    def step_key(self, rows: int) -> tuple:
        return (self.bucket_for(rows), 0)

    def step_times(self) -> dict:
        return {}

    def launch(self, slots: Sequence[int], depth: int = 0, sample: dict | None = None,
               chain: bool = True, tree: bool | None = None) -> Launched:
        """(chain: whether a plain step also drafts for the next round; engines that always do ignore it;
        tree: a round on the draft tree, engines without one ignore it)"""
        import time

        from .sampling import sample_ids

        pend = self._pending()
        toks = [pend[s] for s in slots]
        t0 = time.perf_counter()
        if depth:
            new = self.speculate(slots, toks, depth)
        else:
            logits = self.step(slots, toks)
            rows = [(sample or {}).get(s, (0.0, 1.0, 0.0)) for s in slots]
            picked = sample_ids(logits, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                            self.picked).tolist()
            new = [[t] for t in picked]
        for s, n in zip(slots, new):
            pend[s] = n[-1]
        return Launched(slots, self.bucket_for(max(slots) + 1), depth, new, time.perf_counter() - t0)

    def _check_prompt(self, slot: int, ids: Sequence[int]):
        if not 0 <= slot < self.max_batch:
            raise CortiqError(f"engine: slot {slot} outside 0..{self.max_batch - 1}")
        if not ids or len(ids) >= self.max_len:
            raise CortiqError(f"engine: a prompt of {len(ids)} tokens (1..{self.max_len - 1} fit)")


class Launched:
    """A launched step: `wait()` -> each slot's new tokens (list per slot, in launch order);
    `seconds` (after wait): the step's own time (device time on CUDA); `tree`: a round that
    verified the draft tree."""

    def __init__(self, slots, bucket: int, depth: int, new=None, seconds: float = 0.0, tree: bool = False):
        self.slots, self.bucket, self.depth, self.tree = list(slots), bucket, depth, tree
        self.new, self.seconds = new, seconds

    def wait(self) -> list[list[int]]:
        return self.new


class _WholePrefill:
    """A prompt prefilled in one go (engines without chunked prefill)."""

    def __init__(self, eng, slot, ids):
        self.eng, self.slot, self.ids, self.left = eng, slot, ids, len(ids)

    def run(self):
        self.left = 0
        return self.eng.prefill(self.slot, self.ids)


def make_engine(model, max_batch: int, max_len: int, draft: int = 0, kind: str = "auto",
                branches: int = 1, draft_vocab=None) -> Engine:
    """The decode engine by default; the loop engine when asked (chains over the whole head only:
    no draft tree, no `draft_vocab`)."""
    if kind in ("auto", "decode"):
        return DecodeAdapter(model, max_batch, max_len, draft, branches=branches, draft_vocab=draft_vocab)
    if kind == "loop":
        if branches > 1:
            raise CortiqError("engine loop: a draft tree (draft_branches > 1) needs the decode engine")
        if draft_vocab is not None:
            raise CortiqError("engine loop: a draft among some tokens (--draft-vocab) needs the decode engine")
        return LoopEngine(model, max_batch, max_len, draft)
    raise CortiqError(f"engine kind {kind!r} (choose auto, decode or loop)")


def bucket_sizes(slots: int) -> list[int]:
    """Batch sizes a step is built for: 1, 2, 4, ... below `slots`, then `slots`."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def kv_bucket_sizes(max_len: int, shortest: int = 32) -> list[int]:
    """Key lengths a step's attention is built for: 32, 64, ... below max_len, then max_len. A
    step reads the caches up to the shortest that holds its slots (attention over the whole
    static cache was a large part of a small batch's step: bench/DECODE.md, "The engine's design notes"),
    at the price of one captured graph per length, batch bucket and kind of step."""
    return [L for L in bucket_sizes(max_len) if L >= shortest] or [max_len]


class _DecodeLaunched(Launched):
    """A decode-adapter step in flight: its tokens are being copied into pinned host
    buffers behind the step on the device's stream; `wait()` waits for that copy only."""

    def __init__(self, ad: "DecodeAdapter", slots, bucket, depth, bufs, done, t0, gens, tree: bool = False):
        super().__init__(slots, bucket, depth, tree=tree)
        self.ad, self.bufs, self.done, self.t0, self.gens = ad, bufs, done, t0, gens
        self.bound_reads = ad.eng.bound_reads

    def wait(self):
        if self.new is not None:
            return self.new
        if self.done is not None:  # CUDA: the end event, then the step's device time
            self.done.synchronize()
            self.seconds = self.t0.elapsed_time(self.done) / 1000
        else:  # the eager step's own time, taken at launch
            self.seconds = self.t0
        slots, ad = self.slots, self.ad
        if self.depth:
            pred, n = self.bufs[1][: self.bucket].tolist(), self.bufs[2][: self.bucket].tolist()
            self.new = [pred[s][: n[s]] for s in slots]
        else:
            tok = self.bufs[0][: self.bucket].tolist()
            self.new = [[tok[s]] for s in slots]
        exact = ad.eng.bound_reads != self.bound_reads
        for s, g, new in zip(slots, self.gens, self.new):
            if ad.gen[s] == g:  # the slot still holds the request this step advanced
                ad.lens[s] += len(new)
                if not exact:  # the bound counted every draft as kept (unless it was read back since)
                    ad.eng.drop_unkept(s, self.depth + 1 - len(new))
        return self.new


class DecodeAdapter(Engine):
    """cortiq.model.decode.DecodeEngine behind this interface. That engine
    keeps each slot's pending token and advances every active slot at once;
    the server decides tokens itself (top-p, a seed per request), so each call
    first sets the pending tokens to the scheduler's, and the logits come from
    the trunk's last hidden row per slot (the engine's `final_rows`, which the
    captured graphs refresh) through the head. `picked` holds the
    engine's own greedy tokens of the last call, which the scheduler takes
    for greedy requests (the same argmax, from the engine's own product).

    `launch` (the scheduler's path) feeds nothing from the host: greedy rows'
    pending tokens are the engine's own, sampled rows' are chosen on the device
    from the step's logits and written back there. A step runs over the
    smallest bucket of slots 0..b-1 holding every active slot (one captured
    graph per bucket on CUDA), its new tokens go to pinned host memory by a
    non-blocking copy, and an event marks when they are there."""

    steps_all = True

    @staticmethod
    def engine_len(max_len: int, draft: int) -> int:
        """The decode engine's own max_len for requests of max_len: room for a verify block of
        draft + 1 past a request's last position, so a request keeps every one of max_len (near
        the end, a round that does not fit is a plain step: `fits`). The KV estimate of
        `cortiq serve` sizes its cache by this too."""
        return max_len + draft

    def __init__(self, model, max_batch: int, max_len: int, draft: int = 0, graphs: bool | None = None,
                 buckets: list[int] | None = None, kv_buckets: list[int] | None = None, branches: int = 1,
                 draft_vocab=None):
        super().__init__(model, max_batch, max_len, draft)
        from ..model.decode import DecodeEngine, StagedPrefill

        self.eng = DecodeEngine(model, slots=max_batch, max_len=self.engine_len(max_len, draft), draft=draft,
                                sampling=False, graphs=graphs, buckets=buckets or bucket_sizes(max_batch),
                                # (those below max_len: the engine's whole cache is the last,
                                # max_len and the rows a round writes past it)
                                kv_buckets=kv_bucket_sizes(max_len)[:-1] if kv_buckets is None else kv_buckets,
                                branches=branches, keep_rows=True, draft_vocab=draft_vocab)
        self.branches = branches
        self.draft_rows = 0 if self.eng.d_ids is None else len(self.eng.d_ids)

        # prompts by captured chunk graphs where the model allows (attention only)
        self.staged = None if self.eng.lin_idx else StagedPrefill(self.eng)
        self.lens = [0] * max_batch
        self.gen = [0] * max_batch  # bumped when a slot changes hands (late results skip it)
        self.on: set[int] = set()
        self.picked: torch.Tensor | None = None
        self.cuda = self.device.type == "cuda"
        pin = dict(pin_memory=True) if self.cuda else {}
        # a ring of host buffers: a launched step's tokens stay readable while the next runs
        self._ring = [(torch.zeros(max_batch, dtype=torch.long, **pin),
                       torch.zeros(max_batch, draft + 1, dtype=torch.long, **pin),
                       torch.zeros(max_batch, dtype=torch.long, **pin)) for _ in range(3)]
        self._next = 0

    def _logits(self, slots_t):
        return self.model.logits(self.eng.final_rows[slots_t]).float()  # [B, V]

    def _feed(self, slots, tokens):
        if set(slots) != self.on:
            raise CortiqError(f"engine: steps every active slot together ({sorted(self.on)}), not {sorted(slots)}")
        slots_t = torch.tensor(list(slots), device=self.device)
        self.eng.pending[slots_t] = torch.tensor(list(tokens), device=self.device)
        return slots_t

    def _rows(self) -> int:
        return self.eng.bucket_for(max(self.on) + 1)

    @torch.no_grad()
    def prefill(self, slot, ids):
        job = self.prefill_job(slot, ids)
        out = None
        while out is None:
            out = job.run()
        return out

    def prefill_job(self, slot, ids, chunk: int = 0):
        self._check_prompt(slot, ids)
        return _AdapterPrefill(self, slot, list(ids), chunk)

    def set_pending(self, slot, tok):
        if isinstance(tok, torch.Tensor):  # the device's own copy: no wait for the host
            self.eng.pending[slot: slot + 1].copy_(tok.reshape(1))
        else:
            self.eng.pending[slot] = int(tok)

    @torch.no_grad()
    def step(self, slots, tokens):
        slots_t = self._feed(slots, tokens)
        self.picked = self.eng.step_on(self._rows())[slots_t]
        for s in slots:
            self.lens[s] += 1
        return self._logits(slots_t)

    @torch.no_grad()
    def speculate(self, slots, tokens, depth: int = 0):
        slots_t = self._feed(slots, tokens)
        pred, n = self.eng.spec_on(self._rows(), depth or None)
        p, kept = pred[slots_t].tolist(), n[slots_t].tolist()
        for s, n_s in zip(slots, kept):
            self.lens[s] += n_s
        return [row[:n_s] for row, n_s in zip(p, kept)]

    def bucket_for(self, rows: int) -> int:
        return self.eng.bucket_for(rows)

    def step_key(self, rows: int) -> tuple:
        b = self.eng.bucket_for(rows)
        return (b, self.eng.key_length(b))

    def step_times(self) -> dict:
        # (a CPU's eager steps are timed once each: they only stand in for the device's in tests)
        times = self.eng.time_steps(3 if self.cuda else 1)
        return {((b, n), d, t): s for (b, n, d, t), s in times.items()}

    def fits(self, slots, need):
        # the engine's host-side bound, launched steps included
        return all(self.eng.length_bound(s) + need <= self.max_len for s in slots)

    @torch.no_grad()
    def launch(self, slots, depth: int = 0, sample: dict | None = None, chain: bool = True,
               tree: bool | None = None) -> Launched:
        import time

        from .sampling import sample_ids

        if set(slots) != self.on:
            raise CortiqError(f"engine: steps every active slot together ({sorted(self.on)}), not {sorted(slots)}")
        b = self._rows()
        eng = self.eng
        t0 = done = None
        if self.cuda:
            t0, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
        else:
            t0 = time.perf_counter()
        bufs = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        tree = bool(depth) and eng.tree_round(tree)
        if depth:
            pred, n = eng.spec_on(b, depth, tree)
            bufs[1][:b].copy_(pred[:b], non_blocking=True)
            bufs[2][:b].copy_(n[:b], non_blocking=True)
        else:
            out = eng.step_on(b, chain=chain)
            if sample:  # those rows' tokens from the step's logits, decided on the device
                ss = list(sample)
                st = torch.tensor(ss, device=self.device)
                rows = [sample[s] for s in ss]
                tok = sample_ids(self._logits(st), [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                             out[st])
                eng.pending[st] = tok
                out[st] = tok
            bufs[0][:b].copy_(out[:b], non_blocking=True)
        if done is not None:
            done.record()
        else:  # eager: the step has run; its time is the call's
            t0 = time.perf_counter() - t0
        return _DecodeLaunched(self, slots, b, depth, bufs, done, t0, [self.gen[s] for s in slots], tree)

    def release(self, slot):
        self.eng.release(slot)
        self.on.discard(slot)
        self.lens[slot] = 0
        self.gen[slot] += 1

    def length(self, slot):
        return self.lens[slot]


class _AdapterPrefill:
    """The decode engine's chunked prefill; the last `run()` gives the logits [V] and
    activates the slot."""

    def __init__(self, ad: DecodeAdapter, slot: int, ids: list[int], chunk: int):
        self.ad, self.slot, self.n = ad, slot, len(ids)
        self.job = ad.staged.job(slot, ids, chunk) if ad.staged else ad.eng.prefill_job(slot, ids, 0.0, chunk)

    @property
    def left(self) -> int:
        return self.job.left

    @torch.no_grad()
    def run(self):
        first = self.job.run()
        if first is None:
            return None
        ad, slot = self.ad, self.slot
        ad.gen[slot] += 1
        ad.lens[slot] = self.n
        ad.on.add(slot)
        # the staged prefill's first token stays on the device (a tensor [1]), and the slot's row is
        # indexed by a slice: a tensor made from a Python list would be copied, waiting for the step in flight
        ad.picked = first.reshape(1) if isinstance(first, torch.Tensor) else torch.tensor([first], device=ad.device)
        return ad._logits(slice(slot, slot + 1))[0]


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
    def speculate(self, slots, tokens, depth: int = 0):
        return [self._round(s, t, depth or self.draft) for s, t in zip(slots, tokens)]

    def _round(self, slot: int, tok: int, depth: int) -> list[int]:
        """One draft-and-verify round of one slot (`depth` drafts), as model.generate.generate_speculative runs it."""
        m, dev = self.model, self.device
        cache, h_prev = self.caches[slot], self.h_last[slot]
        n = cache.seen
        if n + depth + 1 > self.max_len:
            raise CortiqError(f"engine: slot {slot} has no room for a round of {depth} drafts")
        mtp_state = cache.extra[0]
        mtp_snap = mtp_state.snapshot()
        drafts, xh, xt = [], h_prev, tok
        for j in range(depth):
            xh = m.mtp_forward(xh, torch.tensor([[xt]], device=dev), n - 1 + j, mtp_state)
            xt = int(m.logits(xh[0, -1]).argmax())
            drafts.append(xt)
        snap = cache.snapshot()
        block = torch.tensor([[tok] + drafts], device=dev)
        Hv, _ = m.forward_hidden(block, cache=cache)  # [1, depth+1, H]
        pred = m.logits(Hv[0]).argmax(-1).tolist()
        a = 0
        while a < depth and drafts[a] == pred[a]:
            a += 1
        if a < depth:
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
