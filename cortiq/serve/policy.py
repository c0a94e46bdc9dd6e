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
alone undercounts plain steps where the host is the slower side: on the H200
at 32 chat clients (2026-12-03) the policy then chose plain steps that cost as
much wall time as rounds, and ran at 0.95x a plain server while always
speculating ran at 1.08x.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens a round of `depth` drafts decides when each draft is right with
    probability alpha after right ones: 1 + α + … + α^depth."""
    return sum(alpha ** i for i in range(depth + 1))


class DepthPolicy:
    def __init__(self, k: int, explore: int = 64, warm: int = 2, decay: float = 0.8):
        self.k, self.explore, self.warm, self.decay = k, explore, warm, decay
        self.time: dict[tuple[int, int], list] = {}  # (bucket, depth) -> [device seconds (moving average), samples]
        self.period: dict[tuple[int, int], list] = {}  # (bucket, depth) -> [turn seconds (moving average), samples]
        self.turns: dict[int, int] = {}
        #: acceptance over all requests: the prior of a request with few rounds
        self.alpha = 0.5
        self.chosen = [0] * (k + 1)  # how often each depth was chosen

    def choose_depth(self, bucket: int, alphas: Sequence[float]) -> int:
        d = self._depth(bucket, alphas)
        self.chosen[d] += 1
        return d

    def _depth(self, bucket: int, alphas: Sequence[float]) -> int:
        for d in range(self.k + 1):
            t = self.time.get((bucket, d))
            if t is None or t[1] < self.warm:
                return d
        n = self.turns[bucket] = self.turns.get(bucket, 0) + 1
        rates = sorted(((sum(expected_tokens(a, d) for a in alphas) / self.cost(bucket, d), d)
                        for d in range(self.k + 1)), reverse=True)
        if n % self.explore == 0:
            return rates[1][1]
        return rates[0][1]

    def cost(self, bucket: int, depth: int) -> float:
        """Seconds a step of `depth` at `bucket` costs: its device time, or its turn's period
        where that is longer (once the period is past its warm-up)."""
        dev = self.time[(bucket, depth)][0]
        p = self.period.get((bucket, depth))
        return max(dev, p[0]) if p is not None and p[1] >= self.warm else dev

    def record(self, bucket: int, depth: int, seconds: float) -> None:
        """A step's device time."""
        self._average(self.time, (bucket, depth), seconds)

    def record_period(self, bucket: int, depth: int, seconds: float) -> None:
        """The period of the turn that took a step's tokens (host work and the wait for it)."""
        self._average(self.period, (bucket, depth), seconds)

    def _average(self, table: dict, key: tuple[int, int], seconds: float) -> None:
        t = table.get(key)
        if t is None or t[1] < self.warm:  # the warm-up runs are not kept in the average
            table[key] = [seconds, 1 if t is None else t[1] + 1]
        else:
            t[0] = self.decay * t[0] + (1 - self.decay) * seconds
            t[1] += 1

    def accepted(self, accepted: int, depth: int) -> float:
        """One request's round: the drafts it kept -> the tries it counts (the drafts looked at:
        the kept ones and the first wrong one, if any); the global acceptance follows."""
        tries = accepted + (accepted < depth)
        if tries:
            self.alpha = 0.99 * self.alpha + 0.01 * (accepted / tries)
        return tries

    def summary(self) -> dict:
        return {"chosen": {str(d): n for d, n in enumerate(self.chosen)},
                "step_ms": {f"{b}x{d}": round(1000 * t[0], 3) for (b, d), t in sorted(self.time.items())},
                "turn_ms": {f"{b}x{d}": round(1000 * t[0], 3) for (b, d), t in sorted(self.period.items())},
                "alpha": round(self.alpha, 3)}
