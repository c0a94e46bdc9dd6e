"""One request cannot break the others: sampling parameters that would keep no token are
refused before they reach a batch, a failure in one request's own work ends that request
alone (the others' tokens unchanged), a failed batched step ends the requests it ran and
the server goes on; prompts are bounded and tokenized off the event loop; a string that is
not text is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

import cortiq.serve.scheduler as scheduler_mod
from cortiq.serve.detok import IncrementalText
from cortiq.serve.engine import DecodeAdapter
from cortiq.serve.sampling import sample_ids
from cortiq.serve.scheduler import Refused, Request, Scheduler

from serve_helpers import CHATML, EOS, Server, arch, random_model
from test_pipeline import PROMPTS, _tok

MODEL = "tiny"


# ── the scheduler: one request's failure ──
def _requests() -> list[Request]:
    """Four healthy requests (two greedy, two sampled) and, last, the one a test poisons."""
    return [Request(ids=PROMPTS[0], max_tokens=12), Request(ids=PROMPTS[2], max_tokens=12, temperature=0.8,
                                                            top_p=0.9, seed=3),
            Request(ids=PROMPTS[5], max_tokens=12), Request(ids=PROMPTS[6], max_tokens=12, temperature=1.2, seed=4),
            Request(ids=PROMPTS[7] * 3, max_tokens=12, temperature=0.7, top_p=0.5, seed=5)]


def _serve(eng, reqs: list[Request], before_start=None, **kw) -> list[tuple[str, str | None, str]]:
    """Every request submitted, then the scheduler started (so they share the first turns) ->
    per request (its text, its finish, its error)."""
    sched = Scheduler(eng, _tok(), [EOS], **kw)
    events = [[] for _ in reqs]
    done = [threading.Event() for _ in reqs]
    for r, evs, d in zip(reqs, events, done):
        r.sink = lambda ev, evs=evs, d=d: (evs.append(ev), ev.finish and d.set())
        sched.submit(r)
    if before_start is not None:
        before_start(reqs)
    sched.start()
    try:
        deadline = time.monotonic() + 120
        for r, d in zip(reqs, done):
            while not (d.wait(0.02) or r.cancelled):  # a cancelled request is told nothing more
                assert time.monotonic() < deadline, "a request neither finished nor was cancelled"
    finally:
        sched.stop()
    assert sched.counters()["running"] == 0 and not sched.prefilling
    return [("".join(e.text for e in evs), evs[-1].finish if evs else None, evs[-1].error if evs else "")
            for evs in events]


@pytest.fixture(scope="module")
def model():
    return random_model(arch("llama"), mix=0.5, seed=2)


def _fail_prefill(eng, poisoned: Request):
    prefill_job = eng.prefill_job

    def job_of(slot, ids, chunk=0):
        job = prefill_job(slot, ids, chunk)
        if list(ids) == poisoned.ids:
            run, runs = job.run, []

            def failing():  # the second chunk of its prompt fails
                runs.append(1)
                if len(runs) == 2:
                    raise RuntimeError("injected: its prefill failed")
                return run()

            job.run = failing
        return job

    eng.prefill_job = job_of


def _fail_first_token(monkeypatch):
    def sample(logits, temperature, top_p, u, greedy=None):
        if list(top_p) == [0.5]:  # the poisoned request's first token
            raise RuntimeError("injected: its first token failed")
        return sample_ids(logits, temperature, top_p, u, greedy)

    monkeypatch.setattr(scheduler_mod, "sample_ids", sample)


def _fail_text(monkeypatch, reqs):
    """The poisoned request's text fails to decode from its 4th token on (in the batched decode
    of every request's text, and alone)."""
    bad = reqs[-1].text
    add_many, add = IncrementalText.add_many, bad.add

    def many(texts, tokens):
        if any(x is bad and len(x.ids) >= 3 for x in texts):
            raise RuntimeError("injected: its text failed")
        return add_many(texts, tokens)

    def alone(tok):
        if len(bad.ids) >= 3:
            raise RuntimeError("injected: its text failed")
        return add(tok)

    monkeypatch.setattr(IncrementalText, "add_many", staticmethod(many))
    bad.add = alone


def _fail_sink(reqs):
    """The poisoned request's consumer goes away after its first event (its sink raises)."""
    r = reqs[-1]
    sink, seen = r.sink, []

    def gone(ev):
        seen.append(ev)
        if len(seen) > 1:
            raise RuntimeError("injected: its event loop is closed")
        sink(ev)

    r.sink = gone


@pytest.mark.parametrize("speculative", [False, True, "auto"])
@pytest.mark.parametrize("where", ["prefill", "first token", "text", "consumer"])
def test_a_failure_in_one_requests_work_ends_it_alone(model, where, speculative, monkeypatch, capsys):
    def engine():
        return DecodeAdapter(model, 5, 96, draft=2 if speculative else 0)

    kw = dict(speculative=bool(speculative), spec_auto=speculative == "auto", prefill_chunk=4)
    clean = _serve(engine(), _requests(), **kw)
    assert all(f in ("stop", "length") for _, f, _ in clean)
    eng, reqs = engine(), _requests()
    if where == "prefill":
        _fail_prefill(eng, reqs[-1])
    elif where == "first token":
        _fail_first_token(monkeypatch)
    hook = {"text": lambda rs: _fail_text(monkeypatch, rs), "consumer": _fail_sink}.get(where)
    got = _serve(eng, reqs, before_start=hook, **kw)
    assert got[:4] == clean[:4]  # the healthy requests' answers, token for token
    if where == "consumer":
        assert reqs[-1].cancelled  # dropped; nothing more to send it
    else:
        text, finish, error = got[-1]
        assert finish == "error" and "injected" in error
        assert "cortiq serve: a request failed: RuntimeError: injected" in capsys.readouterr().err


def test_a_failed_batched_step_ends_the_requests_it_ran_and_the_server_goes_on(model, capsys):
    """A step that fails may have written every slot it ran: those requests end (an error
    event); one still in prefill then is untouched, and is answered as it is alone."""
    short, long = Request(ids=[1, 2, 3], max_tokens=8), Request(ids=PROMPTS[5] * 2, max_tokens=8)
    alone = _serve(DecodeAdapter(model, 4, 96), [Request(ids=long.ids, max_tokens=8)], prefill_chunk=4)
    eng = DecodeAdapter(model, 4, 96)
    launch, calls = eng.launch, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the step failed")
        return launch(*a, **kw)

    eng.launch = failing
    # turn 1 prefills the short prompt whole and the long one's first chunk, then the step fails
    got = _serve(eng, [short, long], prefill_chunk=4)
    assert got[0][1] == "error" and "injected: the step failed" in got[0][2]
    assert got[1] == alone[0]
    assert "cortiq serve: decoding failed: RuntimeError: injected" in capsys.readouterr().err


def test_the_sampler_keeps_a_token_whatever_a_row_asks():
    """Rows whose top_p is 0 in float32 (1e-300, 5e-324) or whose logits are NaN keep their top
    token instead of failing the batch; the rows beside them choose as they do alone."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[5] = float("nan")
    T, P = [1.0, 1e-30, 0.8, 1.0, 1.2, 1.0], [1e-300, 1e-300, 0.9, 5e-324, 1.0, 0.9]
    u = [0.3, 0.9, 0.5, 0.7, 0.2, 0.4]
    got = sample_ids(logits, T, P, u).tolist()
    assert [got[b] for b in (0, 1, 3)] == [int(logits[b].argmax()) for b in (0, 1, 3)] and 0 <= got[5] < 50
    for b in (2, 4):
        assert got[b] == int(sample_ids(logits[b: b + 1], [T[b]], [P[b]], [u[b]])[0])


@pytest.mark.parametrize("field, kw", [("top_p", dict(temperature=1.0, top_p=1e-300)),
                                       ("top_p", dict(temperature=1.0, top_p=5e-324)),
                                       ("temperature", dict(temperature=1e-30, top_p=1e-300)),
                                       ("temperature", dict(temperature=float("nan"))),
                                       ("top_p", dict(temperature=1.0, top_p=float("inf"))),
                                       ("max_tokens", dict(max_tokens=0)),
                                       ("prompt", dict(ids=[1, 259]))])
def test_the_scheduler_refuses_a_row_that_could_fail_a_batch(model, field, kw):
    sched = Scheduler(DecodeAdapter(model, 2, 32), _tok(), [EOS])
    with pytest.raises(Refused) as e:
        sched.submit(Request(**{"ids": [1, 2], "max_tokens": 4, **kw}))
    assert e.value.param == field and str(e.value).startswith(field + ": ")
    assert not sched.waiting


# ── the HTTP side, in this process: tokenizing off the event loop, the prompt bound ──
class Recording:
    """The byte tokenizer, recording the threads its prompts are encoded on; a prompt starting
    with HOLD waits in its encode until `release` is set (`held`: whether it was)."""

    def __init__(self):
        self.tok, self.threads, self.texts = _tok(), [], []
        self.entered, self.release, self.held = threading.Event(), threading.Event(), None

    def encode_batch(self, texts, **kw):
        self.threads.append(threading.get_ident())
        self.texts += texts
        if texts[0].startswith("HOLD"):
            self.entered.set()
            self.held = self.release.wait(120)
        return self.tok.encode_batch(texts, **kw)

    def encode(self, text, **kw):
        return self.encode_batch([text], **kw)[0]

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _in_process(model, tok, go, **served):
    """`go(client)` against the application in this process (its scheduler started here)."""
    from cortiq.serve.app import Served, build_app

    sched = Scheduler(DecodeAdapter(model, 2, 64), tok, [EOS])
    app = build_app(Served(sched, tok, MODEL, 64, CHATML, **served))

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1") as c:
            return await go(c)

    sched.start()
    try:
        return asyncio.run(run())
    finally:
        sched.stop()


@pytest.mark.parametrize("lane", ["short", "long"])
def test_prompts_are_tokenized_off_the_event_loop(model, lane, monkeypatch):
    import cortiq.serve.app

    if lane == "long":  # the held prompt is long (tokenized in the lane of long ones, a few at once), "hi" is not
        monkeypatch.setattr(cortiq.serve.app, "LONG_PROMPT", 20)
    tok = Recording()

    async def go(c):
        loop = threading.get_ident()
        held = asyncio.create_task(c.post("/completions", json={"model": MODEL, "prompt": "HOLD" + "x" * 30,
                                                                  "max_tokens": 2, "temperature": 0}))
        while not tok.entered.is_set():  # the long prompt is in its encode now
            await asyncio.sleep(0.01)
        small = await c.post("/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        chat = await c.post("/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1})
        tok.release.set()  # only now may the held prompt's encode end
        return loop, small, chat, await held

    loop, small, chat, held = _in_process(model, tok, go)
    assert small.status_code == chat.status_code == held.status_code == 200, (small.text, chat.text, held.text)
    assert tok.held is True  # the small requests were answered while the held one was being tokenized
    assert len(tok.threads) == 3 and loop not in tok.threads


def test_a_prompt_over_the_character_bound_is_refused_unread(model):
    tok = Recording()

    async def go(c):
        out = [await c.post("/completions", json={"model": MODEL, "prompt": "y" * 41}),
               await c.post("/chat/completions", json={"model": MODEL, "messages": [
                   {"role": "user", "content": "y" * 21}, {"role": "user", "content": "y" * 20}]}),
               await c.post("/completions", json={"model": MODEL, "prompt": "y" * 40, "max_tokens": 1})]
        return out

    prompt, chat, ok = _in_process(model, tok, go, max_prompt_chars=40)
    for r, param in ((prompt, "prompt"), (chat, "messages")):
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, "prompt_too_long"), r.text
        assert "41 characters" in err["message"] and "at most 40" in err["message"]
    assert ok.status_code == 200 and tok.texts == ["y" * 40]  # the refused prompts were never tokenized


# ── the server: a poisoned request among streams, strings that are not text, the profile ──
@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    srv = Server(served_model, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch", "5", "--max-len", "128",
                 "--max-prompt-chars", "1000", "--profile", str(out / "p.json"))
    yield srv
    assert srv.stop() == 0, srv.log.read_text()
    assert "Traceback" not in srv.log.read_text()
    prof = json.loads((out / "p.json").read_text())  # written whole at shutdown, no .partial beside it
    assert "host_seconds" in prof and [p.name for p in out.iterdir()] == ["p.json"]


STREAMS = [dict(prompt="The quick brown fox", temperature=0), dict(prompt="Sphinx of black quartz", temperature=0.9,
                                                                     seed=1),
           dict(prompt="Pack my box", temperature=0), dict(prompt="How vexingly", temperature=1.1, top_p=0.8, seed=2)]


def _stream(c, kw) -> str:
    return "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, max_tokens=24, stream=True, **kw))


@pytest.mark.parametrize("param, poison", [("top_p", dict(top_p=1e-300)), ("top_p", dict(top_p=5e-324)),
                                           ("temperature", dict(temperature=1e-30, top_p=1e-300))])
def test_a_poisoned_request_among_four_streams(server, param, poison):
    c = server.client()
    with ThreadPoolExecutor(4) as pool:
        alone = list(pool.map(lambda kw: _stream(c, kw), STREAMS))

    def poisoned():
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="poison", max_tokens=24, stream=True, **poison)
        return e.value.response.json()["error"]

    with ThreadPoolExecutor(5) as pool:
        healthy = [pool.submit(_stream, c, kw) for kw in STREAMS]
        err = pool.submit(poisoned).result()
        together = [f.result() for f in healthy]
    assert together == alone
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"].startswith(param)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", '{"model": "tiny", "prompt": "a\\udc80b"}', "prompt"),
    ("/completions", '{"model": "tiny", "prompt": ["a\\ud800"]}', "prompt"),
    ("/completions", '{"model": "tiny", "prompt": "a", "stop": ["\\udfff"]}', "stop"),
    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc80b"}]}', "messages"),
    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                          '"text": "\\udc80"}]}]}', "messages"),
    ("/completions", '{"model": "tiny\\udc80", "prompt": "a"}', "model"),
])
def test_a_string_that_is_not_text_is_a_400_naming_its_field(server, path, body, param):
    r = httpx.post(server.url + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_string") and "surrogate" in err["message"]


def test_a_surrogate_pair_is_one_character_and_fine(server):
    body = '{"model": "tiny", "prompt": "a\\ud83d\\ude00", "max_tokens": 2}'
    r = httpx.post(server.url + "/completions", content=body.encode(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5  # "a" and the emoji's 4 bytes


def test_the_server_bounds_a_prompts_characters(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="z" * 1001, max_tokens=2)
    assert e.value.response.json()["error"]["code"] == "prompt_too_long"
