"""The server's side of OpenAI's wire format: the request bodies, read strictly, and the
shape of an error.

A body is UTF-8 JSON (no NaN or Infinity, bounded nesting), an object whose fields have
exactly their declared types: nothing is coerced, and a field the server does not know is
refused rather than ignored. Every refusal is an `ApiError`, which the application answers
as {"error": {"message", "type", "param", "code"}} with `param` naming the field at fault.
This module imports pydantic (the serve extra), not fastapi.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from .sampling import temperature_error, top_p_error

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ── request bodies (unknown fields are refused rather than silently ignored) ──
class CommonBody(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)

    # the sampler's own rules (serve.sampling), so that no request's row can fail a batch
    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        return _sampling(v, temperature_error(v))

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        return _sampling(v, top_p_error(v))


def _sampling(v: float, why: str | None) -> float:
    if why:
        raise PydanticCustomError("sampling", why)
    return v


class CompletionBody(CommonBody):
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


class ChatBody(CommonBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False)


def invalid_fields(errs: list) -> ApiError:
    """One 400 for pydantic's errors: `param` is the top-level field at fault (never a
    character position or a union member's type name), the message the distinct reasons."""
    locs = [[x for x in e.get("loc", ()) if x != "body"] for e in errs]
    param = str(locs[0][0]) if locs and locs[0] and isinstance(locs[0][0], str) else None
    why = list(dict.fromkeys(e.get("msg", "invalid") for e, loc in zip(errs, locs) if (loc[:1] or [None])[0] == param))
    return ApiError(400, f"{param + ': ' if param else ''}{' or '.join(why[:3]) or 'invalid request'}", param)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body `raw` as `model`, strictly: UTF-8 JSON (no NaN or Infinity, bounded
    nesting), an object whose fields have exactly their declared types (no string or boolean
    is coerced: `"stream": "yes"` and a prompt of booleans are refused). Any failure is an
    ApiError (400)."""
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
    if _SURROGATE.search(text):
        _check_unicode(obj)
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        raise invalid_fields(e.errors()) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


#: a JSON escape of a UTF-16 surrogate, the only way a parsed string can hold one (UTF-8 cannot)
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_unicode(obj: dict) -> None:
    """Refuse (400, naming the field) a body holding a string that is not text: a lone UTF-16
    surrogate (`"a\\udc80b"`; a pair is one character, and fine) cannot be encoded as UTF-8,
    so no tokenizer, template or answer could take it."""
    for key, value in obj.items():
        if not _encodes(key):
            raise ApiError(400, "a field name is not valid Unicode (a lone UTF-16 surrogate)", code="invalid_string")
        todo = [value]
        while todo:
            v = todo.pop()
            if isinstance(v, str):
                ok = _encodes(v)
            elif isinstance(v, dict):
                ok = all(_encodes(k) for k in v)
                todo += v.values()
            else:
                ok = True
                if isinstance(v, list):
                    todo += v
            if not ok:
                raise ApiError(400, f"{key}: a string that is not valid Unicode (a lone UTF-16 surrogate)", key,
                               "invalid_string")


def stops(stop) -> list[str]:
    """A body's `stop` as a list, within OpenAI's limits."""
    out = [stop] if isinstance(stop, str) else list(stop or [])
    if len(out) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} strings, got {len(out)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in out):
        raise ApiError(400, f"stop: each string must have 1..{MAX_STOP_CHARS} characters", "stop")
    return out
