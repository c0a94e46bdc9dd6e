"""Prompts into a slot: the chunked reference prefill (`PrefillJob`) and the captured one
(`StagedPrefill`, `StagedJob`)."""

from __future__ import annotations

import torch

from ...errors import CortiqError
from ..decoder import KVState


class _PromptJob:
    """A prompt entering slot `slot` of `eng` a chunk per `run()`: the checks and the count."""

    def __init__(self, eng, slot: int, ids):
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

    def __init__(self, eng, slot: int, ids, temperature: float, chunk: int):
        super().__init__(eng, slot, ids)
        if temperature > 0 and not eng.sampling:
            raise CortiqError("decode engine: temperature > 0 needs an engine built with sampling=True")
        if temperature < 0:
            raise CortiqError(f"temperature {temperature}: must be ≥ 0")
        self.eng, self.temperature = eng, temperature
        self.chunk = chunk if chunk > 0 else self.n
        self.t = torch.tensor([self.ids], device=eng.device)
        self.cache = eng.model.new_cache()
        self.ms = KVState() if eng.draft else None

    @torch.no_grad()
    def run(self) -> int | None:
        eng, m, n, t = self.eng, self.eng.model, self.n, self.t
        if self.first is not None:
            return self.first
        a, b = self.at, min(self.at + self.chunk, n)
        H, _ = m.forward_hidden(t[:, a:b], cache=self.cache)  # [1, b-a, H]
        if eng.draft:  # the draft's rows a..e-1: each reads its trunk row and the prompt token after it
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
            st, j = cache.states[i], eng.kind_index[i]
            eng.k_cache[j, slot, :, :n] = st.k[0]
            eng.v_cache[j, slot, :, :n] = st.v[0]
        for i in eng.lin_idx:
            st, j = cache.states[i], eng.kind_index[i]
            eng.conv[j, slot] = st.conv[0]
            eng.rec[j, slot] = st.rec[0]
        eng.temp[slot] = self.temperature
        if eng.final_rows is not None:
            eng.final_rows[slot] = h_last[0, -1]
        first = eng._pick(h_last, eng.temp[slot: slot + 1])[0, 0]
        if eng.draft:  # the first round's chain from row n-1 (each branch's, with a tree)
            ms, branches = self.ms, eng.branches
            base, which = torch.tensor([n], device=eng.device), torch.tensor([slot], device=eng.device)
            xh = m.mtp_forward(h_last, first.view(1, 1), n - 1, ms)  # [1, 1, H] chain step 0
            eng.mtp_last[slot] = xh[0]
            d = eng._draft_first(xh, base, which)  # [1, branches]
            drafts = [d]
            # the branches as a batch, each over its own copy of the draft's rows
            bs = KVState()
            bs.k, bs.v = ms.k.expand(branches, -1, -1, -1), ms.v.expand(branches, -1, -1, -1)
            xh = xh.expand(branches, -1, -1)
            for j in range(1, eng.draft):
                xh = m.mtp_forward(xh, d.view(branches, 1), n - 1 + j, bs)
                d = eng._draft_pick(xh.reshape(1, branches, -1), j, base, which)  # [1, branches]
                drafts.append(d)
            # the committed rows, then branch 0's chain rows where the engine's own chain leaves them
            # (nothing reads those before a round writes them again; kept so both prefills leave equal caches)
            eng.mtp_k_cache[slot, :, : n - 1 + eng.draft] = bs.k[0]
            eng.mtp_v_cache[slot, :, : n - 1 + eng.draft] = bs.v[0]
            eng.drafts[slot] = torch.stack(drafts, 2).reshape(-1)
        eng.pending[slot] = first
        eng._installed(slot, n)
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

    def __init__(self, eng, sizes=(16, 32, 64, 128, 256)):
        if eng.lin_idx:
            raise CortiqError("decode engine: staged prefill runs attention-only models (a GDN layer's state "
                              "needs the reference forward)")
        self.eng = eng
        # a chunk never spans more positions than a prompt may have (it leaves the draft's rows free)
        self.sizes = sorted({min(int(c), eng.max_len - eng.draft) for c in sizes})
        C = self.sizes[-1]
        st = self.st = eng.staging_engine()
        dev = eng.device
        z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
        self.tok, self.nxt = z(1, C), z(1, C)  # the chunk's tokens and the token after each
        self.start, self.final = z(1), z(1, dtype=torch.bool)
        # the count of real rows starts at 1, not 0: each graph's capture runs the chunk before
        # any prompt is staged, and that run selects row nreal-1 (row -1 is out of range, on
        # CUDA a device-side assert that poisons every later call in the process)
        self.nreal = torch.ones(1, dtype=torch.long, device=dev)
        self.first = z(1)
        self.row = torch.zeros(1, eng.arch.hidden_size, dtype=eng.dtype, device=dev)  # the prompt's last final row
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
        if st.draft:
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
        e.k_cache[:, slot, :, :n].copy_(st.k_cache[:, 0, :, :n])
        e.v_cache[:, slot, :, :n].copy_(st.v_cache[:, 0, :, :n])
        if e.draft:
            e.mtp_k_cache[slot, :, : n + e.draft].copy_(st.mtp_k_cache[0, :, : n + e.draft])
            e.mtp_v_cache[slot, :, : n + e.draft].copy_(st.mtp_v_cache[0, :, : n + e.draft])
            e.drafts[slot].copy_(st.drafts[0])
            e.mtp_last[slot].copy_(st.mtp_last[0])
        if e.final_rows is not None:
            e.final_rows[slot].copy_(self.row[0])
        e.temp[slot] = 0.0
        e.pending[slot: slot + 1].copy_(self.first)
        e._installed(slot, n)
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
        if sp.eng.device.type == "cuda":
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
