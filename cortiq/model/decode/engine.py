"""`DecodeEngine`: the static-cache engine's state, steps and rounds, graph capture and
bucket views (the package docstring: the API and the buffers).

A speculative round: the trunk verifies [pending, d_1..d_draft] (drafted at the end of the
previous round, or by prefill) in one forward; a = the drafts that equal the trunk's own
choices; then one draft-layer pass over the draft+1 verified rows (the trunk's hidden rows and
tokens) writes the draft's rows for the accepted positions and is, at row a, the next round's
chain step 0; chain steps 1..draft-1 follow. So a round costs one trunk pass and `draft`
draft-layer passes, and the accept count never leaves the device: one graph, one sync.
Rollback: attention entries of rejected drafts are left beyond the slot's new length (the next
round overwrites them before any query can see them); each GDN layer keeps the state after
every token of the verify block and the state after the accepted prefix is selected on the
device. A tree round verifies every branch in one block and moves the winning branch's keys
and values to where a chain's would lie (`_spec_tree`)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ...arch import FULL, LINEAR
from ...errors import CortiqError
from .forward import StaticForward
from .layers import _Attn, _Mlp, _Norm, _dyn, _fuse
from .picks import _argmax, _check_draft_vocab, _pick_greedy, _pick_top, _split
from .prefill import PrefillJob
from .speculative import _kept, _plain_end, _put_drafts, _round_end, _tree_choice, _tree_tables


def auto_branches(arch, dev) -> int:
    """A draft tree's branches where a command's setting leaves them to the engine (0): 4 where a
    tree runs and pays, a CUDA device and a model of attention layers only (a tree of 4 served
    more than the chain at 1 and at 32 clients: bench/DECODE.md, "The final serving table"),
    else 1, the chain (a CPU pays for the verify rows in compute; a Gated DeltaNet state holds
    one branch)."""
    return 4 if torch.device(dev).type == "cuda" and LINEAR not in arch.layer_types else 1


def cache_len(max_len: int, draft: int = 0, branches: int = 1) -> int:
    """Positions the engine's caches hold a slot (`DecodeEngine.cache_len`): max_len, and for a
    draft tree the rows a round writes past it (a tree round writes up to branches·(depth + draft)
    positions past a slot's length, its verify block and its branches' chain rows, where a chain
    writes depth + draft), 16-aligned (the key length of the attention masks)."""
    return -(-(max_len + (branches - 1) * 2 * draft) // 16) * 16


class DecodeEngine(StaticForward):
    """Static-cache decoding over `slots` independent sequences (the package docstring: the API
    and the buffers). Beside those: the outputs `out_tok` [slots], `out_pred` [slots, draft+1]
    and `out_n` [slots]; with `keep_rows`, `final_rows` [slots, hidden], the trunk's final row
    each slot's last next-token choice read (a prefill's last prompt row, each plain step's
    row), refreshed by the captured graphs too; on the host, `length_bound(slot)`, an upper
    bound of each slot's length that the entry points keep without waiting for the device."""

    def __init__(self, model, slots: int = 1, max_len: int = 1024, draft: int = 0, sampling: bool = False,
                 graphs: bool | None = None, seed: int = 0, buckets: list[int] | None = None,
                 kv_buckets: list[int] | None = None, fused: bool | None = None, branches: int = 1,
                 keep_rows: bool = False, draft_vocab=None):
        _check_args(model, slots, max_len, draft, branches, draft_vocab)
        w = model.model.embed_tokens.weight
        self.model, self.arch = model, model.arch
        self.device, self.dtype = w.device, w.dtype
        self.slots, self.draft, self.branches = slots, draft, branches
        self.max_len, self.sampling = max_len, sampling
        self.cache_len = cache_len(max_len, draft, branches)
        # key lengths a bucketed step attends over (each 16-aligned, the last the whole cache): a
        # step whose slots all lie below one of them reads only that many positions of the caches
        self.kv_sizes = sorted({min(self.cache_len, -(-int(x) // 16) * 16) for x in (kv_buckets or []) if int(x) > 0}
                               | {self.cache_len})
        self.key_len = self.cache_len  # the key length the next step's attention reads (set by each entry point)
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise CortiqError("decode engine: CUDA graphs need a CUDA device")
        with torch.no_grad():
            self._layer_weights()
            self._caches()
            self._slot_state(keep_rows)
        self.head = model.head_weight
        self._pick_chunk = _split(self.head.shape[0])  # the picks' chunk width (`_argmax`)
        self._draft_head(draft_vocab)
        on = (self.device.type == "cuda" and not self.lin_idx) if fused is None else bool(fused)
        self._fns, self._ragged = self._compiled() if on else (None, False)
        self.fused = self._fns is not None
        self.gen = torch.Generator(device=self.device).manual_seed(seed) if (sampling and not self.graphs) else None
        if sampling and self.graphs:
            torch.cuda.manual_seed(seed)  # captured RNG draws from the default CUDA generator
        self._host_state(buckets)
        if self.graphs:
            self._capture_steps(bool(buckets))

    def _layer_weights(self) -> None:
        """Each layer's weights fused for a step, by layer index (`attn_weights`, `lin_weights`, and
        the draft layer's), and `kind_index`: a layer's index among the layers of its kind (its
        row of the caches)."""
        model, layers = self.model, list(self.model.layers)
        self.kinds = list(self.arch.layer_types)
        self.attn_idx = [i for i, t in enumerate(self.kinds) if t == FULL]
        self.lin_idx = [i for i, t in enumerate(self.kinds) if t == LINEAR]
        self.kind_index = {i: j for idx in (self.attn_idx, self.lin_idx) for j, i in enumerate(idx)}
        self.attn_weights = {i: _Attn(layers[i]) for i in self.attn_idx}
        self.lin_weights = {}
        for i in self.lin_idx:
            g = layers[i].linear_attn
            mods = [g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a]  # one product for the four
            self.lin_weights[i] = (_Norm(layers[i].input_layernorm), _Norm(layers[i].post_attention_layernorm),
                                   _Mlp(layers[i].mlp), _fuse(mods)[0], [m.weight.shape[0] for m in mods])
        self.final = _Norm(model.model.norm)
        if self.draft:
            mtp = model.mtp
            self.mtp_attn = _Attn(mtp.layers[0])
            self.mtp_enorm, self.mtp_hnorm, self.mtp_norm = _Norm(mtp.enorm), _Norm(mtp.hnorm), _Norm(mtp.norm)

    def _zeros(self, *shape, dtype=None) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype if dtype is None else dtype, device=self.device)

    def _caches(self) -> None:
        """Every slot's attention caches, GDN states and draft-layer caches (the class docstring)."""
        arch, z = self.arch, self._zeros
        self.kv_heads, self.heads, self.head_dim = arch.num_kv_heads, arch.num_heads, arch.head_dim
        self.group = self.heads // self.kv_heads  # query heads a KV head serves
        per_layer = (self.slots, self.kv_heads, self.cache_len, self.head_dim)
        self.k_cache = z(len(self.attn_idx), *per_layer)
        self.v_cache = z(len(self.attn_idx), *per_layer)
        if self.lin_idx:
            g0 = self.model.layers[self.lin_idx[0]].linear_attn
            channels = 2 * g0.key_dim + g0.value_dim
            self.conv = z(len(self.lin_idx), self.slots, channels, g0.K - 1)
            self.rec = z(len(self.lin_idx), self.slots, g0.hv, g0.dk, g0.dv, dtype=torch.float32)
        if self.draft:
            self.mtp_k_cache, self.mtp_v_cache = z(*per_layer), z(*per_layer)
            # the draft's output row the next chain starts from (kept so a step that skipped
            # the chain can have it run later: `spec_on` after `step_on(chain=False)`)
            self.mtp_last = z(self.slots, 1, arch.hidden_size)

    def _slot_state(self, keep_rows: bool) -> None:
        """The per-slot buffers (the class docstring), the aranges the steps index with, a draft
        tree's tables and the RoPE tables."""
        z, slots, draft, branches, dev = self._zeros, self.slots, self.draft, self.branches, self.device
        self.pending = z(slots, dtype=torch.long)
        self.pos = z(slots, dtype=torch.long)
        # the next round's drafts, chained ahead: branch-major (branch b's chain at b·draft..)
        self.drafts = z(slots, max(draft, 1) * branches, dtype=torch.long)
        self.active = z(slots, dtype=torch.bool)
        self.temp = z(slots, dtype=torch.float32)
        self.out_tok = z(slots, dtype=torch.long)
        self.out_pred = z(slots, draft + 1, dtype=torch.long)
        self.out_n = z(slots, dtype=torch.long)
        self.final_rows = z(slots, self.arch.hidden_size) if keep_rows else None
        self.arange = torch.arange(self.cache_len + branches * draft + 1, device=dev)
        if branches > 1:
            self._tree = _tree_tables(branches, draft, dev)
        self.slot_arange = torch.arange(slots, device=dev)
        cos, sin = self.model.rope(torch.arange(self.cache_len, device=dev))  # the reference's per-call values
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos.to(self.dtype), torch.cat([-sin[:, :half], sin[:, half:]], -1).to(self.dtype)

    def _host_state(self, buckets: list[int] | None) -> None:
        """What the host keeps: each slot's length bound and whether it is active, the batch buckets,
        their views and graphs."""
        slots = self.slots
        self._bound = [0] * slots  # host-side upper bound of each slot's length (`length_bound`)
        self.bound_reads = 0  # times that bound was read back from the device (it is exact then)
        self._live = [False] * slots  # `active` as the host knows it
        self._step_graph = self._spec_graph = None
        self.buckets = sorted(set(buckets or [])) or [slots]
        if self.buckets[-1] != slots or self.buckets[0] < 1:
            raise CortiqError(f"decode engine: buckets {self.buckets} must lie in 1..{slots} and end at {slots}")
        self._views: dict[int, DecodeEngine] = {}
        self._bucket_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._stale = False  # a step skipped the chain: the drafts are not those of the current rows

    def staging_engine(self) -> DecodeEngine:
        """A one-slot eager engine of this one's model, draft and tree: `StagedPrefill`'s staging slot."""
        return DecodeEngine(self.model, slots=1, max_len=self.max_len, draft=self.draft, graphs=False,
                            branches=self.branches)

    def _capture_steps(self, bucketed: bool) -> None:
        """The step graphs: one per bucket and kind of step, or the full step (and round)."""
        if bucketed:
            self._capture_buckets()
            self._step_graph = self._bucket_graphs[("plain", self.slots, True, self.cache_len)]
            self._spec_graph = self._bucket_graphs.get(("spec", self.slots, self.draft, self.cache_len, True))
        else:
            self._step_graph = self._capture(self._plain)
            if self.draft:
                self._spec_graph = self._capture(self._spec)

    # ── public API ──
    @torch.no_grad()
    def prefill(self, slot: int, ids, temperature: float = 0.0) -> int:
        job = self.prefill_job(slot, ids, temperature)
        first = None
        while first is None:
            first = job.run()
        return first

    def prefill_job(self, slot: int, ids, temperature: float = 0.0, chunk: int = 0) -> PrefillJob:
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
        if self.draft:
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
        if not 0 <= slot < self.slots:
            raise CortiqError(f"decode engine: slot {slot} outside 0..{self.slots - 1}")
        if not ids:
            raise CortiqError("generate: empty prompt")
        if len(ids) + self.draft + 1 > self.max_len:
            raise CortiqError(f"decode engine: a prompt of {len(ids)} tokens leaves no room in max_len {self.max_len}")
        if temperature > 0 and not self.sampling:
            raise CortiqError("decode engine: temperature > 0 needs an engine built with sampling=True")
        if temperature < 0:
            raise CortiqError(f"temperature {temperature}: must be ≥ 0")

    def _prefill_rows(self, slots: list[int], prompts: list[list[int]], temperature: float) -> list[int]:
        """Prefill of plain (draft-less) slots from one padded forward (prefill_many)."""
        m, dev = self.model, self.device
        lens = [len(p) for p in prompts]
        n = max(lens)
        t = torch.tensor([p + [p[-1]] * (n - len(p)) for p in prompts], device=dev)  # [B, n]
        cache = m.new_cache()
        H, _ = m.forward_hidden(t, cache=cache)  # [B, n, H]
        idx = torch.tensor(slots, device=dev)
        lens_t = torch.tensor(lens, device=dev)
        for i in self.attn_idx:  # entries past a slot's length are stale and masked, as after any prefill
            st, j = cache.states[i], self.kind_index[i]
            self.k_cache[j, idx, :, :n] = st.k
            self.v_cache[j, idx, :, :n] = st.v
        for i in self.lin_idx:  # one length per group here: the state after its last token
            st, j = cache.states[i], self.kind_index[i]
            self.conv[j, idx] = st.conv
            self.rec[j, idx] = st.rec
        self.temp[idx] = temperature
        last = H[torch.arange(len(prompts), device=dev), lens_t - 1][:, None]  # [B, 1, H]
        if self.final_rows is not None:
            self.final_rows[idx] = last[:, 0]
        first = self._pick(last, self.temp[idx])[:, 0]
        self.pending[idx] = first
        self.pos[idx] = lens_t
        self.active[idx] = True
        for s, n_s in zip(slots, lens):
            self._bound[s], self._live[s] = n_s, True
        return first.tolist()

    def _installed(self, slot: int, n: int) -> None:
        """A slot prefilled with n prompt tokens (its caches and pending token written) becomes active."""
        self.pos[slot] = n
        self.active[slot] = True
        self._bound[slot], self._live[slot] = n, True

    def _at(self, key_len: int, fn, *args):
        """fn(*args) with the attention reading the first key_len cache positions."""
        self.key_len = key_len
        return fn(*args)

    def _kv_for(self, b: int, depth: int) -> int:
        """The shortest key length that holds every position a step over slots 0..b-1 verifying
        `depth` drafts writes or reads: the trunk's block (the pending token and the drafts)
        and the draft's chain after it, from the host's upper bound of each active slot's length."""
        hi = max((self._bound[s] for s in range(b) if self._live[s]), default=0)
        need = hi + self.branches * (depth + self.draft) + 1  # a tree's block and chain rows: branches times a chain's
        return next((n for n in self.kv_sizes if n >= need), self.cache_len)

    @torch.no_grad()
    def steps(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`n` plain steps with no host sync between them: -> LongTensor [n, slots] on the device
        (row i: `step`'s tokens of step i; written into `out` when given). The room check runs
        once for all n."""
        if out is None:
            out = torch.empty(n, self.slots, dtype=torch.long, device=self.device)
        self._room(n)
        self.key_len = self.cache_len
        for i in range(n):
            if self._step_graph is not None:
                self._step_graph.replay()
            else:
                self._plain()
            out[i].copy_(self.out_tok)
        self._advance(self.slots, n)
        return out

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise CortiqError(f"decode engine: slot {slot} outside 0..{self.slots - 1}")
        self.active[slot] = False
        self._live[slot] = False

    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if not self._live[s]]

    def lengths(self) -> list[int]:
        return self.pos.tolist()

    def length_bound(self, slot: int) -> int:
        """The host's upper bound of the slot's length (positions its trunk has seen), known without
        waiting for the device: each step raises it by what it may keep (a round: every draft
        kept); exact again whenever `bound_reads` grows (the engine read the lengths back)."""
        return self._bound[slot]

    def drop_unkept(self, slot: int, n: int) -> None:
        """Lower the slot's bound by the n positions a round counted as kept and did not keep (for a
        caller that has read the round's counts, and no read-back since)."""
        self._bound[slot] -= n

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        self._full_width(self._step_graph, self._plain, 1)
        return self.out_tok

    @torch.no_grad()
    def spec_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.draft:
            raise CortiqError("decode engine: spec_step needs an engine built with draft ≥ 1")
        self._full_width(self._spec_graph, self._spec, self.draft + 1)
        return self.out_pred, self.out_n

    # ── internals ──
    def _full_width(self, graph, run, need: int) -> None:
        """A step or round over every slot, reading the whole cache: its graph's replay, or `run`
        eagerly; each active slot may then hold `need` more positions."""
        self._room(need)
        self.key_len = self.cache_len
        if graph is not None:
            graph.replay()
        else:
            run()
        self._advance(self.slots, need)

    def _advance(self, b: int, need: int) -> None:
        """Raise the host's bound of each active slot below b by `need` positions."""
        for s in range(b):
            self._bound[s] += need * self._live[s]
    def _room(self, need: int) -> None:
        """Every active slot must fit `need` more positions (and the verify block) in max_len."""
        if not any(self._live[s] and self._bound[s] + need + self.draft > self.max_len for s in range(self.slots)):
            return
        self._bound = self.pos.tolist()  # the bound was loose (rejected drafts): read the exact lengths
        self.bound_reads += 1
        for s in range(self.slots):
            if self._live[s] and self._bound[s] + need + self.draft > self.max_len:
                raise CortiqError(f"decode engine: slot {s} is full ({self._bound[s]} of max_len {self.max_len} "
                                  "positions)")

    def _capture(self, fn, pool=None):
        """Warm up on a side stream (lazy cuBLAS/attention workspaces), then record one call.
        Done at construction, while every slot is inactive: the warm-up only writes masked rows."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool), torch.no_grad():
            fn()
        torch.cuda.synchronize(self.device)
        return g

    def _pick(self, h, temp=None):
        """h [S, T, H] -> next tokens [S, T]: argmax, or a Gumbel-max sample where temp [S] > 0."""
        head = self.head.to(h.dtype)
        if not self.sampling or temp is None:
            return self._twin(_pick_greedy, _dyn(h, 0, 1), head, self._pick_chunk)
        lf = F.linear(h, head).float()  # [S, T, V]
        e = torch.empty_like(lf).exponential_(generator=self.gen)
        t = temp[:, None, None]
        scores = torch.where(t > 0, lf / t.clamp_min(1e-6) - e.log(), lf)
        return _argmax(scores, self._pick_chunk)

    def _draft_head(self, draft_vocab) -> None:
        """The head the draft picks from: the whole head, or with `draft_vocab` (token ids [N]) only
        those rows, copied once (`d_head` [N, H]; `d_ids` maps a row back to its token). At a large
        vocabulary the head is most of what a draft step reads, and the trunk verifies every draft:
        a narrower head changes which drafts are guessed, never the output."""
        self.d_ids = self.d_head = None
        if draft_vocab is not None and self.draft:
            self.d_ids = torch.as_tensor(draft_vocab, dtype=torch.long, device=self.device)
            self.d_head = self.head.detach()[self.d_ids].contiguous()  # [N, H]
            self._d_chunk = _split(self.d_head.shape[0])

    def _draft_top(self, xh, k: int):
        """The draft's picks over its head: k = 1, the argmax of each row of xh [S', T, H] -> [S', T];
        k > 1, the top k of each slot's first row -> [S', k], best first."""
        head = self.head if self.d_ids is None else self.d_head
        c = self._pick_chunk if self.d_ids is None else self._d_chunk
        rows = self._twin(_pick_greedy, _dyn(xh, 0, 1), head.to(xh.dtype), c) if k == 1 else \
            self._twin(_pick_top, _dyn(xh[:, 0], 0), head.to(xh.dtype), k, c)
        return rows if self.d_ids is None else self.d_ids[rows]

    def _draft_pick(self, xh, j: int, base, slots):
        """Draft token of chain step j from the draft's row xh [S', 1, H] -> [S', 1]: greedy over the
        draft's head (`_draft_head`). (base [S']: position of the round's pending token, so step j
        guesses token base+1+j; slots [S']: whose rows. The tests override this to steer which
        drafts are right.)"""
        return self._draft_top(xh, 1)

    def _draft_first(self, xh, base, slots):
        """Chain step 0's drafts from the draft's row xh [S', 1, H] -> [S', branches]: the greedy one
        (`_draft_pick`), or with a tree the draft's top `branches`, best first."""
        if self.branches == 1:
            return self._draft_pick(xh, 0, base, slots)
        return self._draft_top(xh, self.branches)

    def _chain(self, out0, base):
        """The next round's drafts from the draft's row out0 [S, 1, H] at position base-1
        (chain step 0): steps 1..draft-1 each read the previous step's row and token. With a tree,
        each of the first guesses runs its own chain, the branches side by side as the rows
        of one block (`_tree_tables`): a step costs the launches of one chain's."""
        first = self._draft_first(out0, base, self.slot_arange)  # [S, branches]
        drafts = [first]
        xh, d = out0.expand(-1, self.branches, -1), first
        for j in range(1, self.draft):
            ctx = None if self.branches == 1 else self._ctx_tree(base, *self._tree.chain[j])
            xh = self._mtp(xh, d, base, ctx, off=j - 1)  # at positions base-1+j
            d = self._draft_pick(xh, j, base, self.slot_arange)  # [S, branches]
            drafts.append(d)
        self._by_slot(_put_drafts, self.drafts, self.active, drafts)

    def _plain(self, chain: bool = True):
        act = self.active
        tok = self.pending[:, None]  # [S, 1]
        H, gdn = self._trunk(tok, self.pos)
        if self.final_rows is not None:
            self.final_rows.copy_(H[:, -1])
        nxt = self._pick(H, self.temp)  # [S, 1]
        if gdn:
            self._commit(gdn, torch.zeros_like(self.pos))
        if self.draft:  # keep the draft ready: its row for the token just decided, then the chain
            out0 = self._mtp(H, nxt, self.pos)
            self.mtp_last.copy_(out0)
            if chain:
                self._chain(out0, self.pos + 1)
        self._by_slot(_plain_end, self.pending, self.pos, self.out_tok, act, nxt[:, 0])

    def _spec(self, depth: int | None = None, tree: bool = True):
        """One round, verifying the first `depth` drafts (default all `draft`). At its start a slot's
        trunk has seen positions 0..n-1 (n = pos), its pending token n and the drafts after it
        are decided, and the draft's rows up to n-1 read the trunk's own rows (rows past them,
        the chain's guesses)."""
        d = self.draft if depth is None else depth
        if self.branches > 1 and tree:
            return self._spec_tree(d)
        # (a chain round: on a tree engine, branch 0's drafts, the greedy chain, lead the row)
        pos = self.pos
        block = torch.cat([self.pending[:, None], self.drafts[:, :d]], 1)  # [S, d+1] at positions n..n+d
        Hv, gdn = self._trunk(block, pos)
        pred = self._pick(Hv)  # [S, d+1]: the trunk's token after each block token
        a = self._by_slot(_kept, block, pred)  # [S] drafts accepted
        self._commit(gdn, a)
        self._verified(Hv, pred, a)

    def _spec_tree(self, d: int):
        """`_spec` over a draft tree: one trunk pass verifies every branch's first d drafts
        (`_tree_tables`), the branch keeping the most wins (the first of equals: branch 0, the
        greedy chain, so a tree never keeps fewer than the chain), its rows' keys and values
        move to follow the pending token, and the round ends as a chain's would on that branch."""
        S, pos, ar = self.slots, self.pos, self.slot_arange
        dep, anc, paths = self._tree.verify[d]
        T = anc.shape[0]
        drafts = self.drafts.view(S, self.branches, self.draft)[:, :, :d].reshape(S, -1)  # each branch's first d
        block = torch.cat([self.pending[:, None], drafts], 1)
        Hv, _ = self._trunk(block, pos, self._ctx_tree(pos, self.arange[:T], dep, anc))  # [S, T, H]
        pred = self._pick(Hv)  # [S, T]
        # (compiled, one or two fused kernels where eager launches a dozen)
        path, pred_k, kept_k, src, dst = self._twin(_tree_choice, _dyn(block, 0), _dyn(pred, 0), paths, _dyn(pos, 0),
                                                    self.arange[: d + 1], self.cache_len - 1)
        self._relocate(src, dst)  # the kept branch's rows then lie where a chain's would
        self._verified(Hv[ar[:, None], path], pred_k, kept_k)

    def _relocate(self, src, dst):
        """Keys and values at cache positions src [S, d+1] to dst [S, d+1], every attention
        layer at once."""
        nA, S, Hkv, _, D = self.k_cache.shape
        for cache in (self.k_cache, self.v_cache):
            ix = [t[None, :, None, :, None].expand(nA, S, Hkv, t.shape[1], D) for t in (src, dst)]
            cache.scatter_(3, ix[1], cache.gather(3, ix[0]))

    def _verified(self, Hv, pred, a):
        """The end of a round: Hv [S, d+1, H] and pred [S, d+1], the trunk's rows and tokens
        along the verified block (the kept branch's, for a tree), a [S] the drafts kept."""
        act, pos = self.active, self.pos
        # the draft's rows n..n+d from the trunk's rows and tokens: rows ≤ n+a are the accepted
        # ones, row n+a is the next round's chain step 0 (rows past it are overwritten before use)
        out = self._mtp(Hv, pred, pos)
        row = out[self.slot_arange, a][:, None]
        self._chain(row, pos + a + 1)
        self._by_slot(_round_end, self.pending, pos, self.out_pred, self.out_n, self.mtp_last, act, pred, a, row)

    # ── steps over the first b slots (bucketed batch sizes) ──
    # Buffers whose first (or, for the layer-stacked caches, second) dimension is the slot: a
    # bucket's view slices them, so its step reads and writes the same storage for slots < b.
    _SLOT_DIM0 = ("pending", "pos", "drafts", "active", "temp", "out_tok", "out_pred", "out_n", "mtp_k_cache",
                  "mtp_v_cache", "mtp_last", "final_rows")
    _SLOT_DIM1 = ("k_cache", "v_cache", "conv", "rec")

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding slots 0..rows-1."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise CortiqError(f"decode engine: {rows} rows, the largest bucket is {self.buckets[-1]}")

    def _view(self, b: int) -> DecodeEngine:
        """This engine restricted to slots 0..b-1: the same weights and storage, `slots` = b."""
        if b == self.slots:
            return self
        v = self._views.get(b)
        if v is None:
            import copy

            v = copy.copy(self)
            v.slots, v.slot_arange, v._views = b, self.slot_arange[:b], {}
            for name in self._SLOT_DIM0:
                if getattr(self, name, None) is not None:
                    setattr(v, name, getattr(self, name)[:b])
            for name in self._SLOT_DIM1:
                if getattr(self, name, None) is not None:
                    setattr(v, name, getattr(self, name)[:, :b])
            self._views[b] = v
        return v

    def _capture_buckets(self):
        """One graph per bucket and kind of step, sharing one memory pool (they replay one at a
        time and keep nothing between replays but the engine's own buffers)."""
        pool = torch.cuda.graph_pool_handle()
        graphs = self._bucket_graphs
        for b in reversed(self.buckets):
            v = self._view(b)
            for n in reversed(self.kv_sizes):  # (the key length is fixed in each graph)
                graphs[("plain", b, True, n)] = self._capture(lambda v=v, n=n: v._at(n, v._plain), pool)
                if self.draft:
                    graphs[("plain", b, False, n)] = self._capture(lambda v=v, n=n: v._at(n, v._plain, False), pool)
                    # the chain a round runs first after plain steps that skipped it (--spec-auto):
                    # eager, its draft-1 draft passes were launches on the host, and made those
                    # rounds several plain steps long (bench/DECODE.md, "The engine's design notes")
                    graphs[("chain", b, n)] = self._capture(lambda v=v, n=n: v._at(n, v._chain, v.mtp_last, v.pos),
                                                            pool)
                    for d in range(1, self.draft + 1):
                        for t in {True, self.branches == 1}:  # a tree engine: its tree's rounds and the chain's
                            graphs[("spec", b, d, n, t)] = self._capture(
                                lambda v=v, n=n, d=d, t=t: v._at(n, v._spec, d, t), pool)

    def _check_rows(self, b: int) -> None:
        if b not in self.buckets:
            raise CortiqError(f"decode engine: {b} rows is not a bucket ({self.buckets})")
        if any(self._live[b:]):
            raise CortiqError(f"decode engine: slot {self._live.index(True, b)} is active outside the first {b}")

    @torch.no_grad()
    def step_on(self, b: int, chain: bool = True) -> torch.Tensor:
        """`step()` over slots 0..b-1 (b a bucket; no active slot past them); rows past b of
        the output are left as they were. chain=False skips the draft's chain (the
        draft-layer row is still written): a plain step at plain cost, and the next
        `spec_on` chains first."""
        self._check_rows(b)
        self._room(1)
        key_len = self._kv_for(b, 0)
        g = self._bucket_graphs.get(("plain", b, bool(chain) or not self.draft, key_len))
        if g is not None:
            g.replay()
        else:
            v = self._view(b)
            v._at(key_len, v._plain, chain)
        if self.draft:
            self._stale = not chain
        self._advance(b, 1)
        return self.out_tok

    def tree_round(self, tree: bool | None) -> bool:
        """Whether a round asked for with `tree` (None: the engine's own kind) verifies the tree."""
        return self.branches > 1 if tree is None else bool(tree) and self.branches > 1

    @torch.no_grad()
    def spec_on(self, b: int, depth: int | None = None, tree: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`spec_step()` over slots 0..b-1, verifying `depth` drafts (1..draft, default draft), on the
        draft tree (`tree`, default: when the engine has one) or on its greedy chain:
        pred[s, :n[s]] with n ≤ depth+1 (columns past depth+1 are stale)."""
        d = self.draft if depth is None else depth
        t = self.tree_round(tree)
        if not 1 <= d <= self.draft:
            raise CortiqError(f"decode engine: depth {d} outside 1..{self.draft}")
        self._check_rows(b)
        self._room(d + 1)
        v = self._view(b)
        key_len = self._kv_for(b, d)
        if self._stale:  # the steps since the last chain left the drafts behind: chain from the kept rows
            gc = self._bucket_graphs.get(("chain", b, key_len))
            if gc is not None:
                gc.replay()
            else:
                v._at(key_len, v._chain, v.mtp_last, v.pos)
            self._stale = False
        g = self._bucket_graphs.get(("spec", b, d, key_len, t or self.branches == 1))
        if g is not None:
            g.replay()
        else:
            v._at(key_len, v._spec, d, t)
        self._advance(b, d + 1)
        return self.out_pred, self.out_n

    def key_length(self, b: int, depth: int = 0) -> int:
        """The key length a step over slots 0..b-1 verifying `depth` drafts (0: a plain step) reads
        now: which of its graphs it replays, from the host's bound of the slots' lengths."""
        return self._kv_for(b, depth)

    @torch.no_grad()
    def time_steps(self, reps: int = 3) -> dict:
        """Seconds each kind of bucketed step takes at every batch bucket and key length, the median
        of `reps` runs (on CUDA its captured graph's replay between two events, after one replay
        untimed; else the eager call): {(b, key length, depth, tree): seconds}, depth 0 the plain
        step that skips the draft's chain (a server that chooses per step runs that one). Only
        before any slot is active: then every row a step writes is masked, as in the graphs'
        warm-ups, and nothing a request will read is touched."""
        if any(self._live):
            raise CortiqError(f"decode engine: steps are timed before any slot is active (slot "
                              f"{self._live.index(True)} is)")
        kinds = [(0, False)] + [(d, t) for d in range(1, self.draft + 1) for t in sorted({False, self.branches > 1})]
        out = {}
        for b in self.buckets:
            v = self._view(b)
            for n in self.kv_sizes:
                for d, t in kinds:
                    if d:
                        g, run = self._bucket_graphs.get(("spec", b, d, n, t or self.branches == 1)), (
                            lambda v=v, n=n, d=d, t=t: v._at(n, v._spec, d, t))
                    else:
                        g, run = self._bucket_graphs.get(("plain", b, not self.draft, n)), (
                            lambda v=v, n=n: v._at(n, v._plain, False))
                    if g is not None:
                        run = g.replay
                        run()
                    out[(b, n, d, t)] = sorted(self._clock(run) for _ in range(reps))[(reps - 1) // 2]
        return out

    def _clock(self, run) -> float:
        """Seconds `run()` takes: on CUDA its device time between two events, else the call's."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        run()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / 1000


def _check_args(model, slots: int, max_len: int, draft: int, branches: int, draft_vocab=None) -> None:
    """`DecodeEngine`'s arguments, refused with a message that says why."""
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
    if branches > 1 and LINEAR in model.arch.layer_types:
        raise CortiqError("decode engine: a draft tree (branches > 1) runs attention-only models (a Gated "
                          "DeltaNet state cannot hold several branches)")
    if draft_vocab is not None:
        _check_draft_vocab(draft_vocab, model.head_weight.shape[0], branches)
