"""Continuous batching: one thread owns the engine; requests join free slots
and leave between steps, so a new request never waits for the others to end.

Each turn of the loop: admit waiting requests into free slots (a prefill each,
which decides their first token), then one batched forward for every running
request — with `speculative`, greedy requests take a draft-and-verify round
together and sampling requests a plain step together — then the decided
tokens go to each request's text, and finished requests give their slot back.

The HTTP side talks to it through `submit` (thread-safe) and reads `Event`s
from an asyncio queue the scheduler fills through the request's event loop.
"""

from __future__ import annotations

import random
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

from ..errors import CortiqError
from .detok import IncrementalText
from .sampling import choose


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


class Scheduler:
    def __init__(self, engine, tokenizer, eos_ids=(), speculative: bool = False, max_waiting: int = 256):
        self.engine = engine
        self.tok = tokenizer
        self.eos = set(int(i) for i in eos_ids)
        self.speculative = bool(speculative and engine.draft)
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}  # slot -> request
        self.free = list(range(engine.max_batch))
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        #: counters for logs and benchmarks
        self.stats = {"steps": 0, "rounds": 0, "round_tokens": 0, "tokens": 0, "requests": 0}

    # ── the HTTP side ──
    def submit(self, req: Request) -> None:
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
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.active:
                        self.cond.wait()
                    if self.stopping:
                        break
                    admit = []
                    while self.waiting and len(admit) < len(self.free):
                        admit.append(self.waiting.popleft())
                try:
                    self._turn(admit)
                except Exception as e:  # an engine failure ends the running requests, not the server
                    print(f"cortiq serve: decoding failed: {type(e).__name__}: {e}", file=sys.stderr)
                    for r in list(self.active.values()) + [r for r in admit if r.slot < 0]:
                        self._end(r, "error", f"decoding failed: {e}")
        finally:
            with self.cond:
                rest = list(self.waiting) + list(self.active.values())
                self.waiting.clear()
            for r in rest:
                self._end(r, "error", "the server is shutting down")

    def _turn(self, admit):
        eng = self.engine
        for r in admit:
            if r.cancelled:
                continue
            r.slot = self.free.pop(0)
            self.active[r.slot] = r
            r.spec = self.speculative and r.temperature <= 0
            logits = eng.prefill(r.slot, r.ids)
            tok = int(choose(logits[None], [r.temperature], [r.top_p], [r.rng.random()], eng.picked)[0])
            self.stats["requests"] += 1
            self._take(r, [tok])
        for r in [r for r in self.active.values() if r.cancelled]:
            self._end(r, None)
        # a speculative round when every running request is greedy and has room for one, else a
        # plain step for all (a sampling request needs its own distribution each token; a greedy
        # request's plain step decides the same tokens)
        running = list(self.active.values())
        room = eng.max_len - eng.draft - 1
        if running and all(r.spec and eng.length(r.slot) <= room for r in running):
            plain, spec = [], running
        else:
            plain, spec = running, []
        if plain:
            logits = eng.step([r.slot for r in plain], [r.next_tok for r in plain])  # [B, V]
            toks = choose(logits, [r.temperature for r in plain], [r.top_p for r in plain],
                          [r.rng.random() for r in plain], eng.picked).tolist()
            self.stats["steps"] += 1
            for r, t in zip(plain, toks):
                self._take(r, [t])
        if spec:
            new = eng.speculate([r.slot for r in spec], [r.next_tok for r in spec])
            self.stats["rounds"] += len(spec)
            for r, toks in zip(spec, new):
                self.stats["round_tokens"] += len(toks)
                self._take(r, toks)

    def _take(self, r: Request, toks: list[int]):
        """Newly decided tokens of a running request, in order; ends it at EOS,
        a stop string, max_tokens or a full context."""
        pieces = []
        for t in toks:
            r.n_out += 1
            self.stats["tokens"] += 1
            if t in self.eos:
                return self._end(r, "stop", "", pieces)
            pieces.append(r.text.add(t))
            if r.text.stopped:
                return self._end(r, "stop", "", pieces)
            if r.n_out >= r.max_tokens or self.engine.length(r.slot) + 1 > self.engine.max_len:
                return self._end(r, "length", "", pieces)
        r.next_tok = toks[-1]
        text = "".join(pieces)
        if text:
            self._send(r, Event(text=text, tokens=r.n_out))

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

    @staticmethod
    def _send(r: Request, ev: Event):
        if r.sink is not None:
            r.sink(ev)


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
