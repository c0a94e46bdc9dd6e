"""Decoding speed on the GPU: cortiq's static-cache engine (CUDA graphs), plain
and speculative, against transformers' `generate` on the same weights, in one
call, with drafts accepted per round next to the offline estimate.

    python -m bench.serve.decode [--model MODEL.cmf] --draft DRAFTED.cmf [--draft OTHER.cmf] [--new 200]
                           [--batches 1,8] [--depths 1,2,3] [--out DIR]
    python -m bench.serve.decode --random    # SmolLM2-135M geometry, random weights + random draft (speed only)
    python -m bench.serve.decode --cpu --tiny [--draft TINY.cmf --gen-cache DIR]   # a CPU smoke test

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
cortiq.model.decode, "Why bf16 can differ"); drafts accepted per round.

Acceptance table, per prompt kind: real decoding (the engine, greedy, EOS
stops a row) against `cortiq mtp heal`'s own measure (cortiq.mtp.measure_text:
the rounds a greedy decode walks from the prompt's end) on
- `held-out data` / `held-out chat`: the prompts of the held-out windows the
  draft was measured on (its provenance names the data and settings; the
  generated windows are read back from --gen-cache), offline on those windows:
  the figure mtp heal reports, per kind, on these prompts;
- every kind, the same measure on the decoded text itself (`decoded`), which
  differs from real only by bf16 rounding (verify rows vs one forward);
- `data` (windows of the pydoc text) and `questions` (a few chat questions):
  prompts no held-out window has.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.common import finish, log, parser, pydoc_text, write_json

CHAT = ["What is the capital of France?", "Write a short poem about the sea.",
        "Explain what a hash table is.", "Give me three tips for learning to cook."]


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
    text = pydoc_text()
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


def offline(model, seqs, plens, k: int, new: int, chat=None, pad: int = 0,
            branches: int | tuple[int, ...] = 1) -> dict:
    """mtp heal's measure (cortiq.mtp.measure_text) at depth k (of a draft tree: `branches` first
    guesses, or a tuple of widths per step): {kind: drafts a round}. The engine emits the first
    new token at prefill, so its rounds over `new` tokens are the walk's over new - 1."""
    from cortiq.mtp import measure_text

    with torch.no_grad():
        r = measure_text(model, seqs, plens, chain=k, span=new - 1, chat=chat, pad=pad, branches=branches)
    return {n: v["drafts_per_round"] for n, v in r.items()}


def heldout(md, fd, n: int, cache):
    """Up to n held-out windows per kind (data, chat) of the draft's own measure:
    {kind: (prompts, windows, prompt lengths)}; {} when its provenance has no mtp heal."""
    import numpy as np

    from cortiq.errors import CortiqError
    from cortiq.mtp import heldout_windows

    try:
        with torch.no_grad():
            hw = heldout_windows(md, fd, cache=cache)
    except CortiqError as e:
        log(f"no held-out windows: {e}")
        return {}
    out = {}
    for kind in ("data", "chat"):
        idx = (hw["chat"] if kind == "chat" else ~hw["chat"]).nonzero().flatten()
        if len(idx) == 0:
            continue
        idx = idx[np.unique(np.linspace(0, len(idx) - 1, min(n, len(idx))).round().astype(int))]
        seqs = [hw["ids"][i, : hw["lens"][i]].tolist() for i in idx]
        plens = [int(hw["start"][i]) + 1 for i in idx]
        out[kind] = ([x[:p] for x, p in zip(seqs, plens)], seqs, plens)
    return out


def preset_of(f) -> str | None:
    """The mtp heal preset recorded in a draft file's provenance."""
    return ((getattr(f, "provenance", None) or {}).get("mtp_heal") or {}).get("preset")


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


def parse_args():
    """The command line; --cpu makes DEV the CPU, --tiny caps the lengths."""
    ap = parser(__doc__, cpu_help="run on the CPU (f32)",
                tiny_help="small sizes (and without --draft a tiny random model): a CPU smoke test of this script")
    ap.add_argument("--model", help="MODEL.cmf (plain rows; default: the first --draft's trunk)")
    ap.add_argument("--draft", action="append", default=[],
                    help="a model file with model.mtp.* (speculative rows; repeat to compare drafts, e.g. the "
                         "`mtp init` output and the `mtp heal` output: same trunk, other draft)")
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M geometry with random weights (speed only)")
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts per kind (data, chat) in the acceptance table")
    ap.add_argument("--gen-cache", default=str(Path.home() / "cache" / "mtp-bench" / "trunk"),
                    help="where mtp heal cached the generated windows (bench/mtp/mtp.py's --work/trunk)")
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--reference-new", type=int, default=64, help="tokens for the (slow) reference loop row")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                    help="the engine's compiled layer halves (auto: on CUDA for attention-only models)")
    a = ap.parse_args()
    global DEV
    if a.cpu:
        DEV = "cpu"
    assert DEV == "cuda" or a.tiny, "the benchmark needs a CUDA device (--tiny smoke-tests it on the CPU)"
    if a.tiny:
        a.new, a.reference_new, a.heldout = min(a.new, 40), min(a.reference_new, 16), min(a.heldout, 4)
    return a


def load_models(a):
    """(model, tokenizer, tokenizer doc, drafts, the model's file): drafts are (name, model with a draft,
    its file or None); the random geometry has no tokenizer and no file."""
    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.tokenizer import from_doc

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    drafts = []
    if a.random or (a.tiny and not (a.model or a.draft)):
        model, tok = random_smollm2(True, a.tiny)
        drafts.append(("random", model, None))
        return model, tok, None, drafts, None
    if not (a.model or a.draft):
        raise SystemExit("give --model and/or --draft (or --random)")
    f = open_cmf(a.model or a.draft[0])
    tok, doc = from_doc(f.tokenizer, str(f.path)), f.tokenizer
    model = load_model(f, dtype=dtype, device=DEV)
    for d in a.draft:
        fd = open_cmf(d)
        md = model if fd.path == f.path else load_model(fd, dtype=dtype, device=DEV)
        if md.mtp is None:
            raise SystemExit(f"{d}: carries no draft (model.mtp.*)")
        drafts.append((Path(d).stem, md, fd))
        log(f"draft {d}: preset {preset_of(fd) or 'none recorded'}")
    return model, tok, doc, drafts, f


def spec_rows(a, row, label, drafts, ps, room: int, depths, fused, plain_tps: float, plain: list) -> None:
    """The speculative rows of one batch: each draft at each depth, against the plain engine's output."""
    from cortiq.model.decode import DecodeEngine
    from cortiq.model.generate import decode

    B = len(ps)
    for name, md, _ in drafts:
        for k in depths:
            eng = DecodeEngine(md, slots=B, max_len=room + 2 * k, draft=k, fused=fused)
            decode(md, ps, max_new=16, draft=k, engine=eng)
            sp = decode(md, ps, max_new=a.new, draft=k, engine=eng)
            acc = sum(r.accepted for r in sp) / max(sum(r.rounds for r in sp), 1)
            diff = sum(diff_count(r.tokens, t) for r, t in zip(sp, plain))
            row(who=f"spec k{k}{label(name)}", batch=B, tok_s=B * a.new / sp[0].seconds,
                x_plain=B * a.new / sp[0].seconds / plain_tps, accepted=acc, differ=diff, differ_of=B * a.new,
                first=first_diff([(r.tokens, t) for r, t in zip(sp, plain)]))
            del eng


def speed_rows(a, model, drafts, data, batches, depths, fused, row, label) -> None:
    """The reference loop, then per batch: the engine's plain row, the speculative rows, transformers."""
    from cortiq.model.decode import DecodeEngine
    from cortiq.model.generate import decode, generate

    # the reference loop, batch 1 (its speed does not depend on the length much; it is slow)
    ref = generate(model, data[0], max_new=a.reference_new)
    row(who="reference", batch=1, tok_s=ref.tokens_per_s, new=a.reference_new)
    for B in batches:
        ps = data[:B]
        room = a.prompt_tokens + a.new + 16
        t0 = time.perf_counter()
        eng = DecodeEngine(model, slots=B, max_len=room, fused=fused)
        build = time.perf_counter() - t0
        decode(model, ps, max_new=16, engine=eng)  # warm-up
        out = decode(model, ps, max_new=a.new, engine=eng)
        tps = B * a.new / out[0].seconds
        plain = [r.tokens for r in out]
        d_ref = diff_count(out[0].tokens[: a.reference_new], ref.tokens) if B == 1 else None
        row(who="engine", batch=B, tok_s=tps, build_s=build, differ_vs_reference=d_ref, fused=eng.fused)
        del eng
        spec_rows(a, row, label, drafts, ps, room, depths, fused, tps, plain)
        if not a.no_hf:
            hf = hf_twin(model)
            toks, secs = hf_generate(hf, ps, a.new)
            diff = sum(diff_count(t, p) for t, p in zip(toks, plain))
            row(who="transformers", batch=B, tok_s=B * a.new / secs, differ=diff, differ_of=B * a.new,
                first=first_diff(list(zip(toks, plain))))
            del hf
        if DEV == "cuda":
            torch.cuda.empty_cache()


def acceptance(a, f, drafts, prompts: dict, depths, label) -> dict:
    """Drafts accepted per round against mtp heal's measure: on held-out windows' prompts, and on
    other prompts ({(prompt kind, depth): figures})."""
    from cortiq.model.generate import decode

    accept = {}
    eos = list((f.tokenizer or {}).get("eos_ids") or [f.eos_id]) if drafts[0][2] is not None else []
    pad = drafts[0][2].eos_id if drafts[0][2] is not None else 0
    for name, md, fd in drafts:
        kinds = heldout(md, fd, a.heldout, a.gen_cache) if fd is not None else {}
        kinds = {f"held-out {k}": v for k, v in kinds.items()}
        kinds.update({pn: (ps, None, [len(p) for p in ps]) for pn, ps in prompts.items() if ps})
        for pname, (ps, wins, plens) in kinds.items():
            for k in depths:
                sp = decode(md, ps, max_new=a.new, draft=k, eos_ids=eos)
                real = sum(r.accepted for r in sp) / max(sum(r.rounds for r in sp), 1)
                texts = [p + r.tokens for p, r in zip(ps, sp)]
                dec = offline(md, texts, plens, k, a.new, pad=pad).get("walk", 0.0)
                held = None
                if wins is not None:
                    kind = pname.split()[-1]
                    held = offline(md, wins, plens, k, a.new, torch.tensor([kind == "chat"] * len(wins)), pad).get(kind, 0.0)
                accept[(pname + label(name), k)] = {"real": real, "offline": held, "decoded": dec, "prompts": len(ps),
                                                    "rounds": sum(r.rounds for r in sp)}
                log(json.dumps({"prompts": pname + label(name), "depth": k, **accept[(pname + label(name), k)]}))
    return accept


def print_speed(a, dev: str, model, rows) -> None:
    """The speed table: a row per decoder and batch."""
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


def print_acceptance(accept: dict, drafts) -> None:
    """The acceptance table, then what each draft's file says of itself."""
    print(f"\n| prompts | depth | n | accepted / round (real) | offline (held-out windows) | ratio | offline (decoded text) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for (pname, k), v in accept.items():
        held = "" if v["offline"] is None else f"{v['offline']:.3f} | {v['real'] / max(v['offline'], 1e-9):.2f}"
        print(f"| {pname} | {k} | {v['prompts']} | {v['real']:.3f} | {held or ' | '} | {v['decoded']:.3f} | "
              f"{v['real'] / max(v['decoded'], 1e-9):.2f} |")
    for name, _, fd in drafts:
        prov = provenance_dpr(fd) if fd is not None else None
        if prov is not None:
            blk = (fd.provenance or {}).get("mtp_heal") or {}
            per = "".join(f", {k} {blk[f'drafts_per_round_after_{k}']:.3f}" for k in ("data", "chat", "every_row")
                          if isinstance(blk.get(f"drafts_per_round_after_{k}"), (int, float)))
            print(f"\n{name} (preset {preset_of(fd)}): its file's provenance says {prov:.3f} drafts per round{per} "
                  f"(held-out windows of its training data; {blk.get('measure', 'every row')})")


def main():
    a = parse_args()
    model, tok, doc, drafts, f = load_models(a)
    depths = [int(x) for x in a.depths.split(",") if x]
    fused = {"auto": None, "on": True, "off": False}[a.fused]
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

    speed_rows(a, model, drafts, data, batches, depths, fused, row, label)
    accept = {} if a.random else acceptance(a, f, drafts, {"data": data[: max(batches)], "questions": chat}, depths,
                                            label)
    print_speed(a, dev, model, rows)
    if accept:
        print_acceptance(accept, drafts)
    path = write_json(a.out, "decode.json", {"device": dev, "torch": torch.__version__, "rows": rows,
                                             "accept": {f"{n}-k{k}": v for (n, k), v in accept.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    finish(main())
