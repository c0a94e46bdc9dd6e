"""Speculation that decides per step: plain, or a round verifying 1..k drafts.

A round of depth d over a batch decides, per request, 1 + α + α² + … + α^d
tokens on average, where α is that request's chance that a draft is right
given the ones before it were (its recent acceptance). It costs one turn of
the server's loop with a step of the depth-d kind at the batch's bucket, whose
time the policy measures as it goes. Each step the policy takes the depth with
the most expected tokens per second; so when the batch is large enough that a
verify block costs more than its accepted drafts save, or the drafts are rarely
right, it runs plain steps. Depths not yet timed at a bucket are tried first
(twice: the first run of a graph pays for warm-up), and every `explore` steps
the runner-up is tried again so that its time stays current.

A step's cost is the larger of two measures: its device time (the engine's
events), and the period of the loop's turn that took its tokens (the wait for
the device plus the host's launch, text and stop checks; the prompt chunks
prefilled that turn left out). The loop overlaps the host's work with the next
step, so the turn's period is what a step costs in throughput. Device time
alone undercounts plain steps where the host is the slower side: the policy
then chose plain steps that cost as much wall time as rounds, and served less
than always speculating did (bench/DECODE.md, "The depth policy costs a step by
its turn, and a draft of 8192 windows").

With a draft tree (`--draft-branches`), a round of each depth can also verify the
tree: its steps are timed apart from the chain's, and its expected tokens use each
request's acceptance in tree rounds. A tree's verify block has branches·depth + 1
rows, nearly free where the step is bound by its launches (few requests) and not
where the batch is large; the policy finds where from the measured times.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens a round of `depth` drafts decides when each draft is right with
    probability alpha after right ones: 1 + α + … + α^depth."""
    return sum(alpha ** i for i in range(depth + 1))


class DepthPolicy:
    def __init__(self, k: int, explore: int = 64, warm: int = 2, decay: float = 0.8, tree: bool = False):
        self.k, self.explore, self.warm, self.decay = k, explore, warm, decay
        #: what a step can be: (0, False) plain, (d, False) a chain round of d drafts, (d, True) a tree's
        self.actions = [(d, False) for d in range(k + 1)] + ([(d, True) for d in range(1, k + 1)] if tree else [])
        self.tree = tree
        self.time: dict[tuple, list] = {}  # (bucket, depth, tree) -> [device seconds (moving average), samples]
        self.period: dict[tuple, list] = {}  # (bucket, depth, tree) -> [turn seconds (moving average), samples]
        self.turns: dict[int, int] = {}
        #: acceptance over all requests in chain and in tree rounds: the prior of a request with few rounds
        self.alpha = 0.5
        self.alpha_tree = 0.5
        self.chosen = {a: 0 for a in self.actions}  # how often each step kind was chosen

    def choose(self, bucket: int, alphas: Sequence[float], tree_alphas: Sequence[float] | None = None
               ) -> tuple[int, bool]:
        """The step for a batch at `bucket` whose requests keep drafts at `alphas` (chain rounds)
        and `tree_alphas` (tree rounds; default the same) -> (depth, tree)."""
        a = self._choose(bucket, alphas, alphas if tree_alphas is None else tree_alphas)
        self.chosen[a] += 1
        return a

    def _choose(self, bucket: int, alphas, tree_alphas) -> tuple[int, bool]:
        for a in self.actions:
            t = self.time.get((bucket, *a))
            if t is None or t[1] < self.warm:
                return a
        n = self.turns[bucket] = self.turns.get(bucket, 0) + 1
        rates = sorted(((sum(expected_tokens(x, d) for x in (tree_alphas if t else alphas)) / self.cost(bucket, d, t),
                         (d, t)) for d, t in self.actions), reverse=True)
        if n % self.explore == 0:
            return rates[1][1]
        return rates[0][1]

    def cost(self, bucket: int, depth: int, tree: bool = False) -> float:
        """Seconds a step of `depth` (a tree's round: `tree`) at `bucket` costs: its device time,
        or its turn's period where that is longer (once the period is past its warm-up)."""
        dev = self.time[(bucket, depth, tree)][0]
        p = self.period.get((bucket, depth, tree))
        return max(dev, p[0]) if p is not None and p[1] >= self.warm else dev

    def record(self, bucket: int, depth: int, seconds: float, tree: bool = False) -> None:
        """A step's device time."""
        self._average(self.time, (bucket, depth, tree), seconds)

    def record_period(self, bucket: int, depth: int, seconds: float, tree: bool = False) -> None:
        """The period of the turn that took a step's tokens (host work and the wait for it)."""
        self._average(self.period, (bucket, depth, tree), seconds)

    def _average(self, table: dict, key: tuple, seconds: float) -> None:
        t = table.get(key)
        if t is None or t[1] < self.warm:  # the warm-up runs are not kept in the average
            table[key] = [seconds, 1 if t is None else t[1] + 1]
        else:
            t[0] = self.decay * t[0] + (1 - self.decay) * seconds
            t[1] += 1

    def accepted(self, accepted: int, depth: int, tree: bool = False) -> float:
        """One request's round: the drafts it kept -> the tries it counts (the drafts looked at:
        the kept ones and the first wrong one, if any); the global acceptance (of its kind) follows."""
        tries = accepted + (accepted < depth)
        if tries:
            if tree:
                self.alpha_tree = 0.99 * self.alpha_tree + 0.01 * (accepted / tries)
            else:
                self.alpha = 0.99 * self.alpha + 0.01 * (accepted / tries)
        return tries

    @staticmethod
    def _name(depth: int, tree: bool) -> str:
        return f"tree {depth}" if tree else str(depth)

    def summary(self) -> dict:
        ms = lambda table: {f"{b}x{self._name(d, t)}": round(1000 * v[0], 3)  # noqa: E731
                            for (b, d, t), v in sorted(table.items())}
        out = {"chosen": {self._name(*a): n for a, n in self.chosen.items()}, "step_ms": ms(self.time),
               "turn_ms": ms(self.period), "alpha": round(self.alpha, 3)}
        if self.tree:
            out["alpha_tree"] = round(self.alpha_tree, 3)
        return out
