"""`cortiq generate MODEL "prompt"`: decode with a KV cache, streaming to the terminal."""

from __future__ import annotations

from dataclasses import dataclass

from ..devices import COMPUTE
from ..errors import CortiqError
from ..settings_meta import add_arguments as add_arguments_of
from ..settings_meta import check, setting

HELP = "generate text from a prompt (static KV cache, CUDA graphs; --speculative uses the MTP draft)"
DESCRIPTION = (
    "Decode from a prompt on the static-cache engine (preallocated KV cache and Gated DeltaNet state; each step "
    "one captured CUDA graph on CUDA), streaming tokens to stdout. --reference uses the plain loop instead "
    "(growing cache, eager; the same greedy tokens in f32). --speculative drafts with the model's MTP block and "
    "verifies greedily; it then also decodes plainly and reports drafts accepted per round, tokens/s against "
    "plain decoding, and how many tokens differ. In f32 none do (a difference is an error, exit 1). In bf16/f16 "
    "a few can: the verify step multiplies draft+1 rows at once where a plain step multiplies one, the matrix "
    "kernels round those products differently, and where the top two logits lie within a rounding step of each "
    "other the argmax flips; from that token on the two outputs are greedy continuations of slightly different "
    "numbers. The report then counts the differing tokens and where they start (exit 0)."
)
ORDER = 41


@dataclass
class GenerateSettings:
    """How the text is decoded."""

    #: a cap, not a target: decoding also ends at an EOS token
    max_new: int = setting(64, "tokens to generate at most", lo=1)
    #: 0 decodes greedily, the only mode speculative decoding verifies exactly
    temperature: float = setting(0.0, "sampling temperature (0: greedy)", lo=0)
    #: a fixed seed makes a sampled answer repeatable
    seed: int = setting(0, "sampling seed")
    #: an instruct model answers a bare prompt worse than a user turn in its own template
    chat: bool = setting(False, "wrap the prompt in the model's chat template as a user turn")
    #: the plain decode beside it is what the speed-up and the token-for-token check are measured against
    speculative: bool = setting(False, "draft with the MTP block, verify greedily, and compare with plain decoding")
    #: tokens the MTP chain drafts a round; deeper drafts are accepted less often (3: as serve's)
    draft: int = setting(3, "--speculative: tokens drafted a round (MTP chain depth)", lo=1)
    #: the draft's top guesses for a round's first token, each chained to `draft`, all verified in
    #: one forward (a draft tree; the static-cache engine, attention-only models); 0 (auto): as
    #: serve's, `auto_branches` (4 on CUDA for attention-only models, else 1; 1 with --reference)
    draft_branches: int = setting(0, "--speculative: verify the draft's top N first guesses, each chained, "
                                           "in one forward (a tree; 0: 4 on CUDA for attention-only models, "
                                           "else 1)", lo=0)
    #: as serve's: the draft guesses among the N tokens its trunk chose most on its training text
    #: (mtp heal's ranking, cortiq.mtp.vocab); the static-cache engine alone (the reference loop
    #: drafts over every token)
    draft_vocab: int = setting(0, "--speculative: the draft guesses among the N tokens its trunk chose most on "
                                  "its training text (0: 32768 for vocabularies over 65536 with mtp heal's "
                                  "ranking, else all)", lo=0)
    #: the plain loop is the reference the static-cache engine is tested against
    reference: bool = setting(False, "decode with the plain reference loop (growing cache, eager) instead of the "
                                     "static-cache engine")
    # ── resources ──
    #: "auto": CUDA when present (the captured-graph engine's home)
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N")
    #: bf16 halves the weights' memory traffic on CUDA; f32 keeps the CPU exact
    dtype: str = setting("auto", "compute dtype (auto: bf16 on CUDA, f32 else)", choices=COMPUTE)

    def __post_init__(self):
        check(self, "generate settings")
        if self.speculative and self.temperature > 0:
            raise CortiqError("generate settings: --speculative verifies greedily: use --temperature 0")


def add_arguments(p):
    p.add_argument("model", metavar="MODEL.cmf", help="the model to decode with")
    p.add_argument("prompt", help="the text decoding starts from")
    add_arguments_of(p, GenerateSettings, title="generate settings")


class _Stream:
    """Prints the text of the tokens so far as they come (decoding the whole
    list each time, so multi-token characters print once complete)."""

    def __init__(self, tok, out):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def __call__(self, t: int):
        self.ids.append(t)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def finish(self):
        """The rest (an incomplete character at the end prints as decoded), then a newline."""
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        self.out.write((text[len(self.shown):] if text.startswith(self.shown) else "") + "\n")
        self.out.flush()


def _chat(prompt: str, doc: dict, where: str) -> str:
    from ..errors import CortiqError

    tmpl = (doc or {}).get("chat_template")
    if not tmpl:
        raise CortiqError(f"{where}: carries no chat template (drop --chat)")
    from ..chat import render_chat

    return render_chat(tmpl, [{"role": "user", "content": prompt}], str(where), add_generation_prompt=True)


def _differ(a: list[int], b: list[int]) -> tuple[int, int | None]:
    """(tokens that differ position by position, lengths included; the first such position)."""
    n = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    return n, first


def run(args) -> int:
    import sys

    import torch

    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..model import load_model
    from ..model.decode import auto_branches
    from ..model.generate import generate, generate_fast, generate_speculative
    from ..mtp.vocab import engine_ids
    from ..settings_meta import from_args
    from ..tokenizer import from_doc

    s = from_args(GenerateSettings, args)
    f = open_cmf(args.model)
    tok = from_doc(f.tokenizer, str(args.model))
    text = _chat(args.prompt, f.tokenizer, args.model) if s.chat else args.prompt
    prompt = tok.encode(text).ids
    if not prompt:
        raise CortiqError("the prompt encodes to no tokens")
    eos = (f.tokenizer or {}).get("eos_ids") or []
    dev = resolve_device(s.device, "generate")
    dt = resolve_compute(s.dtype, dev)
    if s.draft_vocab and (s.reference or not s.speculative):
        raise CortiqError("generate: --draft-vocab narrows the draft of --speculative on the static-cache engine "
                          "(not with --reference)")
    vocab = engine_ids(f, s.draft_vocab) if s.speculative and not s.reference else None  # (before the weights load)
    model = load_model(f, dtype=dt, device=dev)
    if s.speculative and model.mtp is None:
        raise CortiqError(f"{args.model}: has no MTP draft block (model.mtp.*): --speculative needs one")
    if s.draft_branches > 1 and (s.reference or not s.speculative):
        raise CortiqError("generate: --draft-branches drafts a tree for --speculative on the static-cache engine "
                          "(not with --reference)")
    nb = s.draft_branches or (1 if s.reference else auto_branches(model.arch, dev))
    sys.stdout.write(args.prompt if not s.chat else "")
    stream = _Stream(tok, sys.stdout)
    if s.speculative:
        if s.reference:
            spec = generate_speculative(model, prompt, s.max_new, draft=s.draft, eos_ids=eos, on_token=stream)
        else:
            spec = generate_fast(model, prompt, s.max_new, draft=s.draft, eos_ids=eos, on_token=stream,
                                 branches=nb, draft_vocab=vocab)
        stream.finish()
        plain = (generate if s.reference else generate_fast)(model, prompt, s.max_new, eos_ids=eos)
        n, first = _differ(spec.tokens, plain.tokens)
        exact = dt == torch.float32
        if n == 0:
            verdict = "output identical to plain greedy"
        else:
            verdict = (f"{n} of {len(plain.tokens)} tokens differ from plain greedy, from token {first} on"
                       + ("" if exact else f" ({str(dt)[6:]}: a near-tie argmax rounded differently in the "
                                           f"{nb * s.draft + 1}-row verify step; see --help)"))
        print(f"speculative: {len(spec.tokens)} tokens in {spec.rounds} rounds, "
              f"{spec.accepted_per_round:.2f} of {s.draft} drafts accepted per round "
              f"({spec.accepted}/{spec.drafted}), {spec.tokens_per_s:.1f} tok/s; "
              f"plain: {plain.tokens_per_s:.1f} tok/s (x{spec.tokens_per_s / max(plain.tokens_per_s, 1e-9):.2f}); "
              f"{verdict}", file=sys.stderr)
        return 1 if (n and exact) else 0
    if s.reference:
        res = generate(model, prompt, s.max_new, temperature=s.temperature, eos_ids=eos, on_token=stream,
                       seed=s.seed)
    else:
        res = generate_fast(model, prompt, s.max_new, temperature=s.temperature, eos_ids=eos, on_token=stream,
                            seed=s.seed)
    stream.finish()
    print(f"{len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s (prompt {len(prompt)} tokens in {res.prefill_seconds:.2f}s)",
          file=sys.stderr)
    return 0
