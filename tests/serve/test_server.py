"""`cortiq serve` through the official openai client: completions, chat,
streaming, bad requests, concurrent requests, speculative decoding; the
server runs in a subprocess on a free 127.0.0.1 port and stops on SIGTERM."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cortiq.model import load_model
from cortiq.model.generate import generate
from cortiq.tokenizer import load_tokenizer

from serve_helpers import CHATML, EOS, Server

MODEL = "tiny"


@pytest.fixture(scope="module", params=["plain", "speculative", "auto", "auto-tree"])
def server(request, served_model, tmp_path_factory):
    extra = {"plain": [], "speculative": ["--speculative", "--draft", "2", "--no-spec-auto"],
             # speculation chosen per step (serve's default), prompts prefilled 4 tokens a turn
             "auto": ["--speculative", "--draft", "2", "--prefill-chunk", "4"],
             # chain and tree rounds of 3 first guesses chosen per step
             "auto-tree": ["--speculative", "--draft", "2", "--spec-auto", "--draft-branches", "3"]}[request.param]
    srv = Server(served_model, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch", "3", "--max-len", "200",
                 "--max-body-kb", "16", *extra)
    yield srv
    rc = srv.stop()
    log = srv.log.read_text()
    assert rc == 0, log  # SIGTERM is a clean shutdown
    assert "cortiq serve: stopped after" in log and "Traceback" not in log
    assert ("speculative rounds" in log) == (request.param != "plain")


@pytest.fixture(scope="module")
def reference(served_model):
    """Plain greedy decoding in this process: the text a temperature-0 request must get."""
    model, tok = load_model(served_model), load_tokenizer(served_model)

    def greedy(prompt: str, max_tokens: int, special: bool = True) -> tuple[str, str]:
        ids = tok.encode(prompt, add_special_tokens=special).ids
        out = generate(model, ids, max_new=max_tokens, eos_ids=[EOS]).tokens
        return tok.decode(out, skip_special_tokens=True), ("stop" if out[-1] == EOS else "length")

    return greedy


def _chat_prompt(messages):
    from cortiq.serve.chat import chat_prompt

    return chat_prompt(CHATML, messages)


def test_models(server):
    ids = [m.id for m in server.client().models.list().data]
    assert ids == [MODEL]


def _metrics(server) -> dict:
    r = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    types = {ln.split()[2]: ln.split()[3] for ln in lines if ln.startswith("# TYPE ")}
    values = {ln.split()[0]: int(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}
    assert set(values) == set(types) and all(v >= 0 for v in values.values())
    assert all(types[n] == ("counter" if n.endswith("_total") else "gauge") for n in types)
    return values


def test_metrics_count_a_request(server):
    before = _metrics(server)
    r = server.client().completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    after = _metrics(server)
    d = {k: after[k] - before[k] for k in after}
    assert d["cortiq_requests_total"] == 1
    assert d["cortiq_generation_tokens_total"] == r.usage.completion_tokens
    # every token after the first (the prefill's) comes from a plain step or a round (of 1..3 tokens: draft 2)
    assert d["cortiq_decode_steps_total"] + d["cortiq_spec_round_tokens_total"] >= r.usage.completion_tokens - 1
    rounds, round_tokens = d["cortiq_spec_rounds_total"], d["cortiq_spec_round_tokens_total"]
    if "speculative" in server.log.read_text().splitlines()[0]:
        assert rounds <= round_tokens <= 3 * rounds
    else:
        assert rounds == round_tokens == 0


def test_completion_is_greedy_decoding(server, reference):
    c = server.client()
    for prompt, n in [("The quick brown fox", 24), ("x", 5), ("Sphinx of black quartz, judge my vow.", 40)]:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        text, finish = reference(prompt, n)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
        assert r.usage.prompt_tokens == len(prompt.encode())
        assert 1 <= r.usage.completion_tokens <= n


def test_chat_uses_the_template(server, reference):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0)
    text, finish = reference(_chat_prompt(msgs), 30, special=False)
    assert r.choices[0].message.role == "assistant"
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)


def test_streamed_text_equals_the_whole_answer(server):
    c = server.client()
    whole = c.completions.create(model=MODEL, prompt="Pack my box", max_tokens=40, temperature=0)
    parts, finish = [], None
    for ch in c.completions.create(model=MODEL, prompt="Pack my box", max_tokens=40, temperature=0, stream=True):
        parts.append(ch.choices[0].text)
        finish = ch.choices[0].finish_reason or finish
    assert len(parts) > 2 and "".join(parts) == whole.choices[0].text and finish == whole.choices[0].finish_reason

    msgs = [{"role": "user", "content": "hello"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_requests_equal_their_sequential_answers(server):
    c = server.client()
    prompts = ["How vexingly quick", "daft zebras jump", "The lazy dog", "0: The quick", "Judge my vow"]
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0).choices[0].text
             for p in prompts]

    def one(i):
        p = prompts[i]
        if i % 2:  # streaming and plain requests share the batch
            return "".join(ch.choices[0].text for ch in
                           c.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0, stream=True))
        return c.completions.create(model=MODEL, prompt=p, max_tokens=30, temperature=0).choices[0].text

    # 5 requests on 3 slots: they batch, and two wait for a slot to free
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, range(len(prompts))))
    assert together == alone


def test_seed_top_p_and_stop(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=1.2, top_p=0.9)
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert c.completions.create(seed=7, **kw).choices[0].text == a
    assert len({c.completions.create(seed=s, **kw).choices[0].text for s in range(4)}) > 1
    greedy = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0)
    full = greedy.choices[0].text
    stop = full[5:7]
    r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=30, temperature=0, stop=[stop, "@@"])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def _error(e) -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_prompt_that_fills_the_context(server):
    ctx = httpx.get(server.url + "/models").json()["data"][0]["max_model_len"]
    assert ctx <= 200
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="x" * (ctx - 1), max_tokens=50, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x" * ctx, max_tokens=50, temperature=0)
    assert _error(e.value)["code"] == "context_length_exceeded"


def test_bad_requests_get_json_errors(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", temperature=3.5)
    err = _error(e.value)
    assert err["type"] == "invalid_request_error" and err["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", logit_bias={"5": 1})
    assert _error(e.value)["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x" * 300)
    assert _error(e.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[])
    assert _error(e.value)["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-9", prompt="hi")
    assert _error(e.value)["code"] == "model_not_found"
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = h.post("/completions", content=json.dumps({"model": MODEL, "prompt": "a" * 20000}))
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        # the server still answers after all of that
        assert h.post("/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200
