"""The one exception family the CLI turns into a single line on stderr, and the one line a
failed write becomes (the file and the cause)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Iterator


class CortiqError(Exception):
    """Bad input or a failed precondition; the message names the file and the problem."""


def write_error(path: str | os.PathLike, e: OSError) -> CortiqError:
    """The one line for a failed write of `path`: the file and the cause. A short write with
    no errno (numpy's tofile says "N requested and M written") is a full disk too."""
    short = e.errno is None and re.search(r"(\d+) requested and (\d+) written", str(e))
    if is_full(e):
        what = "no space left on device" if e.errno != errno.EDQUOT else "disk quota exceeded"
        got = f" ({short.group(2)} of {short.group(1)} bytes written)" if short else ""
        return CortiqError(f"{path}: {what} while writing{got}")
    return CortiqError(f"{path}: cannot write ({e.strerror or e})")


def is_full(e: OSError) -> bool:
    """Whether a failed write failed for want of space (ENOSPC, a quota, a short write)."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is None and "requested and" in str(e))


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Name `path` when the disk fills while it is written (`write_error`'s one line); other
    errors pass unchanged (the block may read as well as write)."""
    try:
        yield
    except OSError as e:
        if is_full(e):
            raise write_error(path, e) from None
        raise
