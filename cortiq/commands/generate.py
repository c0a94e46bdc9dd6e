"""`cortiq generate MODEL "prompt"`: decode with a KV cache, streaming to the terminal."""

from __future__ import annotations

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


def add_arguments(p):
    p.add_argument("model", metavar="MODEL.cmf")
    p.add_argument("prompt")
    p.add_argument("--max-new", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--speculative", action="store_true", help="draft with the MTP block, verify greedily")
    p.add_argument("--draft", type=int, default=1, help="--speculative: tokens drafted a round (MTP chain depth)")
    p.add_argument("--reference", action="store_true",
                   help="decode with the plain reference loop (growing cache, eager) instead of the static-cache engine")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "f32", "bf16", "f16"], help="compute dtype (auto: bf16 on CUDA, f32 else)")


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
    from ..errors import CortiqError
    from ..model import load_model
    from ..model.generate import generate, generate_fast, generate_speculative
    from ..tokenizer import from_doc
    from .nll import _device_dtype

    if args.max_new < 1:
        raise CortiqError(f"--max-new {args.max_new}: generate at least 1 token")
    if args.speculative and args.temperature > 0:
        raise CortiqError("--speculative verifies greedily: use --temperature 0")
    if args.speculative and args.draft < 1:
        raise CortiqError(f"--draft {args.draft}: draft at least 1 token a round")
    f = open_cmf(args.model)
    tok = from_doc(f.tokenizer, str(args.model))
    text = _chat(args.prompt, f.tokenizer, args.model) if args.chat else args.prompt
    prompt = tok.encode(text).ids
    if not prompt:
        raise CortiqError("the prompt encodes to no tokens")
    eos = (f.tokenizer or {}).get("eos_ids") or []
    dev, dt = _device_dtype(args)
    model = load_model(f, dtype=dt, device=dev)
    if args.speculative and model.mtp is None:
        raise CortiqError(f"{args.model}: has no MTP draft block (model.mtp.*): --speculative needs one")
    sys.stdout.write(args.prompt if not args.chat else "")
    stream = _Stream(tok, sys.stdout)
    if args.speculative:
        if args.reference:
            spec = generate_speculative(model, prompt, args.max_new, draft=args.draft, eos_ids=eos, on_token=stream)
        else:
            spec = generate_fast(model, prompt, args.max_new, draft=args.draft, eos_ids=eos, on_token=stream)
        stream.finish()
        plain = (generate if args.reference else generate_fast)(model, prompt, args.max_new, eos_ids=eos)
        n, first = _differ(spec.tokens, plain.tokens)
        exact = dt == torch.float32
        if n == 0:
            verdict = "output identical to plain greedy"
        else:
            verdict = (f"{n} of {len(plain.tokens)} tokens differ from plain greedy, from token {first} on"
                       + ("" if exact else f" ({str(dt)[6:]}: a near-tie argmax rounded differently in the "
                                           f"{args.draft + 1}-row verify step; see --help)"))
        print(f"speculative: {len(spec.tokens)} tokens in {spec.rounds} rounds, "
              f"{spec.accepted_per_round:.2f} of {args.draft} drafts accepted per round "
              f"({spec.accepted}/{spec.drafted}), {spec.tokens_per_s:.1f} tok/s; "
              f"plain: {plain.tokens_per_s:.1f} tok/s (x{spec.tokens_per_s / max(plain.tokens_per_s, 1e-9):.2f}); "
              f"{verdict}", file=sys.stderr)
        return 1 if (n and exact) else 0
    if args.reference:
        res = generate(model, prompt, args.max_new, temperature=args.temperature, eos_ids=eos, on_token=stream,
                       seed=args.seed)
    else:
        res = generate_fast(model, prompt, args.max_new, temperature=args.temperature, eos_ids=eos, on_token=stream,
                            seed=args.seed)
    stream.finish()
    print(f"{len(res.tokens)} tokens, {res.tokens_per_s:.1f} tok/s (prompt {len(prompt)} tokens in {res.prefill_seconds:.2f}s)",
          file=sys.stderr)
    return 0
