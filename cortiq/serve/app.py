"""The HTTP side: an OpenAI-compatible FastAPI application over a `Scheduler`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` answers as server-sent events, ending with `data: [DONE]`), and
GET /metrics: the scheduler's counters in Prometheus' text format (`METRICS`).
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}},
the framework's own included: 400 for a request the server cannot serve as
asked (a body that is not a UTF-8 JSON object of exactly the declared types:
nothing is coerced; `protocol` reads it; a prompt over the server's character
bound, refused before it is tokenized), 404 for another model name or an
unknown path, 405 for a wrong method, 413 for a body over the limit, 429 when
the waiting queue is full.

Prompts are rendered and tokenized on worker threads, not on the event loop: a
long prompt's tokenizing would hold up every other request's events meanwhile.
Long ones take turns on a few threads, so a burst of them leaves cores free
(bench/serve/isolation.py measures what a small request waits meanwhile).

The handlers are module-level functions over one `Served` (what the application
serves), which `build_app` puts on the application's state.
This module imports fastapi: only the serve command imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from anyio import CapacityLimiter, to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ..chat import ChatTemplateError
from .chat import chat_prompt
from .protocol import ApiError, ChatBody, CommonBody, CompletionBody, error_body, invalid_fields, parse_body, stops
from .scheduler import Busy, Event, Outbox, Refused, Request as GenRequest, Scheduler, merged


@dataclass
class Served:
    """What the application serves: the scheduler and the model's text side."""

    scheduler: Scheduler
    tokenizer: object
    model_id: str
    max_len: int
    chat_template: str | None = None
    bos: str = ""
    eos: str = ""
    max_body: int = 1 << 20
    #: the longest prompt (characters, a chat's rendered prompt included) tokenized; longer ones get a 400
    max_prompt_chars: int = 1 << 17
    #: the HTTP side's share of a profile: seconds writing SSE chunks, chunks, loop wake-ups
    profile: dict = field(default_factory=lambda: {"sse_seconds": 0.0, "sse_chunks": 0})
    #: one Outbox per event loop that submits requests (the scheduler thread posts events through it)
    outboxes: dict = field(default_factory=dict)
    #: the threads long prompts are tokenized on, a few at once (`_tokenize`)
    long_lane: CapacityLimiter = field(default_factory=lambda: CapacityLimiter(max(1, (os.cpu_count() or 2) // 2)))


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before the
    application reads it (the body is read here, at most limit + 1 bytes, and
    handed on unchanged; later receives, such as a disconnect, pass through)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.limit
        chunks, size, more = [], 0, not too_big
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                chunks.append(msg)
                break
            chunks.append(msg)
            size += len(msg.get("body", b""))
            more = msg.get("more_body", False)
            if size > self.limit:
                too_big = True
                break
        if too_big:
            resp = JSONResponse(error_body(f"the request body is over the limit of {self.limit} bytes", param=None,
                                           code="request_too_large"), status_code=413)
            return await resp(scope, receive, send)
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        disconnect = [m for m in chunks if m["type"] != "http.request"]
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            if disconnect:
                return disconnect[0]
            return await receive()

        return await self.app(scope, replay, send)


#: GET /metrics, Prometheus' text format: (name, type, help, key of `Scheduler.counters`).
#: Tokens a speculative round over a span of time = Δ round_tokens / Δ rounds.
METRICS = (
    ("cortiq_requests_total", "counter", "Requests prefilled (their first token decided).", "requests"),
    ("cortiq_generation_tokens_total", "counter", "Tokens decided and sent.", "tokens"),
    ("cortiq_decode_steps_total", "counter", "Plain decode steps run.", "steps"),
    ("cortiq_spec_rounds_total", "counter", "Requests' speculative rounds (a round of a batch counts for each request "
     "in it).", "rounds"),
    ("cortiq_spec_round_tokens_total", "counter", "Tokens those rounds decided (the drafts kept plus the trunk's own).",
     "round_tokens"),
    ("cortiq_requests_running", "gauge", "Requests decoding now.", "running"),
    ("cortiq_requests_waiting", "gauge", "Requests waiting for a slot or in prefill now.", "waiting"),
)


def metrics_text(counters: dict) -> str:
    """`Scheduler.counters()` in Prometheus' text exposition format (version 0.0.4)."""
    lines = []
    for name, kind, doc, key in METRICS:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {counters[key]}"]
    return "\n".join(lines) + "\n"


# ── the application's life and its errors ──
@asynccontextmanager
async def _lifespan(app: FastAPI):
    sched = app.state.served.scheduler
    sched.start()
    try:
        yield
    finally:
        sched.stop()


async def _api_error(request: Request, e: ApiError):
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status)


async def _invalid(request: Request, e: RequestValidationError):
    return await _api_error(request, invalid_fields(list(e.errors())))


async def _http(request: Request, e: HTTPException):
    # the framework's own refusals (an unknown path, a wrong method) in the same shape
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    msg = {404: f"no such endpoint: {request.url.path}",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
    return JSONResponse(error_body(msg, param=None, code=code), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _crash(request: Request, e: Exception):
    return JSONResponse(error_body("the server failed on this request", "server_error"), status_code=500)


# ── the endpoints ──
async def metrics(request: Request):
    counters = request.app.state.served.scheduler.counters()
    return PlainTextResponse(metrics_text(counters), media_type="text/plain; version=0.0.4")


async def models(request: Request):
    served: Served = request.app.state.served
    return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                        "owned_by": "cortiq", "max_model_len": served.max_len}]}


async def completions(request: Request):
    served: Served = request.app.state.served
    body = await _accept(served, request, CompletionBody, "echo")
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise ApiError(400, "one prompt per request (a list of several prompts is not supported)", "prompt")
        p = p[0]
    if isinstance(p, str):
        ids = await _tokenize(served, len(p), "prompt", _encode, served, p, True)
    else:
        vocab = served.scheduler.engine.vocab_size
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:4]} are outside the vocabulary (0..{vocab - 1})", "prompt")
        ids = list(p)
    req = _request(served, body, ids, body.max_tokens if body.max_tokens is not None else 16)
    return await _serve(served, req, body, "text")


async def chat(request: Request):
    served: Served = request.app.state.served
    body = await _accept(served, request, ChatBody, "logprobs")
    msgs = []
    for m in body.messages:
        c = m.content
        text = c if isinstance(c, str) or c is None else "".join(part.text for part in c)
        msgs.append({"role": m.role, "content": text or ""})
    ids = await _tokenize(served, sum(len(m["content"]) for m in msgs), "messages", _chat_ids, served, msgs)
    req = _request(served, body, ids, body.max_completion_tokens or body.max_tokens)
    return await _serve(served, req, body, "chat")


# ── what the endpoints share ──
def _bound(served: Served, chars: int, param: str) -> None:
    """Refuse a prompt over the character bound before any work is spent on it."""
    if chars > served.max_prompt_chars:
        raise ApiError(400, f"the prompt has {chars} characters; this server takes at most {served.max_prompt_chars} "
                       "(--max-prompt-chars)", param, "prompt_too_long")


#: prompts of more characters are tokenized in `Served.long_lane`, at most half the cores' worth at
#: once, so that a burst of them leaves cores to the event loop and the scheduler's thread
LONG_PROMPT = 1 << 14


async def _tokenize(served: Served, chars: int, param: str, fn, *args) -> list[int]:
    """`fn(*args)`: the token ids of a prompt of `chars` characters (the field `param`), refused
    over the bound before any work, else made on a worker thread (in the long lane if it is long)."""
    _bound(served, chars, param)
    return await to_thread.run_sync(fn, *args, limiter=served.long_lane if chars > LONG_PROMPT else None)


def _encode(served: Served, text: str, special: bool) -> list[int]:
    """The token ids of `text` (on a worker thread: the tokenizers library lets other threads
    run during a batch call, not during `encode`, so one text goes through `encode_batch`)."""
    return served.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids


def _chat_ids(served: Served, msgs: list[dict]) -> list[int]:
    """The token ids of a conversation under the model's chat template (on a worker thread)."""
    try:
        prompt = chat_prompt(served.chat_template, msgs, bos_token=served.bos, eos_token=served.eos)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages") from None
    _bound(served, len(prompt), "messages")
    return _encode(served, prompt, False)


async def _accept(served: Served, request: Request, model: type[BaseModel], unsupported: str) -> BaseModel:
    """The body, for the model this server serves, without the one option of its kind it refuses."""
    body = parse_body(await request.body(), model)
    if body.model != served.model_id:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {served.model_id!r}",
                       "model", "model_not_found")
    if getattr(body, unsupported):
        raise ApiError(400, f"{unsupported} is not supported", unsupported)
    return body


def _request(served: Served, body: CommonBody, ids: list[int], max_tokens: int | None) -> GenRequest:
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", "prompt")
    room = served.max_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {served.max_len}",
                       "messages" if isinstance(body, ChatBody) else "prompt", "context_length_exceeded")
    if body.stream_options and set(body.stream_options) - {"include_usage"}:
        raise ApiError(400, "stream_options: only include_usage is supported", "stream_options")
    return GenRequest(ids=ids, max_tokens=min(max_tokens or room, room), temperature=body.temperature,
                      top_p=body.top_p, seed=body.seed, stop=stops(body.stop))


def _usage(req: GenRequest, ev: Event) -> dict:
    return {"prompt_tokens": len(req.ids), "completion_tokens": ev.tokens, "total_tokens": len(req.ids) + ev.tokens}


def _queue_nowait(q):
    while not q.empty():
        yield q.get_nowait()


async def _events(served: Served, req: GenRequest):
    """Submit `req` and yield its events (those that queued up while the consumer was
    busy as one); a consumer that goes away cancels it."""
    loop = asyncio.get_running_loop()
    box = served.outboxes.get(loop)
    if box is None:
        box = served.outboxes[loop] = Outbox(loop)
        served.profile["outbox"] = box.stats
    q: asyncio.Queue[Event] = asyncio.Queue()
    req.sink = lambda ev: box.post(q, ev)
    try:
        served.scheduler.submit(req)
    except Busy as e:
        raise ApiError(429 if "waiting" in str(e) else 503, str(e), code="server_busy", kind="server_error") from None
    except Refused as e:
        raise ApiError(400, str(e), e.param) from None
    try:
        while True:
            ev = merged(await q.get(), _queue_nowait(q))
            yield ev
            if ev.finish:
                return
    finally:
        req.cancel()


async def _first(gen):
    """The first event now (so a refusal is an HTTP error, not a broken stream)."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return Event(finish="error", error="no answer")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _choice(kind: str, stream: bool, text: str | None, finish: str | None) -> dict:
    """One choice of an answer (`stream`: of a chunk of one) in OpenAI's shape for `kind`."""
    if kind == "chat":
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None}
        return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish,
                "logprobs": None}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


async def _serve(served: Served, req: GenRequest, body: CommonBody, kind: str):
    """Run `req` and answer it: one JSON object, or (`body.stream`) a stream of server-sent events."""
    head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": served.model_id}
    gen = _events(served, req)
    first = await _first(gen)
    if first.finish == "error":
        await gen.aclose()
        raise ApiError(500, first.error, kind="server_error")
    if not body.stream:
        return await _whole(req, gen, first, head, kind)
    usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(_stream(served, req, gen, first, head, kind, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _whole(req: GenRequest, gen, first: Event, head: dict, kind: str) -> dict:
    """The answer as one object, once its last event is in."""
    parts, ev = [first.text], first
    while not ev.finish:
        ev = await gen.__anext__()
        parts.append(ev.text)
    if ev.finish == "error":
        raise ApiError(500, ev.error, kind="server_error")
    return {**head, "object": "chat.completion" if kind == "chat" else "text_completion",
            "choices": [_choice(kind, False, "".join(parts), ev.finish)], "usage": _usage(req, ev)}


async def _stream(served: Served, req: GenRequest, gen, first: Event, head: dict, kind: str, usage: bool):
    """The answer's server-sent events, from `first` on; an error mid-answer is an error event."""
    chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
    prof = served.profile
    try:
        if kind == "chat":
            yield _sse({**head, "object": chunk, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]})
        ev = first
        while True:
            if ev.finish == "error":
                yield _sse(error_body(ev.error, "server_error"))
                break
            if ev.text:
                t0 = time.perf_counter()
                line = _sse({**head, "object": chunk, "choices": [_choice(kind, True, ev.text, None)]})
                prof["sse_seconds"] += time.perf_counter() - t0
                prof["sse_chunks"] += 1
                yield line
            if ev.finish:
                yield _sse({**head, "object": chunk, "choices": [_choice(kind, True, None, ev.finish)]})
                if usage:
                    yield _sse({**head, "object": chunk, "choices": [], "usage": _usage(req, ev)})
                break
            ev = await gen.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()


def build_app(served: Served) -> BodyLimit:
    """The application serving `served`, behind the body limit."""
    app = FastAPI(title="cortiq", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _crash)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return BodyLimit(app, served.max_body)
