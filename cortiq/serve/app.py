"""The HTTP side: an OpenAI-compatible FastAPI application over a `Scheduler`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` answers as server-sent events, ending with `data: [DONE]`), and
GET /metrics: the scheduler's counters in Prometheus' text format (`METRICS`).
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}},
the framework's own included: 400 for a request the server cannot serve as
asked (a body that is not a UTF-8 JSON object of exactly the declared types:
nothing is coerced), 404 for another model name or an unknown path, 405 for a
wrong method, 413 for a body over the limit, 429 when the waiting queue is full.
This module imports fastapi: only the serve command imports it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from ..chat import ChatTemplateError
from .chat import chat_prompt
from .scheduler import Busy, Event, Outbox, Request as GenRequest, Scheduler, merged

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256


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
    #: the HTTP side's share of a profile: seconds writing SSE chunks, chunks, loop wake-ups
    profile: dict = field(default_factory=lambda: {"sse_seconds": 0.0, "sse_chunks": 0})


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def _error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ── request bodies (unknown fields are refused rather than silently ignored) ──
class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = Field(default=False)
    logprobs: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False)


def _invalid_fields(errs: list) -> ApiError:
    """One 400 for pydantic's errors: `param` is the top-level field at fault (never a
    character position or a union member's type name), the message the distinct reasons."""
    locs = [[x for x in e.get("loc", ()) if x != "body"] for e in errs]
    param = str(locs[0][0]) if locs and locs[0] and isinstance(locs[0][0], str) else None
    why = list(dict.fromkeys(e.get("msg", "invalid") for e, loc in zip(errs, locs) if (loc[:1] or [None])[0] == param))
    return ApiError(400, f"{param + ': ' if param else ''}{' or '.join(why[:3]) or 'invalid request'}", param)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, strictly: UTF-8 JSON (no NaN or Infinity, bounded nesting),
    an object whose fields have exactly their declared types (no string or boolean is coerced:
    `"stream": "yes"` and a prompt of booleans are refused). Any failure is an ApiError (400)."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start})", code="invalid_json") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError included
        raise ApiError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body is a JSON {type(obj).__name__}, not an object", code="invalid_json")
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        raise _invalid_fields(e.errors()) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop: each string must have 1..{MAX_STOP_CHARS} characters", "stop")
    return stops


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
            resp = JSONResponse(_error_body(f"the request body is over the limit of {self.limit} bytes", param=None,
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


def build_app(served: Served) -> FastAPI:
    sched = served.scheduler

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        try:
            yield
        finally:
            sched.stop()

    app = FastAPI(title="cortiq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(_error_body(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return await _api_error(request, _invalid_fields(list(e.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        # the framework's own refusals (an unknown path, a wrong method) in the same shape
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = {404: f"no such endpoint: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(_error_body(msg, param=None, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        return JSONResponse(_error_body("the server failed on this request", "server_error"), status_code=500)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(sched.counters()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model", "created": 0,
                                            "owned_by": "cortiq", "max_model_len": served.max_len}]}

    async def _accept(request: Request, model: type[BaseModel], unsupported: str) -> BaseModel:
        """The body, for the model this server serves, without the one option of its kind it refuses."""
        body = await parse_body(request, model)
        if body.model != served.model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {served.model_id!r}",
                           "model", "model_not_found")
        if getattr(body, unsupported):
            raise ApiError(400, f"{unsupported} is not supported", unsupported)
        return body

    def _request(body: _Common, ids: list[int], max_tokens: int | None) -> GenRequest:
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        room = served.max_len - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {served.max_len}",
                           "messages" if isinstance(body, ChatBody) else "prompt", "context_length_exceeded")
        if body.stream_options and set(body.stream_options) - {"include_usage"}:
            raise ApiError(400, "stream_options: only include_usage is supported", "stream_options")
        return GenRequest(ids=ids, max_tokens=min(max_tokens or room, room), temperature=body.temperature,
                          top_p=body.top_p, seed=body.seed, stop=_stops(body.stop))

    def _usage(req: GenRequest, ev: Event) -> dict:
        return {"prompt_tokens": len(req.ids), "completion_tokens": ev.tokens,
                "total_tokens": len(req.ids) + ev.tokens}

    outboxes: dict = {}

    def _queue_nowait(q):
        while not q.empty():
            yield q.get_nowait()

    async def _events(req: GenRequest):
        """Submit `req` and yield its events (those that queued up while the consumer was
        busy as one); a consumer that goes away cancels it."""
        loop = asyncio.get_running_loop()
        box = outboxes.get(loop)
        if box is None:
            box = outboxes[loop] = Outbox(loop)
            served.profile["outbox"] = box.stats
        q: asyncio.Queue[Event] = asyncio.Queue()
        req.sink = lambda ev: box.post(q, ev)
        try:
            sched.submit(req)
        except Busy as e:
            raise ApiError(429 if "waiting" in str(e) else 503, str(e), code="server_busy",
                           kind="server_error") from None
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

    async def _serve(req: GenRequest, stream: bool, include_usage: bool, kind: str):
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        gen = _events(req)
        first = await _first(gen)
        if first.finish == "error":
            await gen.aclose()
            raise ApiError(500, first.error, kind="server_error")

        def choice(text: str | None, finish: str | None, final: bool):
            if kind == "chat":
                if not stream:
                    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                            "logprobs": None}
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        obj = "chat.completion" if kind == "chat" else "text_completion"
        head = {"id": rid, "created": created, "model": served.model_id}
        if not stream:
            parts, ev = [first.text], first
            while not ev.finish:
                ev = await gen.__anext__()
                parts.append(ev.text)
            if ev.finish == "error":
                raise ApiError(500, ev.error, kind="server_error")
            return {**head, "object": obj, "choices": [choice("".join(parts), ev.finish, True)],
                    "usage": _usage(req, ev)}

        async def body():
            chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
            try:
                if kind == "chat":
                    yield _sse({**head, "object": chunk, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None}]})
                ev = first
                while True:
                    if ev.finish == "error":
                        yield _sse(_error_body(ev.error, "server_error"))
                        break
                    if ev.text:
                        t0 = time.perf_counter()
                        line = _sse({**head, "object": chunk, "choices": [choice(ev.text, None, False)]})
                        served.profile["sse_seconds"] += time.perf_counter() - t0
                        served.profile["sse_chunks"] += 1
                        yield line
                    if ev.finish:
                        yield _sse({**head, "object": chunk, "choices": [choice(None, ev.finish, True)]})
                        if include_usage:
                            yield _sse({**head, "object": chunk, "choices": [], "usage": _usage(req, ev)})
                        break
                    ev = await gen.__anext__()
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _accept(request, CompletionBody, "echo")
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "one prompt per request (a list of several prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, str):
            ids = served.tokenizer.encode(p).ids
        else:
            bad = [t for t in p if not 0 <= t < sched.engine.vocab_size]
            if bad:
                raise ApiError(400, f"token ids {bad[:4]} are outside the vocabulary (0..{sched.engine.vocab_size - 1})",
                               "prompt")
            ids = list(p)
        req = _request(body, ids, body.max_tokens if body.max_tokens is not None else 16)
        return await _serve(req, body.stream, bool((body.stream_options or {}).get("include_usage")), "text")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _accept(request, ChatBody, "logprobs")
        msgs = []
        for m in body.messages:
            c = m.content
            text = c if isinstance(c, str) or c is None else "".join(part.text for part in c)
            msgs.append({"role": m.role, "content": text or ""})
        try:
            prompt = chat_prompt(served.chat_template, msgs, bos_token=served.bos, eos_token=served.eos)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = served.tokenizer.encode(prompt, add_special_tokens=False).ids
        req = _request(body, ids, body.max_completion_tokens or body.max_tokens)
        return await _serve(req, body.stream, bool((body.stream_options or {}).get("include_usage")), "chat")

    return BodyLimit(app, served.max_body)
