"""The dynamic mix of a heal with retain data: which source each batch's windows come from.

Sheared-LLaMA's dynamic batch loading (Xia et al. 2024): at every held-out
evaluation each source's loss gap to the reference (here its held-out KL to
the teacher, which is the gap itself: the teacher's own KL is 0) scales its
share by exp(lr · gap / mean gap); the shares are renormalised and mixed with
the starting shares (at least MIX_FLOOR of each source's starting share
stays, so no source is ever dropped). A batch of B takes round(share · B)
windows of each source, the rounding carried from batch to batch (over any
run of batches a source's count is its summed share to within one window),
each source's windows in a seeded permutation of its pool, a fresh one at
each pass. Everything the next batch depends on is `state()`, which the
trainer checkpoints, so a resumed run draws what an uninterrupted one does.
"""

from __future__ import annotations

import numpy as np

#: the share of each source's starting share the update always keeps
MIX_FLOOR = 0.2


class Mixer:
    def __init__(self, source: np.ndarray, n_sources: int, seed: int, lr: float):
        #: [n_k] window numbers of each source
        self.pools = [np.flatnonzero(source == k) for k in range(n_sources)]
        counts = np.array([len(p) for p in self.pools], dtype=np.float64)
        #: [K] the starting shares: each source's share of the train windows
        self.base = counts / counts.sum()
        self.seed, self.lr = int(seed), float(lr)
        self.w = self.base.copy()  # [K] the current shares
        self.credit = np.zeros(n_sources)  # [K] rounding carried between batches
        self.drawn = np.zeros(n_sources, dtype=np.int64)  # [K] windows taken of each source so far

    def state(self) -> dict:
        return {"w": self.w.tolist(), "credit": self.credit.tolist(), "drawn": self.drawn.tolist()}

    def load(self, st: dict) -> None:
        self.w = np.asarray(st["w"], dtype=np.float64)
        self.credit = np.asarray(st["credit"], dtype=np.float64)
        self.drawn = np.asarray(st["drawn"], dtype=np.int64)

    def counts(self, batch: int) -> np.ndarray:
        """[K] windows of each source in the next batch (sum `batch`), the rounding carried."""
        c = self.credit + self.w * batch
        n = np.floor(c).astype(np.int64)
        short = batch - int(n.sum())
        n[np.argsort(-(c - n), kind="stable")[:short]] += 1
        self.credit = c - n
        return n

    def batch(self, batch: int) -> np.ndarray:
        """[batch] the train window numbers of the next batch."""
        n = self.counts(batch)
        parts = []
        for k in np.flatnonzero(n):  # sources, a handful
            pool = self.pools[k]
            j = np.arange(self.drawn[k], self.drawn[k] + n[k])  # positions in the source's endless order
            passes = j // len(pool)
            out = np.empty(len(j), dtype=np.int64)
            for p in np.unique(passes):  # one or two passes per batch
                perm = np.random.default_rng([self.seed, int(k), int(p)]).permutation(len(pool))
                m = passes == p
                out[m] = pool[perm[j[m] % len(pool)]]
            parts.append(out)
            self.drawn[k] += n[k]
        return np.concatenate(parts)

    def update(self, gaps) -> None:
        """Shift the shares toward the sources with the larger held-out gap (`gaps` [K], nats)."""
        g = np.maximum(np.asarray(gaps, dtype=np.float64), 0.0)
        if not np.isfinite(g).all() or g.sum() <= 0:
            return
        w = self.w * np.exp(self.lr * g / g.mean())
        w /= w.sum()
        self.w = (1.0 - MIX_FLOOR) * w + MIX_FLOOR * self.base
