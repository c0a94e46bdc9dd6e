"""Speculation that decides per step: a plain step, or a round verifying 1..k drafts (on the
draft's chain, or on its tree), and never a kind of step that is not expected to beat plain.

A round of depth d over a batch decides, per request, 1 + α + α² + … + α^d tokens on average,
where α is that request's chance that a draft is right given the ones before it were (its recent
acceptance, drawn toward the acceptance of every request's rounds while it has had few). Its
expected tokens per second are that sum over the batch over what the step costs; a plain step's
are the batch's size over its own cost. A round is chosen only where its rate beats the plain
step's by `margin`, and plain is chosen while a plain step has no cost measured: so when a large
batch makes verify blocks cost more than their accepted drafts save, or the drafts are rarely
right, the steps are plain ones.

What a step costs depends on its kind and on the batch: the engine's batch bucket and the key
length its attention reads (`Engine.step_key`). Every kind is timed at every such key once at
start-up, where the engine can (`Engine.step_times`: the decode engine replays each captured graph
before any request is served), so no kind waits for a first sample taken in service; a kind with no
time at a key is tried once before the policy chooses there. A kind's cost is the median of its
recent samples, so one bad sample (a warm-up, a stall) does not stay: without that, a round timed
once at several times its real cost was never chosen again (bench/DECODE.md, "`--spec-auto` in
longer rows"). Estimates age: every `explore` turns at a key the kind sampled longest ago there
runs instead of the best one, so a kind that is not chosen is measured again, one turn in
`explore` at most.

A step's cost is the larger of two measures: its device time (the engine's events), and the
period of the loop's turn that took its tokens (the wait for the device plus the host's launch,
text and stop checks; the prompt chunks prefilled that turn left out). The loop overlaps the
host's work with the next step, so the turn's period is what a step costs in throughput where the
host is the slower side (bench/DECODE.md, "The depth policy costs a step by its turn, and a draft
of 8192 windows").

Each request's acceptance lives in arrays by slot (chain and tree rounds apart), and the expected
tokens of every depth come from one array expression over the batch: nothing here loops over the
requests or their tokens in Python.
"""

from __future__ import annotations

from collections import deque
from statistics import median_low

import numpy as np

PLAIN = (0, False)


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens a round of `depth` drafts decides when each draft is right with
    probability alpha after right ones: 1 + α + … + α^depth."""
    return sum(alpha ** i for i in range(depth + 1))


class DepthPolicy:
    """The step kinds of a server drafting `k` tokens a round over `slots` slots (`tree`: its
    draft tree's rounds too). `explore`: turns at a key between two runs of its stalest kind;
    `keep`: the recent samples a cost is the median of; `margin`: how much more a round's expected
    tokens per second must be than a plain step's."""

    def __init__(self, k: int, slots: int, tree: bool = False, explore: int = 64, keep: int = 5,
                 margin: float = 0.05):
        self.k, self.explore, self.keep, self.margin, self.tree = k, explore, keep, margin, tree
        #: what a step can be: (0, False) plain, (d, False) a chain round of d drafts, (d, True) a tree's
        self.actions = [PLAIN] + [(d, False) for d in range(1, k + 1)] + (
            [(d, True) for d in range(1, k + 1)] if tree else [])
        self.time: dict[tuple, deque] = {}  # (key, depth, tree) -> recent device seconds
        self.period: dict[tuple, deque] = {}  # (key, depth, tree) -> recent turn seconds
        self.at: dict[tuple, int] = {}  # (key, depth, tree) -> the key's turn of its last sample
        self.turns: dict = {}  # key -> turns chosen at it
        #: acceptance over every request's chain and tree rounds: the prior of a request with few rounds
        self.alpha = {False: 0.5, True: 0.5}
        #: each slot's drafts kept and looked at in recent rounds (decaying sums), [chain, tree] rows
        self.acc = np.zeros((2, slots))
        self.tries = np.zeros((2, slots))
        self.chosen = {a: 0 for a in self.actions}  # how often each step kind was chosen
        self.explored = self.seeded = 0
        self._powers = np.arange(k + 1)

    # ── what it learns ──
    def seed(self, times: dict) -> None:
        """Start-up times {(key, depth, tree): seconds}, one sample each (kinds it does not run are left out)."""
        for (key, depth, tree), seconds in times.items():
            if (depth, bool(tree)) in self.actions:
                self.record(key, depth, seconds, tree)
                self.seeded += 1

    def record(self, key, depth: int, seconds: float, tree: bool = False) -> None:
        """A step's device time."""
        self._sample(self.time, (key, depth, bool(tree)), seconds)

    def record_period(self, key, depth: int, seconds: float, tree: bool = False) -> None:
        """The period of the turn that took a step's tokens (host work and the wait for it)."""
        self._sample(self.period, (key, depth, bool(tree)), seconds)

    def _sample(self, table: dict, k: tuple, seconds: float) -> None:
        q = table.get(k)
        if q is None:
            q = table[k] = deque(maxlen=self.keep)
        q.append(seconds)
        self.at[k] = self.turns.get(k[0], 0)

    def join(self, slot: int) -> None:
        """A new request in `slot`: its acceptance starts from the prior."""
        self.acc[:, slot] = 0.0
        self.tries[:, slot] = 0.0

    def kept(self, slots, kept, depth: int, tree: bool = False) -> None:
        """One round's drafts kept by the requests in `slots` (arrays): each request's acceptance
        counts the drafts it looked at (the kept ones and the first wrong one, if any), and the
        prior of its kind of round follows the round's mean."""
        slots, kept = np.asarray(slots), np.asarray(kept, dtype=float)
        if not len(slots):
            return
        t = int(bool(tree))
        tries = kept + (kept < depth)
        self.acc[t, slots] = 0.9 * self.acc[t, slots] + kept
        self.tries[t, slots] = 0.9 * self.tries[t, slots] + tries
        w = 0.99 ** len(slots)  # as one update of 0.01 a request
        self.alpha[bool(tree)] = w * self.alpha[bool(tree)] + (1 - w) * float(np.mean(kept / tries))

    def acceptance(self, slots, tree: bool = False) -> np.ndarray:
        """Each request's chance that a draft is right after right ones, [len(slots)]."""
        t = int(bool(tree))
        return (self.acc[t, slots] + 2 * self.alpha[bool(tree)]) / (self.tries[t, slots] + 2)

    # ── what it chooses ──
    def cost(self, key, depth: int, tree: bool = False) -> float | None:
        """Seconds a step of `depth` (a tree's round: `tree`) at `key` costs: the median of its recent
        device times, or of its turns' periods where that is longer; None before any sample."""
        k = (key, depth, bool(tree))
        q = self.time.get(k)
        if not q:
            return None
        p = self.period.get(k)
        return max(median_low(q), median_low(p)) if p else median_low(q)

    def tokens(self, slots) -> dict:
        """Expected tokens a step of each kind decides over the requests in `slots` {(depth, tree): tokens}."""
        out = {PLAIN: float(len(slots))}
        for tree in (False, True) if self.tree else (False,):
            a = self.acceptance(slots, tree)
            per_depth = np.cumsum(a[:, None] ** self._powers, axis=1).sum(0)  # [k + 1]
            out.update({(d, tree): float(per_depth[d]) for d in range(1, self.k + 1)})
        return out

    def choose(self, key, slots) -> tuple[int, bool]:
        """The step for the requests in `slots` (an array), whose batch runs at `key` -> (depth, tree)."""
        n = self.turns[key] = self.turns.get(key, 0) + 1
        a = self._choose(key, n, slots)
        self.chosen[a] += 1
        return a

    def _choose(self, key, n: int, slots) -> tuple[int, bool]:
        costs = {a: self.cost(key, *a) for a in self.actions}
        if costs[PLAIN] is None:
            return PLAIN
        untimed = [a for a in self.actions if costs[a] is None]
        if untimed:
            return untimed[0]
        best = self.best(costs, self.tokens(slots))
        if n % self.explore == 0:  # the kind sampled longest ago here, so that its estimate stays current
            self.explored += 1
            return min((a for a in self.actions if a != best), key=lambda a: self.at[(key, *a)])
        return best

    def best(self, costs: dict, tokens: dict) -> tuple[int, bool]:
        """The kind with the most expected tokens per second, where that beats a plain step's by the
        margin; else plain."""
        rates = {a: tokens[a] / costs[a] for a in self.actions}
        a = max(rates, key=rates.get)
        return a if rates[a] >= (1 + self.margin) * rates[PLAIN] else PLAIN

    @staticmethod
    def _name(depth: int, tree: bool) -> str:
        return f"tree {depth}" if tree else str(depth)

    def summary(self) -> dict:
        def ms(table):
            return {f"{'x'.join(map(str, k if isinstance(k, tuple) else (k,)))} {self._name(d, t)}":
                    round(1000 * median_low(v), 3) for (k, d, t), v in sorted(table.items(), key=str)}

        return {"chosen": {self._name(*a): n for a, n in self.chosen.items()}, "explored": self.explored,
                "seeded": self.seeded, "step_ms": ms(self.time), "turn_ms": ms(self.period),
                "alpha": round(self.alpha[False], 3), **({"alpha_tree": round(self.alpha[True], 3)} if self.tree else {})}
