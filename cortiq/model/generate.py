"""Decoding with a KV cache (and the GDN layers' conv + recurrent state):
greedy or temperature sampling, and speculative decoding with the model's
MTP draft verified greedily (its output is the greedy output, token for token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..arch import LINEAR
from ..errors import CortiqError


@dataclass
class GenResult:
    tokens: list[int]  # the new tokens (prompt excluded)
    seconds: float  # decoding time after the prompt's forward
    prefill_seconds: float
    rounds: int = 0  # speculative: verify rounds
    accepted: int = 0  # speculative: drafts accepted in all rounds
    drafted: int = 0
    per_round: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """logits [V] -> a token id: argmax at temperature 0, else a sample of softmax(logits/T)."""
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits.float() / temperature, -1)
    return int(torch.multinomial(p, 1, generator=gen))


def _device(model) -> torch.device:
    return model.model.embed_tokens.weight.device


@torch.no_grad()
def generate(model, prompt: Sequence[int], max_new: int = 64, temperature: float = 0.0,
             eos_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
             seed: int = 0) -> GenResult:
    """Plain decoding: one forward over the prompt, then one token at a time."""
    if not prompt:
        raise CortiqError("generate: empty prompt")
    dev = _device(model)
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    cache = model.new_cache()
    t0 = time.perf_counter()
    h, _ = model.forward_hidden(torch.tensor([list(prompt)], device=dev), cache=cache)
    tok = _pick(model.logits(h[0, -1]), temperature, gen)
    t1 = time.perf_counter()
    out = []
    eos = set(eos_ids)
    while True:
        out.append(tok)
        if on_token:
            on_token(tok)
        if tok in eos or len(out) >= max_new:
            break
        h, _ = model.forward_hidden(torch.tensor([[tok]], device=dev), cache=cache)
        tok = _pick(model.logits(h[0, -1]), temperature, gen)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return GenResult(out, time.perf_counter() - t1, t1 - t0)


def _draft_chain(model, h_prev: torch.Tensor, tok: int, pos: int, depth: int, mtp_state, dev) -> list[int]:
    """The MTP block's greedy drafts from (h_prev, tok), a chain of `depth` steps (step j reads
    step j-1's hidden row) at positions pos, pos+1, ..."""
    drafts: list[int] = []
    xh, xt = h_prev, tok
    for j in range(depth):
        d_h = model.mtp_forward(xh, torch.tensor([[xt]], device=dev), pos + j, mtp_state)
        xt = int(model.logits(d_h[0, -1]).argmax())
        drafts.append(xt)
        xh = d_h
    return drafts


def _verify(model, cache, tok: int, drafts: list[int], n: int, has_gdn: bool, dev):
    """The trunk over [tok, d_0, ..., d_{k-1}] at positions n..n+k in one forward, and the
    drafts it accepts (a: those equal to its own next token), the cache rolled back to positions
    0..n+a. -> (its hidden rows [1, ≥a+1, H], its token after each block row, a, the block)."""
    snap = cache.snapshot()
    block = torch.tensor([[tok] + drafts], device=dev)
    Hv, _ = model.forward_hidden(block, cache=cache)  # [1, k+1, H]
    pred = model.logits(Hv[0]).argmax(-1).tolist()  # pred[i]: the trunk's token after block[i]
    a = 0
    while a < len(drafts) and drafts[a] == pred[a]:
        a += 1
    if a < len(drafts):  # roll the trunk back to positions 0..n+a
        if has_gdn:  # a recurrent state cannot be cut: re-run the accepted tokens from the snapshot
            cache.restore(snap)
            Hv, _ = model.forward_hidden(block[:, : a + 1], cache=cache)
        else:  # attention caches are cut: keep the block's first a+1 keys and values
            for s in cache.states:
                s.restore(n + a + 1)
            cache.seen = n + a + 1
    return Hv, pred, a, block


@torch.no_grad()
def generate_speculative(model, prompt: Sequence[int], max_new: int = 64, draft: int = 1,
                         eos_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None) -> GenResult:
    """Greedy decoding with the MTP block drafting `draft` tokens a round (a
    chain: step j reads step j-1's hidden row) and the trunk verifying them in
    one forward. Accepted drafts plus the trunk's own next token are emitted
    each round; the output equals `generate(..., temperature=0)`.

    Invariant at the start of a round: the trunk has seen positions 0..n-1,
    `h_prev` is its final hidden row n-1 and `tok` (token n) is decided but not
    yet fed; the MTP block has seen rows 0..n-2 (row p reads h_p and token p+1)."""
    if model.mtp is None:
        raise CortiqError("speculative decoding needs an MTP draft block (model.mtp.*); this model has none")
    if not prompt or draft < 1:
        raise CortiqError("generate: empty prompt" if not prompt else "speculative decoding drafts at least 1 token")
    dev = _device(model)
    has_gdn = LINEAR in model.arch.layer_types
    cache = model.new_cache()
    mtp_state = cache.extra[0]
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt)], device=dev)
    H, _ = model.forward_hidden(ids, cache=cache)  # [1, n, H]
    n = ids.shape[1]
    if n > 1:  # MTP rows 0..n-2 of the prompt
        model.mtp_forward(H[:, :-1], ids[:, 1:], 0, mtp_state)
    h_prev = H[:, -1:]  # [1, 1, H]
    tok = int(model.logits(h_prev[0, -1]).argmax())
    t1 = time.perf_counter()
    out: list[int] = []
    eos = set(eos_ids)
    res = GenResult(out, 0.0, t1 - t0)

    def emit(t: int) -> bool:
        out.append(t)
        if on_token:
            on_token(t)
        return t in eos or len(out) >= max_new

    while True:
        mtp_snap = mtp_state.snapshot()
        drafts = _draft_chain(model, h_prev, tok, n - 1, draft, mtp_state, dev)
        Hv, pred, a, block = _verify(model, cache, tok, drafts, n, has_gdn, dev)
        res.rounds += 1
        res.drafted += draft
        res.accepted += a
        res.per_round.append(a)
        # the MTP block's rows n-1..n-1+a from the trunk's own hidden rows
        mtp_state.restore(mtp_snap)
        model.mtp_forward(torch.cat([h_prev, Hv[:, :a]], 1), block[:, : a + 1], n - 1, mtp_state)
        if any(emit(t) for t in [tok] + drafts[:a]):  # stops at the first token that ends the output
            break
        n += a + 1
        h_prev = Hv[:, a : a + 1]
        tok = pred[a]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    res.seconds = time.perf_counter() - t1
    return res


def _room(prompts, max_new: int, draft: int) -> int:
    return max(len(p) for p in prompts) + max_new + 2 * draft + 2


@torch.no_grad()
def decode(model, prompts: Sequence[Sequence[int]], max_new: int = 64, draft: int = 0, temperature: float = 0.0,
           eos_ids: Sequence[int] = (), on_token: Callable[[int, int], None] | None = None, seed: int = 0,
           graphs: bool | None = None, engine=None, branches: int = 1, draft_vocab=None) -> list[GenResult]:
    """Decode every prompt at once on the static-cache engine (cortiq.model.decode),
    one slot each: plain steps, or speculative rounds with `draft` ≥ 1 (greedy; with
    `branches` > 1 a draft tree of that many first guesses, each chained; `draft_vocab`: the
    token ids the draft guesses among, as the engine's).
    A slot stops at an EOS id or after `max_new` tokens and is released while
    the others go on. `on_token(slot, token)` streams. Greedy output equals
    `generate`'s for each prompt alone (exactly in f32), speculative or not.
    `engine`: reuse a built one (its slots ≥ len(prompts), its draft = `draft`)."""
    from .decode import DecodeEngine

    if not prompts or any(not p for p in prompts):
        raise CortiqError("generate: empty prompt")
    if draft and temperature > 0:
        raise CortiqError("speculative decoding verifies greedily: use temperature 0")
    if max_new < 1:
        raise CortiqError(f"generate: max_new {max_new}, need at least 1")
    eng = engine or DecodeEngine(model, slots=len(prompts), max_len=_room(prompts, max_new, draft), draft=draft,
                                 sampling=temperature > 0, graphs=graphs, seed=seed, branches=branches,
                                 draft_vocab=draft_vocab)
    if eng.slots < len(prompts) or eng.draft != draft:
        raise CortiqError(f"decode: the engine has {eng.slots} slots and draft {eng.draft}; asked {len(prompts)} and "
                          f"{draft}")
    eos = set(eos_ids)
    res = [GenResult([], 0.0, 0.0) for _ in prompts]
    live = set()
    t0 = time.perf_counter()
    for s, p in enumerate(prompts):
        first = eng.prefill(s, p, temperature)
        res[s].tokens.append(first)
        if on_token:
            on_token(s, first)
        if first in eos or max_new <= 1:
            eng.release(s)
        else:
            live.add(s)
    t1 = time.perf_counter()
    for r in res:
        r.prefill_seconds = t1 - t0
    while live:
        if draft:
            pred, n = eng.spec_step()
            rows = torch.cat([pred, n[:, None]], 1).tolist()  # the one host sync of the round
        else:
            rows = [[t, 1] for t in eng.step().tolist()]
        for s in sorted(live):
            r, row = res[s], rows[s]
            if draft:
                r.rounds += 1
                r.drafted += draft
                r.accepted += row[-1] - 1
                r.per_round.append(row[-1] - 1)
            for t in row[: row[-1]]:
                r.tokens.append(t)
                if on_token:
                    on_token(s, t)
                if t in eos or len(r.tokens) >= max_new:
                    eng.release(s)
                    live.discard(s)
                    break
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    t2 = time.perf_counter()
    for r in res:
        r.seconds = t2 - t1
    if engine is not None:
        for s in range(len(prompts)):
            eng.release(s)
    return res


def generate_fast(model, prompt: Sequence[int], max_new: int = 64, temperature: float = 0.0, draft: int = 0,
                  eos_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None, seed: int = 0,
                  graphs: bool | None = None, engine=None, branches: int = 1, draft_vocab=None) -> GenResult:
    """`generate` / `generate_speculative` on the static-cache engine (one slot; `branches` > 1: a
    draft tree of that many first guesses, each chained; `draft_vocab` as `decode`'s)."""
    cb = (lambda s, t: on_token(t)) if on_token else None
    return decode(model, [prompt], max_new, draft, temperature, eos_ids, cb, seed, graphs, engine, branches,
                  draft_vocab)[0]
