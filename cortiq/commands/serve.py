"""`cortiq serve MODEL.cmf`: an OpenAI-compatible HTTP endpoint."""

from __future__ import annotations

HELP = "serve a model over an OpenAI-compatible HTTP API (batched, streaming, speculative)"
DESCRIPTION = (
    "An OpenAI-compatible endpoint for a CMF model: GET /v1/models, POST /v1/completions and "
    "/v1/chat/completions (the model's chat template), `stream: true` as server-sent events, max_tokens, "
    "temperature, top_p, stop and seed; GET /metrics, the counters in Prometheus' text format. Concurrent "
    "requests share one batched forward: they join free slots and leave between steps. --speculative drafts "
    "with the model's MTP block for greedy requests "
    "(temperature 0; same tokens as plain decoding). Listens on 127.0.0.1 unless --host says otherwise; "
    "SIGTERM (or Ctrl-C) stops it after the running requests get --shutdown-timeout seconds. "
    "Needs the serve extra: pip install 'cortiq[serve]'."
)
ORDER = 42

MISSING = "cortiq serve needs FastAPI and uvicorn: pip install 'cortiq[serve]'"


def add_arguments(p):
    from ..serve.settings import ServeSettings
    from ..settings_meta import add_arguments as add_settings

    p.add_argument("model", metavar="MODEL.cmf", help="the model to serve")
    add_settings(p, ServeSettings, title="serve settings")


def load(model_path: str, s):
    """(Served, Scheduler) for a model file: the engine, scheduler and text side, not yet listening."""
    from pathlib import Path

    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..errors import CortiqError
    from ..model import load_model
    from ..serve.app import Served
    from ..serve.engine import make_engine
    from ..serve.scheduler import Scheduler
    from ..tokenizer import from_doc

    dev = resolve_device(s.device, "serve")
    dt = resolve_compute(s.dtype, dev)
    f = open_cmf(model_path)
    tok = from_doc(f.tokenizer, str(model_path))
    ctx = int(f.arch.max_position_embeddings)
    if s.max_len > ctx:
        raise CortiqError(f"{model_path}: --max-len {s.max_len} is past the model's context of {ctx} tokens "
                          "(max_position_embeddings)")
    model = load_model(f, dtype=dt, device=dev)
    if s.speculative and model.mtp is None:
        raise CortiqError(f"{model_path}: has no MTP draft block (model.mtp.*): --speculative needs one "
                          "(cortiq mtp init / mtp heal give it one)")
    max_len = s.max_len or min(ctx, 4096)
    nb = s.branches(model.arch, dev)
    check_kv_room(model.arch, s.max_batch, max_len, s.draft if s.speculative else 0, dt, dev, nb)
    engine = make_engine(model, s.max_batch, max_len, draft=s.draft if s.speculative else 0, kind=s.engine,
                         branches=nb)
    doc = f.tokenizer or {}
    eos_ids = [int(i) for i in doc.get("eos_ids") or []]
    bos_id = doc.get("bos_id")
    bos = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos = tok.id_to_token(eos_ids[0]) if eos_ids else ""
    sched = Scheduler(engine, tok, eos_ids, speculative=s.speculative, max_waiting=s.max_waiting,
                      spec_auto=s.spec_auto, prefill_chunk=s.prefill_chunk)
    if s.profile and s.profile_steps:
        sched.trace(s.profile_steps, str(Path(s.profile).with_suffix(".trace.json")))
    name = s.model_name or Path(model_path).name.removesuffix(".cmf")
    # (every position of max_len: a speculative engine's caches hold a verify block past it)
    served = Served(sched, tok, name, engine.max_len, doc.get("chat_template"), bos or "", eos or "",
                    s.max_body_kb * 1024, s.prompt_chars(engine.max_len))
    return served, dev, dt


def kv_bytes(arch, slots: int, max_len: int, draft: int, dtype, branches: int = 1) -> int:
    """The decode engine's KV cache: keys and values of every full-attention layer (and the
    draft's, when it drafts) over `slots` sequences, each the positions the server's engine
    holds for a request of `max_len` (`cortiq.model.decode.cache_len` of the adapter's
    `engine_len`: a round's verify block past the request's last position, and a tree's rows)."""
    import torch

    from ..model.decode import cache_len
    from ..serve.engine import DecodeAdapter

    layers = sum(t == "full_attention" for t in arch.layer_types) + (1 if draft else 0)
    m = cache_len(DecodeAdapter.engine_len(max_len, draft), draft, branches)
    return 2 * layers * slots * arch.num_kv_heads * m * arch.head_dim * torch.empty((), dtype=dtype).element_size()


def check_kv_room(arch, slots: int, max_len: int, draft: int, dtype, device, branches: int = 1) -> None:
    """Refuse a KV cache larger than the memory left on `device`, before it is allocated."""
    from ..devices import free_memory
    from ..errors import CortiqError

    need, free = kv_bytes(arch, slots, max_len, draft, dtype, branches), free_memory(device)
    if need > free:
        raise CortiqError(f"serve: the KV cache of {slots} slots x {max_len} tokens needs {need / 1e9:.1f} GB, "
                          f"{device} has {free / 1e9:.1f} GB free: lower --max-len or --max-batch")


def run(args) -> int:
    import signal
    import socket
    import sys

    from ..errors import CortiqError
    from ..serve.settings import ServeSettings
    from ..settings_meta import from_args

    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise CortiqError(MISSING) from None
    s = from_args(ServeSettings, args)
    served, dev, dt = load(args.model, s)
    from ..serve.app import build_app

    app = build_app(served)
    # the socket is bound here so that --port 0 can print the port it got
    family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.host, s.port))
        sock.listen(2048)  # connections made once the address is printed queue until uvicorn accepts them
    except OSError as e:
        raise CortiqError(f"serve: cannot listen on {s.host}:{s.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]
    eng = served.scheduler.engine
    auto = (f", {eng.branches} branches" if eng.branches > 1 else "") + (", auto" if s.spec_auto else "")
    print(f"cortiq serve: {served.model_id} on {dev} ({str(dt).removeprefix('torch.')}), "
          f"{type(eng).__name__} x{eng.max_batch}, context {served.max_len}"
          f"{f', speculative (draft {eng.draft}{auto})' if eng.draft else ''}", file=sys.stderr)
    print(f"cortiq serve: listening on http://{host if ':' not in host else f'[{host}]'}:{port}/v1", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=s.shutdown_timeout,
                            lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM and SIGINT while it runs (graceful shutdown), then raises the signal
    # again under the handler it found: for SIGTERM that is this no-op, so the command ends normally
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    st = served.scheduler.stats
    spec = (f", {st['rounds']} speculative rounds ({st['round_tokens'] / st['rounds']:.2f} tokens a round)"
            if st["rounds"] else "")
    print(f"cortiq serve: stopped after {st['requests']} requests, {st['tokens']} tokens{spec}", file=sys.stderr)
    if s.profile:
        import json
        import os
        from pathlib import Path

        prof = {**served.scheduler.profile(), **served.profile}
        out = Path(s.profile)
        tmp = out.with_name(out.name + ".partial")
        tmp.write_text(json.dumps(prof, indent=2))
        os.replace(tmp, out)
    return 0
