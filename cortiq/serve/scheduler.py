"""Continuous batching: one thread owns the engine; requests join free slots
and leave between steps, so a new request never waits for the others to end.

Each turn of the loop: admit waiting requests into free slots and run their
prompts a chunk at a time (at most `prefill_chunk` prompt tokens a turn, so a
long prompt does not stall the running requests; the last chunk decides the
first token, on the device), then launch one batched forward for every running request —
with `speculative`, greedy requests take a draft-and-verify round together
and sampling requests a plain step together — and only then handle the
previous step's tokens: their text, stop checks and the events to each
request's consumer. The engine keeps each slot's next token on its device,
so the next step is under way while the host does that work.

A request whose last token is in a step still running gets that step's
tokens dropped (it has ended); a step is launched ahead only when every
running request has room for it, else the loop first takes the running one.

A prompt's first token does not come back to the host when its prefill ends:
reading it there would wait for the step in flight and leave the device idle
until the next launch, once per admitted request. It is copied to host memory
behind the prefill, and handled (its text, stop checks, its event) when the
loop takes the tokens of the first step launched after it, just before them.

With `spec_auto`, a `DepthPolicy` picks each step between a plain step and
rounds of 1..draft drafts (chain or tree), from the step times the engine took
at start-up and the loop measures since, and each request's recent acceptance.

The HTTP side talks to it through `submit` (thread-safe) and reads `Event`s
from an asyncio queue the scheduler fills through the request's event loop.

One request's failure ends that request alone. What a batched step reads of each
request, its sampling parameters and its prompt's tokens, is checked at `submit`
(`Refused`), so no request's row can fail a step that others share; the work done
for one request at a time, its prefill and first token, its text and stop checks,
the delivery of its events, is guarded one request at a time, and a failure there
ends that request with an "error" event while the others go on untouched. A failure
of the batched step itself is not retried: it may have written some slots' caches
and moved their positions (a Gated DeltaNet state is updated in place), so the
running requests' state is unknown and a retry could decode them wrongly without a
sign. It ends the requests that step ran; those waiting or in prefill go on, and
so does the server.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

import time

import numpy as np
import torch

from ..errors import CortiqError, write_error
from .detok import IncrementalText
from .policy import DepthPolicy
from .sampling import sample_ids, temperature_error, top_p_error


@dataclass
class Event:
    """What a request's consumer receives: text pieces, then one end event."""

    text: str = ""
    #: None while running; "stop" (EOS or a stop string), "length" (max_tokens or the context), "error"
    finish: str | None = None
    #: tokens decided so far (usage)
    tokens: int = 0
    error: str = ""


@dataclass
class Request:
    ids: list[int]  # the prompt's tokens
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: called (from the scheduler thread) with each Event; the HTTP side passes one that hands it to its loop
    sink: object = None
    cancelled: bool = False
    # ── the scheduler's ──
    slot: int = -1
    next_tok: int = -1  # decided, not yet fed to the engine
    n_out: int = 0
    text: IncrementalText | None = None
    rng: random.Random | None = None
    spec: bool = False  # runs draft-and-verify rounds

    def cancel(self):
        """Safe from any thread: the scheduler drops the request before its next step."""
        self.cancelled = True


class Busy(CortiqError):
    """The waiting queue is full."""


class Refused(CortiqError):
    """A request the scheduler cannot run as asked; `param`: its field at fault."""

    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param = param


def refusal(req: Request, vocab_size: int) -> Refused | None:
    """Why `req` cannot join a batch (None: it can): what a batched step reads of it must be
    in range, so that its row cannot fail the step for the requests beside it."""
    for param, why in (("temperature", temperature_error(req.temperature)), ("top_p", top_p_error(req.top_p))):
        if why:
            return Refused(param, why)
    if req.max_tokens < 1:
        return Refused("max_tokens", f"{req.max_tokens} is below 1")
    if not req.ids or min(req.ids) < 0 or max(req.ids) >= vocab_size:
        return Refused("prompt", f"its token ids must be 1 or more, in 0..{vocab_size - 1}")
    return None


class Scheduler:
    def __init__(self, engine, tokenizer, eos_ids=(), speculative: bool = False, max_waiting: int = 256,
                 spec_auto: bool = False, prefill_chunk: int = 0, overlap: bool = True,
                 policy: DepthPolicy | None = None):
        # policy: the one spec_auto chooses by (default: a DepthPolicy for the engine's draft and tree)
        self.engine = engine
        self.tok = tokenizer
        self.eos = set(int(i) for i in eos_ids)
        self.speculative = bool(speculative and engine.draft)
        self.policy = None
        if self.speculative and (spec_auto or policy is not None):
            self.policy = policy or DepthPolicy(engine.draft, engine.max_batch, tree=engine.branches > 1)
            self.policy.seed(engine.step_times())  # (before any request: the engine's slots are free)
        self.prefill_chunk = prefill_chunk
        self.overlap = overlap
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}  # slot -> request
        self.prefilling: list = []  # (request, prefill job), in arrival order
        self.free = list(range(engine.max_batch))
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        #: prompts' first tokens on their way to the host: (request, slot, launches before it)
        self.firsts: list[tuple[Request, int, int]] = []
        self.launches = 0
        self.first_buf = torch.zeros(engine.max_batch, dtype=torch.long,
                                     pin_memory=engine.device.type == "cuda")  # [slots]
        #: counters for logs and benchmarks
        self.stats = {"steps": 0, "rounds": 0, "round_tokens": 0, "tokens": 0, "requests": 0}
        #: host seconds of the loop by part, and device seconds of the steps (profiles read them)
        self.prof = {"prefill": 0.0, "launch": 0.0, "wait": 0.0, "text": 0.0, "send": 0.0, "device": 0.0,
                     "turns": 0, "loop": 0.0}
        #: `trace(steps, path)`: torch.profiler over that many turns once the batch is full
        self._trace_steps, self._trace_path, self._tracer, self._traced = 0, "", None, 0
        self.trace_table = ""

    def trace(self, steps: int, path: str) -> None:
        """Record `steps` turns under torch.profiler, starting at the first turn with every
        slot running; the Chrome trace goes to `path`, the operator table to `trace_table`."""
        self._trace_steps, self._trace_path = steps, path

    def _trace_turn(self):
        if not self._trace_steps:
            return
        if self._tracer is None:
            if len(self.active) < self.engine.max_batch:
                return
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.engine.device.type == "cuda" else [])
            self._tracer = profile(activities=acts)
            self._tracer.__enter__()
            return
        self._traced += 1
        if self._traced >= self._trace_steps:
            tr, self._tracer, self._trace_steps = self._tracer, None, 0
            tr.__exit__(None, None, None)
            key = "self_cuda_time_total" if self.engine.device.type == "cuda" else "self_cpu_time_total"
            self.trace_table = tr.key_averages().table(sort_by=key, row_limit=25)
            if self._trace_path:
                self._export_trace(tr, self._trace_path)

    @staticmethod
    def _export_trace(tr, path: str) -> None:
        """The Chrome trace into `path` (written to PATH.partial, renamed once whole). A failed
        write is one line on stderr naming the path, and leaves no .partial: the server goes on."""
        part = path + ".partial"
        try:
            tr.export_chrome_trace(part)
            os.replace(part, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(part)
            print(f"cortiq serve: {write_error(path, e)}", file=sys.stderr)

    def counters(self) -> dict:
        """The counters since the start (`stats`) and, now, the requests decoding (`running`) and
        those waiting for a slot or in prefill (`waiting`). (The loop's thread moves them on
        between reads: each value is whole, two of them may be a turn apart.)"""
        with self.cond:
            return {**self.stats, "running": len(self.active),
                    "waiting": len(self.waiting) + len(self.prefilling)}

    def profile(self) -> dict:
        """The loop's time by part (host seconds; `device`: the steps' own time), the counters,
        and the policy's choices and step times."""
        out = {"host_seconds": {k: round(v, 4) for k, v in self.prof.items() if isinstance(v, float)},
               "turns": self.prof["turns"], "stats": dict(self.stats)}
        if self.policy is not None:
            out["policy"] = self.policy.summary()
        if self.trace_table:
            out["torch_profiler"] = self.trace_table
        return out

    # ── the HTTP side ──
    def submit(self, req: Request) -> None:
        """Queue `req` (Busy: the queue is full or the server stops; Refused: it cannot run as asked)."""
        bad = refusal(req, self.engine.vocab_size)
        if bad is not None:
            raise bad
        with self.cond:
            if self.stopping:
                raise Busy("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise Busy(f"{len(self.waiting)} requests are waiting already; try again later")
            req.text = IncrementalText(self.tok, req.stop)
            req.rng = random.Random(req.seed)
            self.waiting.append(req)
            self.cond.notify()

    def start(self) -> "Scheduler":
        self.thread = threading.Thread(target=self._loop, name="cortiq-scheduler", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ends every request (an "error" event saying so) and the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ── the loop ──
    def _loop(self):
        flight = None  # the launched step whose tokens are not yet handled
        try:
            while True:
                with self.cond:
                    while not (self.stopping or self.waiting or self.active or self.prefilling or flight):
                        self.cond.wait()
                    if self.stopping:
                        break
                    admit = []
                    while self.waiting and len(admit) < len(self.free):
                        admit.append(self.waiting.popleft())
                t0 = time.perf_counter()
                try:
                    flight = self._turn(admit, flight)
                except Exception as e:  # a batched step failed: it ends the requests it ran (module docstring)
                    print(f"cortiq serve: decoding failed: {type(e).__name__}: {e}", file=sys.stderr)
                    flight = None
                    for r in list(self.active.values()):
                        self._end(r, "error", f"decoding failed: {e}")
                self.prof["loop"] += time.perf_counter() - t0
                self.prof["turns"] += 1
                self._trace_turn()
        finally:
            with self.cond:
                rest = list(self.waiting) + list(self.active.values()) + [r for r, _ in self.prefilling]
                self.waiting.clear()
                self.prefilling.clear()
            for r in rest:
                self._end(r, "error", "the server is shutting down")

    def _turn(self, admit, flight):
        eng, prof = self.engine, self.prof
        t0 = time.perf_counter()
        for r in admit:
            if r.cancelled:
                continue
            r.slot = self.free.pop(0)
            r.spec = self.speculative and r.temperature <= 0
            try:
                self.prefilling.append((r, eng.prefill_job(r.slot, r.ids, self.prefill_chunk)))
            except Exception as e:
                self._fail(r, e)
        self._prefill()
        t1 = time.perf_counter()
        prof["prefill"] += t1 - t0
        for r in [r for r in self.active.values() if r.cancelled]:
            self._end(r, None)
        took = flight  # the step whose tokens this turn takes (one a turn)
        nxt = self._launch(ahead=flight is not None)
        if nxt is None and flight is not None:  # no room to run ahead: take the running step first
            self._finish(flight)
            flight = None
            nxt = self._launch(ahead=False)
        if flight is not None:
            self._finish(flight)
        if nxt is not None and not self.overlap:
            self._finish(nxt)
            took, nxt = nxt, None
        if self.policy is not None and took is not None:
            self.policy.record_period(took[0].key, took[0].depth, time.perf_counter() - t1, took[0].tree)
        return nxt

    def _prefill(self):
        """Prompt chunks of the prefilling requests, oldest first, up to prefill_chunk tokens
        (at least one chunk); a finished prompt decides its request's first token."""
        budget = self.prefill_chunk or float("inf")
        while self.prefilling and budget > 0:
            r, job = self.prefilling[0]
            if r.cancelled:
                self.prefilling.pop(0)
                self._end(r, None)
                continue
            left = job.left
            try:
                logits = job.run()
                budget -= left - job.left
                if logits is not None:
                    self.prefilling.pop(0)
                    self._first(r, logits)
            except Exception as e:  # this prompt's own work: it alone ends
                if self.prefilling and self.prefilling[0][0] is r:
                    self.prefilling.pop(0)
                self._fail(r, e)

    def _first(self, r: Request, logits):
        """A prompt's last chunk has run: its first token, decided on the device, and its slot running."""
        eng = self.engine
        self.active[r.slot] = r
        tok = sample_ids(logits[None], [r.temperature], [r.top_p], [r.rng.random()], eng.picked)  # [1]
        eng.set_pending(r.slot, tok)
        self.stats["requests"] += 1
        if self.policy is not None:
            self.policy.join(r.slot)
        self.first_buf[r.slot: r.slot + 1].copy_(tok, non_blocking=True)
        self.firsts.append((r, r.slot, self.launches))

    def _depth(self, running, slots: list[int], key) -> tuple[int, bool | None]:
        """Drafts the next round verifies (0: a plain step), and whether on the draft tree (None:
        the engine's own kind of round); `key`: the step's key for the policy."""
        if not (self.speculative and all(r.spec for r in running)):
            return 0, None
        if self.policy is None:
            return self.engine.draft, None
        return self.policy.choose(key, np.array(slots))

    def _launch(self, ahead: bool):
        """Launch the next step of the running requests -> (the step, its requests), or None
        (nothing runs, or `ahead` and a request may not have room for it)."""
        running = list(self.active.values())
        if not running:
            return None
        eng = self.engine
        slots = [r.slot for r in running]
        if ahead and not eng.fits(slots, 1):
            return None
        key = eng.step_key(max(slots) + 1) if self.policy is not None else None
        depth, tree = self._depth(running, slots, key)  # (after the room check: the policy counts what runs)
        if depth and not eng.fits(slots, depth + 1):
            depth, tree = 0, None
        t0 = time.perf_counter()
        sample = {r.slot: (r.temperature, r.top_p, r.rng.random()) for r in running if r.temperature > 0}
        step = eng.launch(slots, depth, sample, chain=self.policy is None, tree=tree)
        self.launches += 1
        step.seq, step.key = self.launches, key
        self.prof["launch"] += time.perf_counter() - t0
        return step, running

    def _finish(self, flight):
        """The tokens of a launched step, to its requests (those still running)."""
        step, reqs = flight
        t0 = time.perf_counter()
        new = step.wait()
        t1 = time.perf_counter()
        self.prof["wait"] += t1 - t0
        self.prof["device"] += step.seconds
        self._take_firsts(step.seq)
        # a request that ended while this step ran (its last token came in the step before)
        # gets nothing from it: its round is not counted, so the rounds and drafts kept are
        # those of the answers' own tokens (what the offline measure walks)
        keep = [i for i, r in enumerate(reqs) if r.slot >= 0 and not r.cancelled]
        if step.depth:
            lens = np.array([len(new[i]) for i in keep], dtype=np.int64)
            self.stats["rounds"] += len(keep)
            self.stats["round_tokens"] += int(lens.sum())
        else:
            self.stats["steps"] += 1
        pol = self.policy
        if pol is not None:
            pol.record(step.key, step.depth, step.seconds, step.tree)
            if step.depth:
                pol.kept(np.array([step.slots[i] for i in keep], dtype=np.int64), lens - 1, step.depth, step.tree)
        self._take([reqs[i] for i in keep], [new[i] for i in keep])

    def _take_firsts(self, seq: int):
        """The first tokens of the prompts prefilled before launch `seq` (that step has ended, so
        their copies to the host, queued before it, have too), before the step's own tokens."""
        ready = [f for f in self.firsts if f[2] < seq]
        if not ready:
            return
        self.firsts = [f for f in self.firsts if f[2] >= seq]
        live = [(r, s) for r, s, _ in ready if r.slot == s and not r.cancelled]
        if live:
            toks = self.first_buf.tolist()
            self._take([r for r, _ in live], [[toks[s]] for _, s in live])

    def _take(self, reqs: list, toks: list):
        """Newly decided tokens of running requests, in order; each ends at EOS, a stop
        string, max_tokens or a full context. The text of every request's j-th token is
        decoded in one pass over all of them."""
        t0 = time.perf_counter()
        eng = self.engine
        pieces = [[] for _ in reqs]
        ended: list = []  # (request, finish, pieces); finish None: its text failed (pieces: the error)
        alive, j = list(range(len(reqs))), 0
        while alive:
            adding = []
            for i in alive:
                r = reqs[i]
                r.n_out += 1
                self.stats["tokens"] += 1
                if toks[i][j] in self.eos:
                    ended.append((r, "stop", pieces[i]))
                else:
                    adding.append(i)
            texts = _texts([reqs[i].text for i in adding], [toks[i][j] for i in adding])
            alive = []
            for i, piece in zip(adding, texts):
                r = reqs[i]
                if isinstance(piece, Exception):
                    ended.append((r, None, piece))
                    continue
                pieces[i].append(piece)
                if r.text.stopped:
                    ended.append((r, "stop", pieces[i]))
                # the context is full once the prompt and every token but this (pending) one hold
                # its positions: counted per token (the engine's length counts a whole round at once)
                elif r.n_out >= r.max_tokens or len(r.ids) + r.n_out > eng.max_len:
                    ended.append((r, "length", pieces[i]))
                elif j + 1 < len(toks[i]):
                    alive.append(i)
            j += 1
        t1 = time.perf_counter()
        done = {id(r) for r, _, _ in ended}
        for r, finish, ps in ended:
            if finish is None:
                self._fail(r, ps)
            else:
                self._end(r, finish, "", ps)
        for i, r in enumerate(reqs):
            if id(r) not in done:
                r.next_tok = toks[i][-1]
                text = "".join(pieces[i])
                if text:
                    self._send(r, Event(text=text, tokens=r.n_out))
        self.prof["text"] += t1 - t0
        self.prof["send"] += time.perf_counter() - t1

    def _end(self, r: Request, finish: str | None, error: str = "", pieces=()):
        """Release the slot and send the last text and the end event (none when cancelled)."""
        if r.slot >= 0:
            self.engine.release(r.slot)
            self.active.pop(r.slot, None)
            self.free.append(r.slot)
            self.free.sort()
            r.slot = -1
        if finish is None or r.cancelled:
            return
        text = "".join(pieces) + (r.text.finish() if finish != "error" else "")
        self._send(r, Event(text=text, finish=finish, tokens=r.n_out, error=error))

    def _fail(self, r: Request, e: Exception):
        """Work done for `r` alone failed: `r` ends with an "error" event; the others go on."""
        print(f"cortiq serve: a request failed: {type(e).__name__}: {e}", file=sys.stderr)
        self._end(r, "error", f"decoding failed: {e}")

    @staticmethod
    def _send(r: Request, ev: Event):
        if r.sink is None:
            return
        try:
            r.sink(ev)
        except Exception:  # its consumer is gone (say, its event loop closed): it is dropped before its next step
            r.cancelled = True


def _texts(texts: list, tokens: list) -> list:
    """`IncrementalText.add_many` (each text after its next token); where that fails, each
    text alone, and for a text whose own decode fails, the exception in its place."""
    try:
        return IncrementalText.add_many(texts, tokens)
    except Exception:
        out = []
        for x, t in zip(texts, tokens):
            try:
                out.append(x.add(t))
            except Exception as e:
                out.append(e)
        return out


class Outbox:
    """Events from the scheduler thread to one asyncio loop, with one wake-up of the loop for
    everything posted since its last drain (not one per event): `post` is thread-safe."""

    def __init__(self, loop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()
        self.armed = False
        self.stats = {"wakeups": 0, "events": 0}

    def post(self, queue, ev: Event) -> None:
        with self.lock:
            self.items.append((queue, ev))
            if self.armed:
                return
            self.armed = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self):
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        self.stats["wakeups"] += 1
        self.stats["events"] += len(items)
        for q, ev in items:
            q.put_nowait(ev)


def merged(first: Event, more) -> Event:
    """One event for `first` and the events queued behind it (`more`: an iterator that
    ends when none is left), stopping at an end event: their text joined."""
    if first.finish:
        return first
    texts, ev = [first.text], first
    for ev in more:
        texts.append(ev.text)
        if ev.finish:
            break
    if len(texts) == 1:
        return first
    return Event(text="".join(texts), finish=ev.finish, tokens=ev.tokens, error=ev.error)


def collect(sched: Scheduler, req: Request, timeout: float = 600.0) -> tuple[str, Event]:
    """Submit and wait (a blocking helper for scripts and tests) -> (text, end event)."""
    done = threading.Event()
    parts: list[str] = []
    last: list[Event] = []

    def sink(ev: Event):
        parts.append(ev.text)
        if ev.finish:
            last.append(ev)
            done.set()

    req.sink = sink
    sched.submit(req)
    if not done.wait(timeout):
        req.cancel()
        raise CortiqError(f"no answer within {timeout:.0f} s")
    return "".join(parts), last[0]
