"""How long a one-token request waits at `cortiq serve` while large prompts arrive.

    python -m bench.serve.isolation --cpu                  # the tiny random model on the CPU (minutes)
    python -m bench.serve.isolation --model M.cmf --out DIR
    python -m bench.serve.isolation --cpu --tiny           # smoke run: 4 prompts of 40000 characters, seconds

Each row starts a server, sends --prompts concurrent completions of --chars characters
(max_tokens 1) and, --settle seconds later (their bodies on their way), a one-token completion
of "hi"; that request's latency is timed, --reps times (median and worst). Rows:
- `alone`: the small request with nothing else sent;
- `refused`: the large prompts over the server's --max-prompt-chars (its default, 32 characters
  per token of the context): each is refused before it is tokenized;
- `tokenized`: --max-prompt-chars raised to take them: they are tokenized on the server's
  worker threads (then refused for the context, or answered), off its event loop.
The tokenizers library's `encode` holds the interpreter lock for a whole text, so a prompt
tokenized on the event loop, or on a thread through `encode`, kept every other request
waiting (16 prompts of 1 MB held one back for seconds); the server tokenizes through
`encode_batch`, which lets the loop run, and long prompts a few at a time (half the cores),
which leaves cores to the loop and the scheduler. The delay is the row's latency minus
`alone`'s; the client runs on the same machine, so on a small one it is part of what is timed.
Raw rows: OUT/serve-isolation.json. Needs fastapi, uvicorn and httpx (`cortiq[serve]`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import finish, log, parser, print_table, tiny_cmf, write_json


async def _latencies(url: str, model: str, prompts: int, chars: int, reps: int, settle: float):
    """The small request's latencies over `reps` rounds, each beside `prompts` large ones (none
    when `prompts` is 0) -> (seconds per round, the large requests' status codes)."""
    import httpx

    # the large body encoded once: this client's own event loop stays free to send the small request
    big = json.dumps({"model": model, "prompt": "x" * chars, "max_tokens": 1, "temperature": 0}).encode()
    head = {"content-type": "application/json"}
    small = {"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0}
    out, codes = [], []
    limits = httpx.Limits(max_connections=prompts + 4, max_keepalive_connections=prompts + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        (await c.post("/completions", json=small)).raise_for_status()  # warm
        for _ in range(reps):
            large = [asyncio.create_task(c.post("/completions", content=big, headers=head)) for _ in range(prompts)]
            await asyncio.sleep(settle if prompts else 0)
            t0 = time.perf_counter()
            (await c.post("/completions", json=small)).raise_for_status()
            out.append(time.perf_counter() - t0)
            codes += [(await t).status_code for t in large]
    return out, codes


def _row(name: str, model: Path, server_args: list[str], prompts: int, args) -> dict:
    from bench.serve.serve import Server

    with tempfile.TemporaryDirectory() as d:
        srv = Server(model, Path(d) / "serve.log", ["--max-batch", "4", "--max-body-kb", str(2 * args.chars // 1024 + 64),
                                                    *server_args])
        try:
            got, codes = asyncio.run(_latencies(srv.url, model.name.removesuffix(".cmf"), prompts, args.chars,
                                                args.reps, args.settle))
        finally:
            srv.stop()
    row = {"row": name, "prompts": prompts, "chars": args.chars if prompts else 0, "median_s": statistics.median(got),
           "worst_s": max(got), "large_statuses": sorted(set(codes)), "seconds": got}
    log(f"{name}: median {row['median_s']:.3f} s, worst {row['worst_s']:.3f} s, large requests {row['large_statuses']}")
    return row


def main() -> int:
    ap = parser(__doc__, cpu_help="serve on the CPU")
    ap.add_argument("--model", help="the model (default: the tiny random model of the smoke modes)")
    ap.add_argument("--prompts", type=int, help="large prompts sent together (default 16; --tiny 4)")
    ap.add_argument("--chars", type=int, help="characters of each large prompt (default 1000000; --tiny 40000)")
    ap.add_argument("--reps", type=int, help="rounds per row (default 5; --tiny 2)")
    ap.add_argument("--settle", type=float, default=0.1, help="seconds between the large prompts and the small one")
    args = ap.parse_args()
    for k, full, tiny in (("prompts", 16, 4), ("chars", 1_000_000, 40_000), ("reps", 5, 2)):
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    with tempfile.TemporaryDirectory() as d:
        model = Path(args.model) if args.model else tiny_cmf(Path(d) / "tiny.cmf")
        device = ["--device", "cpu"] if args.cpu or not args.model else []
        rows = [_row("alone", model, device, 0, args), _row("refused", model, device, args.prompts, args),
                _row("tokenized", model, [*device, "--max-prompt-chars", str(args.chars)], args.prompts, args)]
    base = rows[0]["median_s"]
    print_table(["row", "large prompts", "small request, median s", "worst s", "delay s", "large statuses"],
                [[r["row"], f"{r['prompts']} x {r['chars']}", f"{r['median_s']:.3f}", f"{r['worst_s']:.3f}",
                  f"{r['median_s'] - base:.3f}", r["large_statuses"]] for r in rows])
    write_json(args.out, "serve-isolation.json", {"rows": rows, "model": str(args.model or "tiny"),
                                                  "cpu": bool(args.cpu or not args.model)})
    return 0


if __name__ == "__main__":
    finish(main())
