"""WindowRows over many record batches (a stage writes one per pass batch): a gathered batch is
the windows' rows in the order asked, views of the map stay views, files join as one index."""

import numpy as np
import pyarrow as pa

from cortiq.heal.rows import RowWriter, WindowRows, open_files, open_table


def _file(path, rows: np.ndarray, per: int):
    with RowWriter(path, {"x": (pa.float32(), rows[0].size)}) as wr:
        for a in range(0, len(rows), per):
            wr.write(x=rows[a : a + per].reshape(len(rows[a : a + per]), -1))
    return path


def test_take_gathers_across_record_batches(tmp_path):
    rows = np.arange(11 * 3 * 2, dtype=np.float32).reshape(11, 3, 2)
    w = WindowRows(open_table(_file(tmp_path / "a.arrow", rows, 3)), "x", (3, 2))
    assert len(w.parts) == 4 and len(w) == 11 and not any(p.flags.owndata for p in w.parts)
    idx = [10, 0, 4, 4, 7, 2]
    assert np.array_equal(w.take(idx), rows[idx])
    assert w.take([]).shape == (0, 3, 2)


def test_files_join_as_one_index(tmp_path):
    a = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    b = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    wa = WindowRows(open_table(_file(tmp_path / "a.arrow", a, 2)), "x", (4,))
    wb = WindowRows(open_table(_file(tmp_path / "b.arrow", b, 2)), "x", (4,))
    both = np.concatenate([a, b])
    j = WindowRows.join([wa, wb])
    assert [p.ctypes.data for p in j.parts] == [p.ctypes.data for p in wa.parts + wb.parts]  # nothing copied
    idx = [7, 0, 5, 4, 1]
    assert np.array_equal(j.take(idx), both[idx])
    t = WindowRows(open_files(tmp_path, ["a.arrow", "b.arrow"]), "x", (4,))  # one rank's shards after another's
    assert np.array_equal(t.take(idx), both[idx])
    assert np.array_equal(WindowRows.of([a, b]).take(idx), both[idx])
