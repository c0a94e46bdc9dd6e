"""Decoding speed on the GPU: cortiq's static-cache engine (CUDA graphs), plain
and speculative, against transformers' `generate` on the same weights, in one
call, with drafts accepted per round next to the offline estimate.

    python bench/decode.py [--model MODEL.cmf] --draft DRAFTED.cmf [--draft OTHER.cmf] [--new 200]
                           [--batches 1,8] [--depths 1,2,3] [--out DIR]
    python bench/decode.py --random          # SmolLM2-135M geometry, random weights + random draft (speed only)

`--draft` is a model file carrying `model.mtp.*` (what `cortiq mtp heal`
writes): its trunk decodes every row, its draft the speculative ones. Every
figure is greedy, bf16, new tokens per second after the prompt's forward
(batch B counts B·new tokens), EOS ignored so every run decodes `--new`
tokens. Prompts: windows of `--prompt-tokens` tokens of the pydoc topics
text (data) and a few questions in the model's chat template (chat).

Rows:
- `reference`: cortiq's reference loop (`generate`, a growing cache, eager).
- `engine`: `DecodeEngine` plain steps; `spec kN`: speculative rounds at draft depth N.
- `transformers`: `LlamaForCausalLM.generate` (sdpa, dynamic cache) on the same weights.
Columns: tokens/s; ×plain (against the engine's plain row of the same batch);
tokens differing from the engine's plain greedy output (bf16: see
cortiq.model.decode, "Why bf16 can differ"); drafts accepted per round
(real) and the offline estimate of the same draft on the same text
(the measure `cortiq mtp heal` reports, run teacher-forced over the prompts and
their plain greedy continuations), plus the figure the draft file's provenance
records for its held-out windows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAT = ["What is the capital of France?", "Write a short poem about the sea.",
        "Explain what a hash table is.", "Give me three tips for learning to cook."]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def random_smollm2(draft: bool, tiny: bool = False):
    """SmolLM2-135M's geometry with random weights (and a random MTP block); `tiny`: a CPU smoke-test size."""
    from cortiq.arch import Arch
    from cortiq.model import CausalLM

    L, H, I, V = (2, 64, 96, 300) if tiny else (30, 576, 1536, 49152)
    arch = Arch(arch_name="llama", vocab_size=V, hidden_size=H, num_layers=L, intermediate_sizes=[I] * L,
                num_heads=9 if not tiny else 4, num_kv_heads=3 if not tiny else 2, head_dim=64 if not tiny else 16,
                rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=8192, rope_theta=100000.0, mtp_layers=1 if draft else 0)
    torch.manual_seed(0)
    with torch.device(DEV):
        m = CausalLM(arch)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) * (0.02 if "embed" in n else p.shape[-1] ** -0.5))
    m._inv_freq = m._inv_freq.to(DEV)
    return m.to(torch.bfloat16 if DEV == "cuda" else torch.float32).eval(), None


def prompts_for(tok, n: int, T: int, doc) -> tuple[list[list[int]], list[list[int]]]:
    """n data windows of T tokens, and the chat prompts (when the model has a template)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text).ids if tok else [(i * 7919) % 250 for i in range(400 * T)]
    step = max(T, (len(ids) - T) // n)
    data = [ids[i * step: i * step + T] for i in range(n)]
    chat = []
    tmpl = (doc or {}).get("chat_template")
    if tok and tmpl:
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        for q in CHAT:
            s = env.from_string(tmpl).render(messages=[{"role": "user", "content": q}], add_generation_prompt=True,
                                             bos_token="", eos_token="")
            chat.append(tok.encode(s).ids)
    return data, chat


def hf_twin(model):
    """transformers' LlamaForCausalLM with the cortiq model's weights (same names)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = model.arch
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_sizes[0],
                      num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                      head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
                      max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
                      rope_scaling=a.rope_scaling)
    cfg._attn_implementation = "sdpa"
    with torch.device(DEV):
        hf = LlamaForCausalLM(cfg).to(model.model.embed_tokens.weight.dtype)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("model.mtp.")}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and a.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if a.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def hf_generate(hf, prompts, new):
    ids = torch.tensor(prompts, device=DEV)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.generate(ids[:, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
    sync()
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync()
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def offline_dpr(model, seqs: list[list[int]], plen: list[int], chain: int) -> float:
    """Drafts per round by cortiq's offline measure, teacher-forced over prompt +
    greedy continuation (rows from the first generated token on)."""
    from cortiq.mtp import measures as M

    total = torch.zeros(chain, 2, dtype=torch.int64)
    with torch.no_grad():
        for s, p in zip(seqs, plen):
            ids = torch.tensor([s], device=DEV)
            H, _ = model.forward_hidden(ids)
            t1 = model.logits(H).argmax(-1)  # [1, T]
            draft, src = [], H
            for j in range(1, chain + 1):
                nxt = torch.cat([ids[:, j:], ids.new_zeros(1, j)], 1)  # token p+j at row p
                src = model.mtp_forward(src, nxt)
                draft.append(model.logits(src).argmax(-1))
            d = torch.stack(draft)  # [chain, 1, T]
            # count rows from the prompt's last row on (where decoding drafts)
            off = p - 1
            c = M.chain_counts(ids[:, off:].cpu(), torch.tensor([len(s) - off]), t1[:, off:].cpu(), d[:, :, off:].cpu())
            total += c
    return M.drafts_per_round(total)


def provenance_dpr(f) -> float | None:
    """The draft's drafts per round as its file's provenance records it (held-out windows of its training data)."""
    best = None

    def walk(x):
        nonlocal best
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("drafts_per_round_after", "drafts_per_round") and isinstance(v, (int, float)):
                    best = float(v)
                walk(v)

    walk(getattr(f, "provenance", None) or {})
    return best


def diff_count(a: list[int], b: list[int]) -> int:
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def first_diff(pairs) -> int | None:
    """The earliest position where any pair of token lists differs (None: all equal)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
    firsts = [f for f in firsts if f is not None]
    return min(firsts) if firsts else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="MODEL.cmf (plain rows; default: the first --draft's trunk)")
    ap.add_argument("--draft", action="append", default=[],
                    help="a model file with model.mtp.* (speculative rows; repeat to compare drafts, e.g. the "
                         "`mtp init` output and the `mtp heal` output: same trunk, other draft)")
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M geometry with random weights (speed only)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model: a CPU smoke test of this script")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--reference-new", type=int, default=64, help="tokens for the (slow) reference loop row")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    assert DEV == "cuda" or a.tiny, "the benchmark needs a CUDA device (--tiny smoke-tests it on the CPU)"
    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.model.decode import DecodeEngine
    from cortiq.model.generate import decode, generate
    from cortiq.tokenizer import from_doc

    drafts = []  # (name, model with a draft, its file or None)
    if a.random or a.tiny:
        model, tok = random_smollm2(True, a.tiny)
        doc = None
        drafts.append(("random", model, None))
    else:
        if not (a.model or a.draft):
            raise SystemExit("give --model and/or --draft (or --random)")
        f = open_cmf(a.model or a.draft[0])
        tok, doc = from_doc(f.tokenizer, str(f.path)), f.tokenizer
        model = load_model(f, dtype=torch.bfloat16, device=DEV)
        for d in a.draft:
            fd = open_cmf(d)
            md = model if fd.path == f.path else load_model(fd, dtype=torch.bfloat16, device=DEV)
            if md.mtp is None:
                raise SystemExit(f"{d}: carries no draft (model.mtp.*)")
            drafts.append((Path(d).stem, md, fd))
    depths = [int(x) for x in a.depths.split(",") if x]
    batches = [int(x) for x in a.batches.split(",")]
    data, chat = prompts_for(tok, max(batches), a.prompt_tokens, doc)
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    log(f"{dev}; torch {torch.__version__}; model {a.model or (a.draft or ['random SmolLM2 geometry'])[0]}; "
        f"drafts: {[n for n, _, _ in drafts]}")
    rows = []
    label = (lambda n: "") if len(drafts) < 2 else (lambda n: f" [{n}]")

    def row(**r):
        rows.append(r)
        log(json.dumps(r))

    # the reference loop, batch 1 (its speed does not depend on the length much; it is slow)
    ref = generate(model, data[0], max_new=a.reference_new)
    row(who="reference", batch=1, tok_s=ref.tokens_per_s, new=a.reference_new)
    plain_tokens = {}
    for B in batches:
        ps = data[:B]
        room = a.prompt_tokens + a.new + 16
        t0 = time.perf_counter()
        eng = DecodeEngine(model, slots=B, max_len=room)
        build = time.perf_counter() - t0
        decode(model, ps, max_new=16, engine=eng)  # warm-up
        out = decode(model, ps, max_new=a.new, engine=eng)
        tps = B * a.new / out[0].seconds
        plain_tokens[B] = [r.tokens for r in out]
        d_ref = diff_count(out[0].tokens[: a.reference_new], ref.tokens) if B == 1 else None
        row(who="engine", batch=B, tok_s=tps, build_s=build, differ_vs_reference=d_ref)
        del eng
        for name, md, _ in drafts:
            for k in depths:
                eng = DecodeEngine(md, slots=B, max_len=room + 2 * k, draft=k)
                decode(md, ps, max_new=16, draft=k, engine=eng)
                sp = decode(md, ps, max_new=a.new, draft=k, engine=eng)
                acc = sum(r.accepted for r in sp) / max(sum(r.rounds for r in sp), 1)
                diff = sum(diff_count(r.tokens, t) for r, t in zip(sp, plain_tokens[B]))
                row(who=f"spec k{k}{label(name)}", batch=B, tok_s=B * a.new / sp[0].seconds,
                    x_plain=B * a.new / sp[0].seconds / tps, accepted=acc, differ=diff, differ_of=B * a.new,
                    first=first_diff([(r.tokens, t) for r, t in zip(sp, plain_tokens[B])]))
                del eng
        if not a.no_hf:
            hf = hf_twin(model)
            toks, secs = hf_generate(hf, ps, a.new)
            diff = sum(diff_count(t, p) for t, p in zip(toks, plain_tokens[B]))
            row(who="transformers", batch=B, tok_s=B * a.new / secs, differ=diff, differ_of=B * a.new,
                first=first_diff(list(zip(toks, plain_tokens[B]))))
            del hf
        if DEV == "cuda":
            torch.cuda.empty_cache()
    # drafts accepted per round on data and chat prompts, and the offline estimate on the same text
    accept = {}
    if not a.random:
        for pname, ps in (("data", data[: max(batches)]), ("chat", chat)):
            if not ps:
                continue
            plain = decode(model, ps, max_new=a.new)
            seqs = [p + r.tokens for p, r in zip(ps, plain)]
            for name, md, _ in drafts:
                for k in depths:
                    sp = decode(md, ps, max_new=a.new, draft=k)
                    real = sum(r.accepted for r in sp) / max(sum(r.rounds for r in sp), 1)
                    accept[(pname + label(name), k)] = (real, offline_dpr(md, seqs, [len(p) for p in ps], k))
    print(f"\n{dev}, torch {torch.__version__}, {str(model.model.embed_tokens.weight.dtype)[6:]}, greedy, "
          f"{a.new} new tokens after a {a.prompt_tokens}-token prompt")
    print("| decoder | batch | tokens/s | × engine plain | drafts accepted / round | tokens differing from plain |")
    print("|---|---|---|---|---|---|")
    base = {r["batch"]: r["tok_s"] for r in rows if r["who"] == "engine"}
    for r in rows:
        x = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
        acc = f"{r['accepted']:.2f}" if "accepted" in r else ""
        if "differ" in r:
            d = f"{r['differ']} of {r['differ_of']}" + (f" (from token {r['first']})" if r.get("first") is not None else "")
        elif r.get("differ_vs_reference") is not None:
            d = f"{r['differ_vs_reference']} of {a.reference_new} vs the reference loop"
        else:
            d = ""
        print(f"| {r['who']} | {r['batch']} | {r['tok_s']:.0f} | {'' if x is None else f'{x:.2f}'} | {acc} | {d} |")
    if accept:
        print("\n| prompts | depth | accepted / round (real) | offline estimate (same text) |")
        print("|---|---|---|---|")
        for (pname, k), (real, off) in accept.items():
            print(f"| {pname} | {k} | {real:.3f} | {off:.3f} |")
        for name, _, fd in drafts:
            prov = provenance_dpr(fd) if fd is not None else None
            if prov is not None:
                print(f"\n{name}: its file's provenance says {prov:.3f} drafts per round (held-out windows of its training data)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"device": dev, "torch": torch.__version__, "rows": rows,
                                                 "accept": {f"{n}-k{k}": v for (n, k), v in accept.items()}}, indent=1))


if __name__ == "__main__":
    main()
