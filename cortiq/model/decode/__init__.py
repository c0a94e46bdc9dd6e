"""A static-cache decoding engine: every buffer preallocated, one step a fixed-shape function,
captured as a CUDA graph on CUDA (eager elsewhere). The reference loop
(`cortiq.model.generate.generate`) grows its caches with `torch.cat` and launches every kernel
from Python; here a token is one `CUDAGraph.replay()` over static buffers, and nothing waits for
the host except reading the new tokens to stream them. What it measured, and why it is built
so: bench/DECODE.md (its tables, and "The engine's design notes").

API (the contract a server builds on; slots are independent requests)
---------------------------------------------------------------------

    eng = DecodeEngine(model, slots=8, max_len=2048, draft=0, sampling=False, graphs=None,
                       buckets=None, kv_buckets=None, branches=1, keep_rows=False, draft_vocab=None)
        draft: tokens the MTP block drafts a round (0: plain steps only); branches: a draft tree
        of that many first guesses, each chained to `draft` (attention-only models);
        draft_vocab: token ids [N] the draft picks among (its head narrowed to their rows; None:
        every token). The trunk verifies every draft, so it changes the drafts, not the output.
        buckets: batch sizes b the bucketed steps (`step_on(b)`, `spec_on(b, depth)`) run slots
        0..b-1 at; kv_buckets: key lengths those steps' attention may read the caches up to
        (each rounded up to a multiple of 16; the whole cache is always one). A bucketed step
        attends over the shortest that holds every position its active slots write or read,
        found from the host's bound of their lengths; one CUDA graph per batch bucket, key
        length and kind of step. The full-width `step`/`spec_step` read the whole cache.
        keep_rows: keep `eng.final_rows` [slots, hidden], the trunk's final row each slot's
        last next-token choice read (a server computes its own logits from it).

    first = eng.prefill(slot, ids, temperature=0.0)   # -> int, the slot's first new token
        Runs the prompt `ids` (a list of ints) through the model (the reference
        forward) and writes that slot's caches; the slot becomes active. Other
        slots keep their state: prefill between steps (continuous batching).
        The returned token is "pending": decided, not yet fed to the model.
    job = eng.prefill_job(slot, ids, temperature=0.0, chunk=0)   # `PrefillJob`
        The same a chunk per `job.run()` (None until the last, which returns the first token).
    firsts = eng.prefill_many(slots, prompts, temperature=0.0)   # -> list[int]
        `prefill` of several slots in one forward, prompts of different lengths.
    toks = eng.step()                # -> LongTensor [slots] on the model's device
        Feeds every active slot's pending token and decides the next one (one
        token per active slot). -1 for inactive slots. The tensor is the
        engine's output buffer: `.tolist()` (the one host sync) or clone it
        before the next step.
    block = eng.steps(n)             # -> LongTensor [n, slots] on the device: n steps, no host sync between
    pred, n = eng.spec_step()        # -> LongTensor [slots, draft+1], LongTensor [slots]
        One speculative round (an engine with draft ≥ 1, greedy): the MTP block
        drafts `draft` tokens as a chain, the trunk verifies pending + drafts in
        one forward, and slot s emits the n[s] tokens pred[s, :n[s]]
        (1 ≤ n ≤ draft+1; 0 for inactive slots): the accepted drafts and the
        trunk's own next token, which becomes the new pending token. Greedy
        speculative output equals `step()`'s greedy output token for token
        (exactly in f32; in bf16 see below). Same buffer rule as `step`.
    toks = eng.step_on(b, chain=True);  pred, n = eng.spec_on(b, depth=None, tree=None)
        `step` and `spec_step` over slots 0..b-1 (b a bucket; no active slot past them): a
        round of `depth` drafts (1..draft), on the draft tree or its greedy chain.
    eng.release(slot)                # the slot stops advancing; prefill reuses it
    eng.free_slots() -> list[int];  eng.lengths() -> list[int] (tokens each slot's trunk has seen; syncs)
    eng.length_bound(slot) -> int    # the host's upper bound of that length, no sync
    StagedPrefill(eng).job(slot, ids, chunk).run()   # a prompt by captured chunk graphs (attention only)

  `step()` and `spec_step()` may be mixed on a draft engine (its `step` also
  chains the next round's drafts: `draft` draft-layer passes). Slots share one temperature rule: 0 is
  greedy; > 0 samples softmax(logits / T) (engine built with sampling=True; Gumbel-max
  on device). `spec_step` always verifies greedily, whatever the slot's
  temperature. A slot needs room for its prompt plus the tokens it will
  decode plus draft+1 (`max_len`); a step that would overrun raises
  CortiqError naming the slot. Inactive slots compute masked garbage in their
  own rows only (static shapes); prefill overwrites everything of a slot that
  is read.

  Why bf16 can differ: the verify forward multiplies draft+1 rows at once where
  `step` multiplies one; in bf16 the matrix kernels round those products
  differently, and where the top two logits are within a rounding step of each
  other the argmax can flip. From that token on both outputs are valid greedy
  continuations of slightly different numbers. In f32 the rounding is far below
  any real logit gap, and the outputs agree.

Layout
------
- engine.py: `DecodeEngine` (its state, the steps and rounds, graph capture and bucket
  views), `auto_branches`, `cache_len`;
- forward.py: the model's forward over the engine's buffers (`StaticForward`, its base class),
  eager (the reference the tests compare with) or through the compiled layer halves;
- layers.py: each layer's weights fused for a step, the pure functions a step is made of, and
  their compiled twins (`_fused_fns`);
- picks.py: the head's argmax and top k in two stages;
- speculative.py: the draft tree's tables, a round's verdict, the in-place ends of a step or round;
- prefill.py: `PrefillJob` (the chunked reference prefill), `StagedPrefill` and `StagedJob`.

The engine's buffers:
- attention KV: `k_cache`, `v_cache` [attn_layers, slots, kv_heads, cache_len, head_dim] in the
  compute dtype (`cache_len`: max_len, 16-aligned, and a tree's rows past it); a slot's
  entries past its length are stale and masked;
- Gated DeltaNet: conv inputs `conv` [lin_layers, slots, C, K-1] and recurrent state `rec`
  [lin_layers, slots, Hv, Dk, Dv] f32;
- MTP draft layer: its own `mtp_k_cache`, `mtp_v_cache` [slots, kv_heads, cache_len, head_dim];
- per slot on the device: `pending` token, trunk length `pos` (= position of the pending
  token), the next round's `drafts`, `active` flag, `temp`erature.
"""

from .engine import DecodeEngine, auto_branches, cache_len
from .prefill import PrefillJob, StagedJob, StagedPrefill

__all__ = ["DecodeEngine", "PrefillJob", "StagedJob", "StagedPrefill", "auto_branches", "cache_len"]
