"""Every refusal of `cortiq serve` in OpenAI's shape, {"error": {"message", "type", "param",
"code"}} with a 4xx, the framework's own ones included (a body that is not JSON, not UTF-8, too
deeply nested, truncated; an unknown path; a wrong method), and strict types: no string or
boolean is coerced. Raw HTTP through httpx, and the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from serve_helpers import Server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    srv = Server(served_model, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch", "2", "--max-len", "64")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()
    assert "Traceback" not in srv.log.read_text()


def _shaped(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("name, content, match", [
    ("unparseable", b"{not json", "not JSON"),
    ("truncated", b'{"model": "tiny", "prompt": "a', "not JSON"),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe"}', "not UTF-8"),
    ("100k deep", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("a list", b"[1, 2]", "not an object"),
    ("NaN", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "NaN is not a JSON value"),
])
def test_a_body_that_is_not_a_json_object(name, content, match, server):
    for path in ("/completions", "/chat/completions"):
        err = _shaped(httpx.post(server.url + path, content=content, headers=JSON, timeout=60), 400, None)
        assert match in err["message"] and err["type"] == "invalid_request_error"


def test_an_unknown_path_and_a_wrong_method(server):
    err = _shaped(httpx.post(server.url + "/nowhere", json={}, timeout=60), 404)
    assert err["code"] == "not_found" and "/v1/nowhere" in err["message"]
    err = _shaped(httpx.get(server.url + "/completions", timeout=60), 405)
    assert err["code"] == "method_not_allowed"
    _shaped(httpx.delete(server.url + "/models", timeout=60), 405)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/completions", {"prompt": [True, False]}, "prompt"),
    ("/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/completions", {"prompt": "hi", "temperature": "0"}, "temperature"),
    ("/completions", {"prompt": "hi", "seed": "7"}, "seed"),
    ("/completions", {"prompt": 5}, "prompt"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "true"}, "stream"),
    ("/chat/completions", {"messages": "hi"}, "messages"),
])
def test_strict_types(path, body, param, server):
    err = _shaped(httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60), 400, param)
    assert err["message"].startswith(param + ": ")


def test_the_openai_client_sees_the_field(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=[True, False], max_tokens=2)
    assert e.value.response.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"stream": "yes"})
    assert e.value.response.json()["error"]["param"] == "stream"
    # what is right still works, ints where floats go included
    r = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0, top_p=1)
    assert r.usage.prompt_tokens == 3
