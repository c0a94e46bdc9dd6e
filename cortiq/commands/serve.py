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


#: options that act only with another: (the option's setting, the setting it needs)
NEEDS = (("draft", "speculative"), ("draft_branches", "speculative"), ("spec_auto", "speculative"),
         ("draft_vocab", "speculative"), ("profile_steps", "profile"))


def named(argv: list[str] | None, s) -> set[str]:
    """The settings the serve command line `argv` (from the command's name on) names, whatever
    their values; without a command line, those away from their defaults."""
    from ..settings_meta import named as named_in

    return named_in(argv, "serve", add_arguments, s)


def check_start(model_path: str, s, f, given: set[str], dev) -> tuple[int, int, object]:
    """Every refusal of `cortiq serve` that needs no loaded model, in one place, before the
    weights load: an option that acts only with another, a --max-len past the model's context,
    a round of drafts the context cannot hold, a --draft-vocab the model has no ranking for, a
    --profile that cannot be written or would overwrite the served model. -> (max_len, the draft
    tree's branches, the tokens the draft guesses among: cortiq.mtp.vocab.engine_ids, None for all)"""
    from ..errors import CortiqError
    from ..mtp.vocab import engine_ids
    from ..settings_meta import flag

    for name, needs in NEEDS:
        if name in given and getattr(s, name) is not False and not getattr(s, needs):
            raise CortiqError(f"serve: {flag('', name)} acts only with {flag('', needs)}")
    ctx = int(f.arch.max_position_embeddings)
    if s.max_len > ctx:
        raise CortiqError(f"{model_path}: --max-len {s.max_len} is past the model's context of {ctx} tokens "
                          "(max_position_embeddings)")
    max_len = s.max_len or min(ctx, 4096)
    nb = s.branches(f.arch, dev)
    rows = nb * s.draft + 1
    if s.speculative and rows >= max_len:
        raise CortiqError(f"serve: a round of --draft {s.draft} on {nb} branches verifies {rows} positions, "
                          f"and the context is {max_len}: lower --draft or --draft-branches")
    # (auto on the loop engine: the whole head, the one it drafts over)
    vocab = engine_ids(f, s.draft_vocab) if s.speculative and (s.draft_vocab or s.engine != "loop") else None
    if s.profile:
        check_profile(s.profile, s.profile_steps, f.path)
    return max_len, nb, vocab


def profile_paths(profile: str, steps: int) -> list:
    """The files --profile writes: the JSON, and with --profile-steps the Chrome trace beside it."""
    from pathlib import Path

    out = Path(profile)
    return [out] + ([out.with_suffix(".trace.json")] if steps else [])


def check_profile(profile: str, steps: int, model) -> None:
    """--profile's folder exists and is writable, and no file it writes is the served model
    `model` or one of its files (store.check_output's rule)."""
    import os

    from ..errors import CortiqError
    from ..store import check_output

    outs = profile_paths(profile, steps)
    folder = outs[0].parent
    if not folder.is_dir():
        raise CortiqError(f"serve: --profile {profile}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CortiqError(f"serve: --profile {profile}: the folder {folder} is not writable")
    for out in outs:
        if out.is_dir():
            raise CortiqError(f"serve: --profile {profile}: {out} is a folder")
        check_output(out, [model])


def load(model_path: str, s, given: set[str] = frozenset()):
    """(Served, device, dtype) for a model file: the engine, scheduler and text side, not yet
    listening. `given`: the settings the command line names (`named`)."""
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
    max_len, nb, vocab = check_start(model_path, s, f, given, dev)
    tok = from_doc(f.tokenizer, str(model_path))
    model = load_model(f, dtype=dt, device=dev)
    if s.speculative and model.mtp is None:
        raise CortiqError(f"{model_path}: has no MTP draft block (model.mtp.*): --speculative needs one "
                          "(cortiq mtp init / mtp heal give it one)")
    check_kv_room(model.arch, s.max_batch, max_len, s.draft if s.speculative else 0, dt, dev, nb,
                  0 if vocab is None else len(vocab))
    engine = make_engine(model, s.max_batch, max_len, draft=s.draft if s.speculative else 0, kind=s.engine,
                         branches=nb, draft_vocab=vocab)
    doc = f.tokenizer or {}
    eos_ids = [int(i) for i in doc.get("eos_ids") or []]
    bos_id = doc.get("bos_id")
    bos = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos = tok.id_to_token(eos_ids[0]) if eos_ids else ""
    sched = Scheduler(engine, tok, eos_ids, speculative=s.speculative, max_waiting=s.max_waiting,
                      spec_auto=s.spec_auto, prefill_chunk=s.prefill_chunk)
    if s.profile and s.profile_steps:
        sched.trace(s.profile_steps, str(profile_paths(s.profile, s.profile_steps)[1]))
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


def round_bytes(arch, slots: int, max_len: int, draft: int, branches: int = 1) -> int:
    """An estimate of a speculative round's largest working buffers: every head's attention
    scores of its verify rows (branches·draft + 1 a slot) over the whole cache, in f32, and a
    draft tree's ancestry masks (a square of its rows for each depth)."""
    from ..model.decode import cache_len
    from ..serve.engine import DecodeAdapter

    if not draft:
        return 0
    rows = branches * draft + 1
    m = cache_len(DecodeAdapter.engine_len(max_len, draft), draft, branches)
    masks = 0
    if branches > 1:
        masks = sum((1 + branches * d) ** 2 for d in range(1, draft + 1)) + (branches * (draft - 1)) ** 2
    return 4 * slots * arch.num_heads * rows * m + masks


def check_kv_room(arch, slots: int, max_len: int, draft: int, dtype, device, branches: int = 1,
                  draft_rows: int = 0) -> None:
    """Refuse a KV cache (and a round's buffers, the narrowed draft head's `draft_rows` rows among
    them) larger than the memory left on `device`, before they are allocated."""
    import torch

    from ..devices import free_memory
    from ..errors import CortiqError

    head = draft_rows * arch.hidden_size * torch.empty((), dtype=dtype).element_size() if draft else 0
    need = kv_bytes(arch, slots, max_len, draft, dtype, branches) + round_bytes(arch, slots, max_len, draft,
                                                                                branches) + head
    free = free_memory(device)
    if need > free:
        what, lower = ((" (with a round's buffers)", ", --max-batch, --draft or --draft-branches") if draft
                       else ("", " or --max-batch"))
        raise CortiqError(f"serve: the KV cache of {slots} slots x {max_len} tokens needs {need / 1e9:.1f} GB{what}, "
                          f"{device} has {free / 1e9:.1f} GB free: lower --max-len{lower}")


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
    served, dev, dt = load(args.model, s, named(getattr(args, "_argv", None), s))
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
    auto = (f", {eng.branches} branches" if eng.branches > 1 else "") + (
        f", among {eng.draft_rows} tokens" if eng.draft_rows else "") + (", auto" if s.spec_auto else "")
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

        write_profile(s.profile, json.dumps({**served.scheduler.profile(), **served.profile}, indent=2))
    return 0


def write_profile(path: str, text: str) -> None:
    """`text` into `path` whole (through PATH.partial, renamed once written); a failed write is
    one line naming `path`, and leaves no .partial."""
    import contextlib
    import os

    from ..errors import write_error
    from ..store import write_text

    try:
        write_text(path, text)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".partial")
        raise write_error(path, e) from None
