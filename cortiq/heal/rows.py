"""Per-window rows of an Arrow file, memory-mapped: fixed-size list columns
read as numpy views of the map, chunk by chunk (a stage writes one record
batch per pass batch, so a file has many chunks)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .. import store


class WindowRows:
    """`column` of an Arrow file whose rows are windows, each a fixed-size list
    reshaped to `shape`; `take(idx)` gathers windows [len(idx), *shape]."""

    def __init__(self, table: pa.Table, column: str, shape: tuple[int, ...]):
        parts = []
        for ch in table.column(column).chunks:
            flat = ch.flatten() if ch.offset else ch.values  # sliced chunks carry an offset
            parts.append(flat.to_numpy(zero_copy_only=True).reshape((len(ch), *shape)))
        self._set(parts, shape)

    @classmethod
    def of(cls, parts: list[np.ndarray], shape: tuple[int, ...] | None = None) -> "WindowRows":
        """Rows over arrays already at hand ([n_i, *shape] each, kept as they are, not copied)."""
        self = cls.__new__(cls)
        self._set(list(parts), tuple(parts[0].shape[1:]) if shape is None else shape)
        return self

    @classmethod
    def join(cls, rows: list["WindowRows"]) -> "WindowRows":
        """Several files' rows as one index, in order (their maps shared, nothing copied)."""
        return cls.of([p for r in rows for p in r.parts], rows[0].shape)

    def _set(self, parts: list[np.ndarray], shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.n = int(self.starts[-1])

    def __len__(self) -> int:
        return self.n

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype if self.parts else np.dtype(np.float32)

    def take(self, idx) -> np.ndarray:
        """Windows idx gathered [len(idx), *shape]: one fancy index per part they fall in."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if len(self.parts) == 1:
            return self.parts[0][idx]
        part = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((len(idx), *self.shape), dtype=self.dtype)
        for p in np.unique(part):
            sel = part == p
            out[sel] = self.parts[p][idx[sel] - self.starts[p]]
        return out


class RowWriter:
    """Streams record batches of per-window fixed-size lists into `path` (`.partial`, renamed on close)."""

    def __init__(self, path, fields: dict[str, tuple[pa.DataType, int]], scalars: dict[str, pa.DataType] | None = None):
        import os

        self.path = path
        self.tmp = path.with_name(path.name + ".partial")
        self.fields = fields
        self.scalars = scalars or {}
        self.schema = pa.schema([pa.field(k, pa.list_(t, n)) for k, (t, n) in fields.items()]
                                + [pa.field(k, t) for k, t in self.scalars.items()])
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_file(self.sink, self.schema)
        self._os = os

    def write(self, **cols: np.ndarray) -> None:
        arrays = []
        for k, (t, n) in self.fields.items():
            a = np.ascontiguousarray(cols[k]).reshape(-1)
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(a, type=t), n))
        for k, t in self.scalars.items():
            arrays.append(pa.array(np.asarray(cols[k]), type=t))
        self.writer.write_batch(pa.record_batch(arrays, schema=self.schema))

    def close(self) -> None:
        self.writer.close()
        self.sink.close()
        self._os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, exc_type, *_):
        # finished: renamed into place; failed: nothing left behind
        self.abort() if exc_type is not None else self.close()


def open_table(path) -> pa.Table:
    return store.read_arrow(path)


def open_files(d, names: list[str]) -> pa.Table:
    """Files `names` of directory `d` (one per rank, in order) as one table, memory-mapped."""
    from pathlib import Path

    tables = [open_table(Path(d) / n) for n in names]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def open_split(d, split: str, meta: dict) -> pa.Table:
    """A stage directory's `split` rows as one table: `SPLIT.arrow`, or the
    shards meta.json's `files` lists (one per rank), in order, memory-mapped."""
    return open_files(d, (meta.get("files") or {}).get(split) or [f"{split}.arrow"])
