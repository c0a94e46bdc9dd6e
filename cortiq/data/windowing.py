"""Windows: what the heal and MTP stages train and score on.

`windows` (the heal's layout): a split's whole records, in the FNV-1a order of
their rids, as one stream cut into windows of T tokens. Row j predicts token
j+1 and carries that token's weight (the last row looks at the next window's
first token); a window with no scored row is skipped; the tail is padded.

`packed_windows` (the MTP stage's layout): a data set's train records in a fixed
xorshift shuffle, as one stream (capped at a token budget) cut into windows
of T; a short last window is kept only from a minimum length on; every tenth
window is held out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from ..errors import CortiqError
from ..store import parse_data_spec
from .tdata import SPLITS, Tdata


def n_batches(n: int, batch: int) -> int:
    """Batches of n windows: n // batch, but at least one when there is any window (a short
    val split still gets one batch)."""
    if batch < 1:
        raise CortiqError(f"batch must be at least 1, not {batch}")
    return max(n // batch, int(n > 0))


def batch_indices(n: int, batch: int) -> np.ndarray:
    """[n_batches, batch] window numbers of n windows: batch b takes windows (b·batch + i) mod n,
    so the last batch is filled up from the first windows."""
    nb = n_batches(n, batch)
    return (np.arange(nb * batch, dtype=np.int64) % max(n, 1)).reshape(nb, batch)


class Batch(NamedTuple):
    ids: np.ndarray  # [B, T] int64
    next: np.ndarray  # [B, T] int64
    weight: np.ndarray  # [B, T] float32


@dataclass
class Windows:
    #: [N, T] int64 input ids (pad_id past the stream's end)
    ids: np.ndarray
    #: [N, T] int64 each row's next token, its hard target (pad_id past the end)
    next: np.ndarray
    #: [N, T] float32 each row's weight: 1 when its next token is scored, else 0
    weight: np.ndarray
    pad_id: int
    #: [N] int64 the source of each window (0: the user's data, 1..: retain sources), or None for one source
    source: np.ndarray | None = None
    #: the sources' names, by index
    names: tuple[str, ...] = ()

    @property
    def T(self) -> int:
        return int(self.ids.shape[1])

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def n_batches(self, batch: int) -> int:
        """N // batch, but at least one when there is any window (a short val split still gets one batch)."""
        return n_batches(len(self), batch)

    def batch_indices(self, batch: int) -> np.ndarray:
        """[n_batches, batch] window numbers (`batch_indices`)."""
        return batch_indices(len(self), batch)

    def batch(self, b: int, batch: int) -> Batch:
        i = self.batch_indices(batch)[b]
        return Batch(self.ids[i], self.next[i], self.weight[i])

    def batches(self, batch: int) -> Iterator[Batch]:
        for i in self.batch_indices(batch):
            yield Batch(self.ids[i], self.next[i], self.weight[i])


def cut_windows(ids: np.ndarray, weight: np.ndarray, T: int, pad_id: int) -> Windows:
    """The seed's `windows` on a stream (ids [n], weight [n]): whole-array slicing, no loop."""
    if T < 1:
        raise CortiqError(f"window length must be at least 1, not {T}")
    n = int(len(ids))
    m = -(-n // T)  # windows before skipping
    # one pad past the last window so the last row of every window has a next token
    ids_p = np.full(m * T + 1, pad_id, dtype=np.int64)  # [m·T + 1]
    ids_p[:n] = ids
    w_p = np.zeros(m * T + 1, dtype=np.float32)
    w_p[:n] = weight
    win = ids_p[:-1].reshape(m, T)  # [m, T]
    nxt = ids_p[1:].reshape(m, T)  # [m, T]: row j of window k is token k·T + j + 1
    wt = w_p[1:].reshape(m, T)  # [m, T]
    keep = (wt != 0).any(axis=1)
    return Windows(np.ascontiguousarray(win[keep]), np.ascontiguousarray(nxt[keep]), np.ascontiguousarray(wt[keep]), int(pad_id))


def cut_windows_reference(ids: np.ndarray, weight: np.ndarray, T: int, pad_id: int) -> Windows:
    """The seed's loop, window by window: the reference `cut_windows` is tested against."""
    out_ids, out_next, out_w = [], [], []
    n = len(ids)
    at = 0
    while at < n:
        w = list(ids[at:min(at + T, n)])
        r = [float(weight[at + j + 1]) if at + j + 1 < n else 0.0 for j in range(len(w))]
        if all(x == 0.0 for x in r):
            at += T
            continue
        nx = [int(ids[at + j + 1]) if at + j + 1 < n else pad_id for j in range(len(w))]
        pad = T - len(w)
        out_ids.append(w + [pad_id] * pad)
        out_w.append(r + [0.0] * pad)
        out_next.append(nx + [pad_id] * pad)
        at += T
    shape = (len(out_ids), T)
    return Windows(np.array(out_ids, dtype=np.int64).reshape(shape), np.array(out_next, dtype=np.int64).reshape(shape),
                   np.array(out_w, dtype=np.float32).reshape(shape), int(pad_id))


# ── a mix of sources (cortiq.data.retain): counts and order ─────────────────────────────────────────────────────


def mix_counts(n_user: int, pools: list[int], share: float, repeat: bool, weights: list[float] | None = None) -> list[int]:
    """Windows per source: [n_user, c_1, ..., c_k]. The retain sources together get
    round(n_user·share/(1−share)) (so they are `share` of the whole), split in proportion
    to `weights` (None: evenly) by the largest remainders, the first ones taking one
    more on a tie; `repeat` False caps each at its pool (a held-out split is not
    repeated). With no user windows, every retain window of the split (without repeating)."""
    k = len(pools)
    if n_user == 0:
        return [0, *pools] if not repeat else [0] * (k + 1)
    total = int(round(n_user * share / (1.0 - share)))
    w = np.ones(k) if weights is None else np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()  # [k]
    each = np.floor(exact).astype(np.int64)
    more = np.argsort(-(exact - each), kind="stable")[: total - int(each.sum())]
    each[more] += 1
    each = [int(c) for c in each]
    if not repeat:
        each = [min(c, p) for c, p in zip(each, pools)]
    return [n_user, *each]


def interleave(counts: list[int]) -> np.ndarray:
    """[Σ counts] the source of each position: source k's j-th item sits at (j + ½)/c_k
    of the way, all sorted together (ties by source), so each source is spread evenly
    and any run of B positions holds c_k·B/N of source k to within one."""
    counts = [int(c) for c in counts]
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [N]
    if not len(labels):
        return labels
    within = np.arange(len(labels), dtype=np.int64) - np.repeat(np.cumsum([0, *counts[:-1]]), counts)  # [N]
    keys = (within + 0.5) / np.repeat(np.maximum(counts, 1), counts)
    return labels[np.lexsort((labels, keys))]


def draw(n_pool: int, count: int, seed: int, source: int, split: int) -> np.ndarray:
    """[count] window numbers of one retain source: a seeded permutation of its
    pool, repeated from the start as often as `count` needs."""
    if count and not n_pool:
        raise CortiqError("retain: a source with no windows cannot fill its share")
    perm = np.random.default_rng([seed, source, split]).permutation(n_pool)
    return np.resize(perm, count).astype(np.int64)


def mix_windows(td: Tdata, split: str, T: int, pad_id: int, loss_on: str = "answer") -> Windows:
    """The windows of `split` of a mix directory: each source's records (FNV order)
    cut on their own, every user window once, each retain source's drawn to its
    exact count (train: repeated as needed; val: at most its pool), interleaved."""
    mix = td.meta["mix"]
    names, bounds = list(mix["names"]), [int(x) for x in mix["rows"]] + [len(td)]
    rows = td.hash_order(split)
    per = []
    for k in range(len(names)):
        mine = rows[(rows >= bounds[k]) & (rows < bounds[k + 1])]
        ids, weight = td.stream_rows(mine, loss_on)
        per.append(cut_windows(ids, weight, T, pad_id))
    train = split == "train"
    counts = mix_counts(len(per[0]), [len(w) for w in per[1:]], float(mix["share"]), repeat=train,
                        weights=mix.get("weights"))
    for k in range(1, len(names)):
        if train and counts[k] and not len(per[k]):
            raise CortiqError(f"{td.path}: retain source {names[k]} has no train window of {T} tokens")
    pick = [np.arange(counts[0], dtype=np.int64)] + [
        draw(len(per[k]), counts[k], int(mix["seed"]), k, SPLITS.index(split)) for k in range(1, len(names))]
    labels = interleave(counts)  # [N]
    # position i takes the next unused window of its source: sources laid end to end, then gathered
    slot = np.empty(len(labels), dtype=np.int64)
    slot[np.argsort(labels, kind="stable")] = np.arange(len(labels), dtype=np.int64)

    def cat(attr):
        parts = [getattr(w, attr)[p] for w, p in zip(per, pick)]
        return np.concatenate(parts)[slot] if len(labels) else np.zeros((0, T), getattr(per[0], attr).dtype)

    return Windows(cat("ids"), cat("next"), cat("weight"), int(pad_id), labels, tuple(names))


def windows(td: Tdata, split: str, T: int, pad_id: int | None = None, loss_on: str = "answer") -> Windows:
    """The windows of `split` (records in FNV-1a order of their rids); `pad_id` defaults to the EOS id.
    A mix of retain data (cortiq.data.retain) is cut source by source and interleaved at its shares."""
    pad = td.eos_id if pad_id is None else int(pad_id)
    if td.meta.get("mix"):
        return mix_windows(td, split, T, pad, loss_on)
    ids, weight = td.stream(split, loss_on)
    return cut_windows(ids, weight, T, pad)


# ── packed windows (MTP) ─────────────────────────────────────────────────


@dataclass
class Packed:
    """One data set of a packed-windows spec."""

    name: str
    #: [N, T] int64, the last window padded with pad_id when short
    ids: np.ndarray
    #: [N] int64 real length of each window (T but for a short last one)
    lengths: np.ndarray
    #: [N] bool: held out of training (what a measure counts)
    held: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def held_out(i: np.ndarray | int, hold_all: bool = False) -> np.ndarray | bool:
    """Every tenth window (index % 10 == 9) is held out; `hold_all` holds out all (a measure of unseen text)."""
    i = np.asarray(i)
    out = np.ones(i.shape, dtype=bool) if hold_all else (i % 10 == 9)
    return out if out.shape else bool(out)


def xorshift_order(n: int) -> np.ndarray:
    """[n] the MTP record shuffle of the original GPU tool: Fisher–Yates driven by xorshift64 from 0x9e3779b97f4a7c15.

    A loop over records (not tokens): each swap depends on the generator's previous state."""
    perm = np.arange(n, dtype=np.int64)
    rng = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for i in range(n - 1, 0, -1):
        rng ^= (rng << 13) & mask
        rng ^= rng >> 7
        rng ^= (rng << 17) & mask
        j = rng % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def pack_one(td: Tdata, T: int, cap: int | None, min_len: int, pad_id: int | None = None, name: str | None = None,
             hold_all: bool = False) -> Packed:
    """One data set packed: train records in xorshift order, one stream capped at `cap` tokens, windows of T."""
    if T < 1:
        raise CortiqError(f"window length must be at least 1, not {T}")
    pad = td.eos_id if pad_id is None else int(pad_id)
    rows = td.indices("train")[xorshift_order(len(td.indices("train")))]
    ids, _, _ = td.flat(rows)
    if cap is not None:
        ids = ids[:cap]  # the seed stops once the cap is reached, cutting the last record short
    n = len(ids)
    full = n // T
    rest = n - full * T
    keep_rest = rest > 0 and rest >= min_len
    m = full + int(keep_rest)
    out = np.full((m, T), pad, dtype=np.int64)  # [m, T]
    out.reshape(-1)[:full * T] = ids[:full * T]
    lengths = np.full(m, T, dtype=np.int64)
    if keep_rest:
        out[full, :rest] = ids[full * T:]
        lengths[full] = rest
    return Packed(name or td.path.name.removesuffix(".tdata"), out, lengths, held_out(np.arange(m), hold_all))


def packed_windows(spec: str, T: int, tokens: int | None = None, min_len: int = 1, pad_id: int | None = None,
                   hold_all: bool = False) -> list[Packed]:
    """Every data set of `spec` (`PATH[@TOKENS]`, comma-separated; `tokens` caps those without their own)."""
    out = []
    for path, cap in parse_data_spec(spec):
        td = Tdata.open(path)
        out.append(pack_one(td, T, cap if cap is not None else tokens, min_len, pad_id, Path(path).name.removesuffix(".tdata"), hold_all))
    return out
