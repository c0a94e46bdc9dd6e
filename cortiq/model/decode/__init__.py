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
from .engine import DecodeEngine, auto_branches, cache_len
from .prefill import PrefillJob, StagedJob, StagedPrefill

__all__ = ["DecodeEngine", "PrefillJob", "StagedJob", "StagedPrefill", "auto_branches", "cache_len"]
