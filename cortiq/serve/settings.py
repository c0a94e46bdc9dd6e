"""Settings of `cortiq serve` (the command's options are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from ..devices import COMPUTE
from ..errors import CortiqError
from ..settings_meta import check, setting


@dataclass
class ServeSettings:
    """The server: where it listens, how it decodes, what it accepts."""

    # ── where it listens ──
    host: str = setting("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = setting(8000, "TCP port (0: a free one, printed on start)", lo=0, hi=65535)
    model_name: str = setting("", "model id served", show="the file name without .cmf")

    # ── decoding ──
    #: sequences decoded together; more waiting requests queue for a free slot
    max_batch: int = setting(16, "requests decoded together in one batch", lo=1)
    max_len: int = setting(0, "context per request in tokens (0: the model's, at most 4096)", lo=0)
    #: greedy requests draft with the MTP block and verify in one forward (same tokens, fewer forwards)
    speculative: bool = setting(False, "speculative decoding with the model's MTP draft (greedy requests)")
    #: tokens the MTP chain drafts per round: 3, the depth the serving tables measure (bench/DECODE.md,
    #: "The final serving table, one call"; what a round keeps and costs: "Reading the figures")
    draft: int = setting(3, "--speculative: tokens drafted per round", lo=1, hi=16,
                         why="a round's drafts run one after another, and one is kept only where every draft "
                             "before it was: a deeper round costs more than it can keep")
    #: choose each step between a plain step and a round of 1..draft drafts (chain or tree), from
    #: the step times taken at start-up and in service and each request's recent acceptance; a
    #: round runs only where it is expected to decide more tokens a second than a plain step
    #: (`cortiq.serve.policy`), so a large batch or a draft that is rarely right runs plain steps;
    #: off: every all-greedy step is a round of `draft` (bench/DECODE.md, "`--spec-auto` by default")
    spec_auto: bool = setting(True, "--speculative: choose plain or a depth 1..draft each step (measured)")
    #: a draft tree: the draft's top guesses for a round's first token, each continued to a chain
    #: of `draft`, all verified in one forward (the branch keeping most wins; 1: the chain alone).
    #: A round then verifies branches·draft + 1 rows: nearly free while the step is bound by its
    #: launches (few clients), not when many clients fill the batch (bench/DECODE.md); with
    #: spec_auto each step chooses between plain, chain and tree rounds from their measured times.
    #: 0 (auto): `auto_branches` (4 on CUDA for attention-only models, where a tree of 4 served more
    #: than the chain in nearly every row of bench/DECODE.md, "The final serving table, one call")
    #: with the decode engine, else 1
    draft_branches: int = setting(0, "--speculative: verify the draft's top N first guesses, each chained, "
                                           "in one forward (a tree; 0: 4 on CUDA for attention-only models, "
                                           "else 1)", lo=0, hi=16,
                                  why="a round verifies branches x draft + 1 rows a request, and the tree's "
                                      "masks grow with their square: more first guesses cost more than they keep")
    #: the draft guesses among the N tokens the trunk chose most often on the draft's training text
    #: (the ranking `mtp heal` stores, cortiq.mtp.vocab): at a large vocabulary the output head is
    #: most of what a draft step reads, and the trunk verifies every draft, so the answers do not
    #: change; 0 (auto): 32768 where the vocabulary has more than 65536 tokens and the model stores
    #: the ranking, else every token; N at or past the vocabulary: every token
    draft_vocab: int = setting(0, "--speculative: the draft guesses among the N tokens its trunk chose most on "
                                  "its training text (0: 32768 for vocabularies over 65536 with mtp heal's "
                                  "ranking, else all)", lo=0)
    #: prompt tokens run per scheduler turn (a long prompt takes several turns, between the
    #: running requests' steps, so they do not stall); 0 = a whole prompt at once
    prefill_chunk: int = setting(256, "prompt tokens prefilled per step (0: whole prompts)", lo=0)
    #: "decode" (= auto): static buffers, one batched forward, CUDA graphs on CUDA; "loop": the
    #: model's own cache and one forward per slot (the plain reference)
    engine: str = setting("auto", "decoding engine (auto: decode)", choices=("auto", "decode", "loop"))
    device: str = setting("auto", "device: auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = setting("auto", "compute dtype (auto: bf16 on CUDA, f32 else)", choices=COMPUTE)

    # ── profiling ──
    #: at shutdown, write where the decode loop's time went (JSON: host seconds by part, device
    #: seconds of the steps, steps, tokens) to this path; "" = none
    profile: str = setting("", "write the decode loop's time breakdown here at shutdown (JSON)")
    #: with `profile`, also record this many steps under torch.profiler (the table of the top
    #: operators goes into the JSON and a Chrome trace next to it); 0 = none
    profile_steps: int = setting(0, "--profile: steps recorded by torch.profiler too", lo=0)

    # ── limits ──
    #: largest request body accepted (413 above)
    max_body_kb: int = setting(1024, "largest request body in KiB", lo=1)
    #: a prompt that fits the context averages far fewer characters a token than 32 (English text
    #: about 4), and tokenizing costs time by the character: a longer prompt is refused unread
    max_prompt_chars: int = setting(0, "longest prompt in characters; longer ones get a 400 before they are "
                                       "tokenized (0: 32 per token of the context)", lo=0,
                                    show="32 x the context")
    #: requests that may wait for a slot (429 above)
    max_waiting: int = setting(256, "requests that may wait for a free slot", lo=1)
    shutdown_timeout: float = setting(5.0, "seconds running requests get after SIGTERM", lo=0)

    def branches(self, arch, dev) -> int:
        """The draft tree's branches for a model of `arch` served on device `dev`: 1 without
        --speculative, draft_branches where set, else (0) `auto_branches`' (the loop engine: 1)."""
        from ..model.decode import auto_branches

        if not self.speculative:
            return 1
        if self.draft_branches:
            return self.draft_branches
        return auto_branches(arch, dev) if self.engine != "loop" else 1

    def prompt_chars(self, context: int) -> int:
        """The longest prompt in characters taken for a context of `context` tokens."""
        return self.max_prompt_chars or 32 * context

    def __post_init__(self):
        check(self, "serve settings")
        if self.max_len == 1:
            raise CortiqError(f"serve settings: max_len {self.max_len} leaves no room for an answer (0 or >= 2)")
