"""tdata: tokenized records in one Arrow file inside a finished stage directory.

A record is one unit of text the stages train or score on: a prompt and its
answer, a chat, a few paragraphs of plain text. It carries its ids and the
position of its first scored token (`first`: the first answer token; 1 for
plain text, whose every token but the first is scored). Which tokens are
scored is decided when a stream is made (`loss_on`), not when records are built.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import CortiqError
from .. import store

STAGE = "tdata"
VERSION = 1
ARROW = "tdata.arrow"
SPLITS = ("train", "val", "test")
LOSS_ON = ("answer", "all")

SCHEMA = pa.schema([
    ("rid", pa.string()),
    ("split", pa.string()),
    ("category", pa.string()),
    ("ids", pa.list_(pa.uint32())),
    ("first", pa.int32()),
])

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


def fnv1a64(s: str) -> int:
    """FNV-1a 64 of the UTF-8 bytes of `s` (the stream order of a split)."""
    h = _FNV_OFFSET
    for b in s.encode("utf-8"):
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return h


def fnv1a64_many(strings: list[str]) -> np.ndarray:
    """[R] uint64 FNV-1a 64 of each string: one pass per byte position over all strings at once."""
    raw = [x.encode("utf-8") for x in strings]
    if not raw:
        return np.zeros(0, dtype=np.uint64)
    lens = np.fromiter((len(b) for b in raw), dtype=np.int64, count=len(raw))
    width = int(lens.max())
    buf = np.frombuffer(b"".join(b.ljust(width, b"\0") for b in raw), dtype=np.uint8).reshape(len(raw), width)
    h = np.full(len(raw), _FNV_OFFSET, dtype=np.uint64)
    prime = np.uint64(_FNV_PRIME)
    for j in range(width):  # uint64 arithmetic wraps, as a wrapping multiply does
        live = lens > j
        h[live] = (h[live] ^ buf[live, j].astype(np.uint64)) * prime
    return h


def tokenizer_digest(tokenizer_json: str) -> str:
    """sha256 of the tokenizer.json text: what ties a tdata to the models that may read it."""
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


def hash_unit(rid: str) -> float:
    """Where `rid` falls in [0, 1): the first 8 bytes of its sha256 (apart from the FNV stream order)."""
    return int.from_bytes(hashlib.sha256(rid.encode("utf-8")).digest()[:8], "big") / 2.0**64


def assign_splits(rids: list[str], given: list[str | None], fractions: tuple[float, float, float]) -> list[str]:
    edges = np.cumsum(fractions)[:-1]  # [2]
    out = []
    for rid, g in zip(rids, given):
        out.append(g if g is not None else SPLITS[int(np.searchsorted(edges, hash_unit(rid), side="right"))])
    return out


@dataclass
class Record:
    rid: str
    split: str
    category: str
    #: [L] uint32
    ids: np.ndarray
    #: index of the first scored token in `answer` mode (1 ≤ first ≤ L)
    first: int


def records_table(records: list[Record]) -> pa.Table:
    """The Arrow table of `records` (ids written as one flat buffer, not per record)."""
    lens = np.fromiter((len(r.ids) for r in records), dtype=np.int64, count=len(records))
    offsets = np.zeros(len(records) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate([np.asarray(r.ids, dtype=np.uint32) for r in records]) if records else np.zeros(0, np.uint32)
    ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.uint32()))
    return pa.table({
        "rid": pa.array([r.rid for r in records], pa.string()),
        "split": pa.array([r.split for r in records], pa.string()),
        "category": pa.array([r.category for r in records], pa.string()),
        "ids": ids,
        "first": pa.array([int(r.first) for r in records], pa.int32()),
    }, schema=SCHEMA)


def write_tdata(out: str | os.PathLike, records: list[Record], meta: dict) -> "Tdata":
    """The tdata directory `out` of `records` (written to `.partial`, renamed); `meta` gets the
    counts and is written last as meta.json."""
    table = records_table(records)
    with store.stage_dir(out, meta) as part:
        store.write_arrow(part / ARROW, table)
        meta["counts"] = Tdata(part, meta, table).counts()  # the dict stage_dir writes last
    return Tdata.open(out)


class Tdata:
    """A finished tdata stage directory, memory-mapped.

    Columns stay Arrow buffers; `flat(split)` hands out numpy views of them, so
    a stream over a million tokens is built without a Python loop per token."""

    def __init__(self, path: Path, meta: dict, table: pa.Table):
        self.path = path
        self.meta = meta
        self.table = table
        ids = table.column("ids").combine_chunks()
        if isinstance(ids, pa.ChunkedArray):  # an empty table
            ids = pa.array([], pa.list_(pa.uint32()))
        # [R+1] record boundaries into the flat id buffer
        self._offsets = np.asarray(ids.offsets, dtype=np.int64)
        # [n] every record's ids, end to end
        self._flat = np.asarray(ids.values.to_numpy(zero_copy_only=False), dtype=np.uint32)
        self._rid = table.column("rid").to_pylist()
        self._split = np.asarray(table.column("split").to_pylist(), dtype=object)
        self._category = table.column("category").to_pylist()
        self._first = table.column("first").to_numpy().astype(np.int64)
        vocab = int(meta.get("vocab_size", 0))
        if vocab and self._flat.size and int(self._flat.max()) >= vocab:
            raise CortiqError(f"{path}: id {int(self._flat.max())} is outside the vocabulary ({vocab} ids)")

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Tdata":
        path = Path(path)
        meta = store.read_meta(path)  # raises on an unfinished directory
        if meta.get("stage") != STAGE:
            raise CortiqError(f"{path}: not a tdata directory (stage {meta.get('stage')!r})")
        table = store.read_arrow(path / ARROW)
        if not table.schema.equals(SCHEMA):
            raise CortiqError(f"{path / ARROW}: not a tdata table (columns {table.schema.names})")
        return cls(path, meta, table)

    # ── metadata ──
    @property
    def digest(self) -> str:
        return str(self.meta["digest"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return len(self._rid)

    @property
    def n_tokens(self) -> int:
        """Tokens in all records."""
        return int(self._offsets[-1]) if len(self._offsets) else 0

    def check_tokenizer(self, model) -> None:
        """Raise unless `model` (a CMF path or CmfFile) has the tokenizer these ids were made with."""
        from ..cmf import CmfFile, open_cmf

        f = model if isinstance(model, CmfFile) else open_cmf(model)
        tok = f.tokenizer or {}
        if not tok.get("json"):
            raise CortiqError(f"{f.path}: carries no tokenizer; {self.path} was tokenized with {self.meta['tokenizer_digest'][:12]}")
        got = tokenizer_digest(tok["json"])
        if got != self.meta["tokenizer_digest"]:
            raise CortiqError(f"{self.path}: tokenized with tokenizer {self.meta['tokenizer_digest'][:12]}, "
                              f"but {f.path} has tokenizer {got[:12]}: rebuild the data with --tokenizer {f.path}")
        if self._flat.size and int(self._flat.max()) >= f.arch.vocab_size:
            raise CortiqError(f"{self.path}: id {int(self._flat.max())} is outside {f.path}'s vocabulary ({f.arch.vocab_size} ids)")

    # ── records ──
    def indices(self, split: str | None) -> np.ndarray:
        """[R'] row numbers of `split` (all rows when None), in file order."""
        if split is None:
            return np.arange(len(self), dtype=np.int64)
        if split not in SPLITS:
            raise CortiqError(f"{self.path}: no split {split!r} (one of {', '.join(SPLITS)})")
        return np.flatnonzero(self._split == split)

    def records(self, split: str | None = None) -> list[Record]:
        """The records of `split` in file order (ids are views of the map)."""
        o = self._offsets
        return [Record(self._rid[i], str(self._split[i]), self._category[i], self._flat[o[i]:o[i + 1]], int(self._first[i]))
                for i in self.indices(split)]

    def hash_order(self, split: str) -> np.ndarray:
        """[R'] row numbers of `split` sorted by the FNV-1a 64 hash of the rid (a fixed shuffle)."""
        idx = self.indices(split)
        keys = fnv1a64_many([self._rid[i] for i in idx])
        return idx[np.argsort(keys, kind="stable")]

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return self._offsets[rows + 1] - self._offsets[rows]

    def flat(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The records `rows` end to end: (ids [n] uint32, position within its record [n], record start [R'])."""
        rows = np.asarray(rows, dtype=np.int64)
        lens = self.lengths(rows)  # [R']
        starts = np.zeros(len(rows), dtype=np.int64)  # [R'] where each record begins in the result
        np.cumsum(lens[:-1], out=starts[1:])
        n = int(lens.sum())
        # position j of the result is token (j - start) of its record: one gather, no loop
        pos = np.arange(n, dtype=np.int64) - np.repeat(starts, lens)  # [n]
        src = np.repeat(self._offsets[rows], lens) + pos  # [n]
        return self._flat[src], pos, starts

    def stream(self, split: str, loss_on: str = "answer", order: str = "hash") -> tuple[np.ndarray, np.ndarray]:
        """The seed's `Stream`: the split's records end to end, (ids [n] int64, weight [n] float32).

        A token weighs 1 when it is scored: in `answer` mode from its record's
        `first` on, in `all` mode every token but its record's first (nothing
        inside a record predicts it). `order`: "hash" (FNV-1a of the rid) or "file"."""
        if loss_on not in LOSS_ON:
            raise CortiqError(f"loss_on must be one of {', '.join(LOSS_ON)}, not {loss_on!r}")
        rows = self.hash_order(split) if order == "hash" else self.indices(split)
        ids, pos, _ = self.flat(rows)
        if loss_on == "answer":
            first = np.repeat(self._first[rows], self.lengths(rows))  # [n]
            weight = pos >= first
        else:
            weight = pos >= 1
        return ids.astype(np.int64), weight.astype(np.float32)

    def counts(self) -> dict:
        """Records, tokens and scored tokens (answer mode) per split and per category."""
        lens = self._offsets[1:] - self._offsets[:-1]
        scored = np.maximum(lens - self._first, 0)
        out: dict = {"splits": {}, "categories": {}}
        for key, col in (("splits", self._split), ("categories", np.asarray(self._category, dtype=object))):
            present = set(col.tolist())
            for v in ([s for s in SPLITS if s in present] if key == "splits" else sorted(present)):
                m = col == v
                out[key][v] = {"records": int(m.sum()), "tokens": int(lens[m].sum()), "scored": int(scored[m].sum())}
        out["records"], out["tokens"], out["scored"] = len(self), int(lens.sum()), int(scored.sum())
        return out
