"""Stage outputs: content digests, directories finished by `meta.json`, Arrow files.

Every stage output lives in its own directory named by its digest, a hash of
the stage's name and version, its settings and the digests of its inputs, so
the same work is never done twice, with or without Prefect (whose task cache
key is that digest). A directory is written as `NAME.partial/`, `meta.json`
goes in last and the directory is renamed: a directory without `meta.json`
is an interrupted stage and is redone.

Two processes may share a cortiq home: `locked` serialises the writers of one
output (the second waits, then finds the output complete and reuses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

from .errors import CortiqError, writing

META = "meta.json"


def _canon(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _canon(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _canon(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def digest(stage: str, version: str | int, settings: Any = None, inputs: list[str] | tuple[str, ...] = ()) -> str:
    """The digest of a stage output: 32 hex digits."""
    blob = json.dumps({"stage": stage, "version": str(version), "settings": _canon(settings), "inputs": list(inputs)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def file_digest(path: str | os.PathLike) -> str:
    """A content digest of an input file or stage directory.

    A CMF model: the hash of its recorded per-tensor sha256s and its document
    less provenance (cheap: no tensor is read). A stage directory: its
    meta.json's `digest`; a Hugging Face checkpoint (config.json, no meta.json):
    its files' names and digests.
    Any other file: sha256 of its bytes."""
    p = Path(path)
    if p.is_dir() and not is_complete(p) and (p / "config.json").is_file():
        # a Hugging Face checkpoint (no stage wrote it): its files by name and content
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(f"{f.relative_to(p)}={file_digest(f)};".encode())
        return h.hexdigest()[:32]
    if p.is_dir():
        meta = read_meta(p)
        if "digest" not in meta:
            raise CortiqError(f"{p}: meta.json has no digest")
        return str(meta["digest"])
    if p.suffix == ".cmf":
        from .cmf import open_cmf

        doc = dict(open_cmf(p).doc)
        doc.pop("provenance", None)
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
    h = hashlib.sha256()
    try:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 18), b""):
                h.update(chunk)
    except FileNotFoundError:
        raise CortiqError(f"{p}: no such file") from None
    return h.hexdigest()[:32]


def parse_data_spec(spec: str) -> list[tuple[str, int | None]]:
    """A data spec, `PATH[@TOKENS],...` (the MTP stages' data: tdata directories, each capped at a
    token count) → [(path, token cap or None)]."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        path, sep, cap = item.rpartition("@")
        if sep and "/" not in cap:  # an @ inside a folder name is part of the path
            if not (cap.isascii() and cap.isdigit() and int(cap) > 0):
                raise CortiqError(f"data spec {item!r}: the token count {cap[:40]!r} is not a positive integer "
                                  "(PATH@TOKENS)")
            out.append((path, int(cap)))
        else:
            out.append((item, None))
    if not out:
        raise CortiqError(f"no data set in the spec {spec!r} (PATH[@TOKENS], comma-separated)")
    return out


def is_complete(d: str | os.PathLike) -> bool:
    return (Path(d) / META).is_file()


def read_meta(d: str | os.PathLike) -> dict:
    p = Path(d) / META
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.lexists(d):  # a path mistyped, not a run cut short
            raise CortiqError(f"{d}: no such file or directory") from None
        if not os.path.isdir(d):
            raise CortiqError(f"{d}: a file, not a stage output (a directory)") from None
        raise CortiqError(f"{d}: not a finished stage output (no {META}; an interrupted run? delete it and run again)") from None
    except json.JSONDecodeError:
        raise CortiqError(f"{p}: not JSON") from None


@contextlib.contextmanager
def locked(path: str | os.PathLike, wait: bool = True) -> Iterator[None]:
    """Hold the exclusive lock of `path` (on the file `PATH.lock`) across processes.

    An flock: the kernel releases it when its holder exits, however it dies
    (kill -9 included), so a lock is never stale. A second holder waits,
    saying once on stderr what it waits for; with `wait=False` it raises
    CortiqError instead. The holder removes the lock file as it lets go; a
    waiter that then gets the lock of the removed file sees that the name no
    longer leads to it and locks the name afresh. Not re-entrant: a process
    that holds a path must not lock it again."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    said = False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise CortiqError(f"{path}: another cortiq process is writing it (lock {lock})") from None
                if not said:
                    print(f"cortiq: {path}: another process is writing it; waiting", file=sys.stderr, flush=True)
                    said = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # the previous holder removed this file: lock the name again
    try:
        yield
    finally:
        try:
            os.unlink(lock)
        finally:
            os.close(fd)


@contextlib.contextmanager
def stage_dir(final: str | os.PathLike, meta: dict) -> Iterator[Path]:
    """Write a stage output: yields `FINAL.partial/` to fill; on success
    writes `meta.json` (with `meta`) last and renames it to `FINAL`. On error
    the partial directory is removed. Another process writing the same output
    waits (the partial directory is one writer's alone)."""
    final = Path(final)
    part = final.with_name(final.name + ".partial")
    with locked(part):
        if part.exists():
            shutil.rmtree(part)
        part.mkdir(parents=True)
        try:
            with writing(final):
                yield part
                write_text(part / META, _meta_json(meta))
                replace_dir(part, final)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise


def same_place(a: Path, b: Path) -> bool:
    """Whether two paths name one file or folder: the same path once `..` and symlinks are
    resolved, or the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


#: the names a writer of PATH uses beside it: the file it fills before the rename, the lock that
#: keeps a second writer out, and the old output set aside while a folder is replaced
_SIBLINGS = (".partial", ".lock", ".partial.lock", ".replaced")
#: the names beside an input that another writer of it may be using (and would remove)
_INPUT_SIBLINGS = (".partial", ".lock")


def _input_files(i: Path) -> list[Path]:
    """The files an input path stands for: a sharded CMF model's shards beside its first file
    (named by its header); any other path is itself."""
    if not i.is_file():
        return [i]
    from .cmf import _read_header

    try:
        meta = _read_header(i)[0].get("__metadata__")
        shards = json.loads(meta["cmf"]).get("shards") if isinstance(meta, dict) else None
    except (CortiqError, KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return [i]
    if not isinstance(shards, list):
        return [i]
    return [i] + [i.with_name(s) for s in shards if isinstance(s, str) and s and "/" not in s]


def _inside(path, folder) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def _input_clash(out: Path, i: Path, folder: bool, also: list[Path]) -> str | None:
    """Why writing `out` (and the files in `also`) would change the input `i`, or None."""
    if same_place(out, i):
        return f"the output is the input {i}"
    if folder and _inside(i, out):
        return f"the output folder holds the input {i}, which replacing the folder would delete"
    if i.is_dir() and _inside(out, i):
        return f"the output is inside the input folder {i}"
    files = _input_files(i)
    for f in files[1:]:
        if same_place(out, f):
            return f"the output is {f.name}, a shard of the input {i}"
    used = [out.with_name(out.name + s) for s in _SIBLINGS] + [x for a in also for x in (a, a.with_name(a.name + ".partial"))]
    for o in used:
        for f in files:
            if same_place(o, f):
                what = "the input" if f == i else f"{f.name}, a shard of the input"
                return f"writing it uses {o.name}, which is {what} {i}"
    for f in files:
        for s in _INPUT_SIBLINGS:
            if same_place(out, f.with_name(f.name + s)):
                return f"the output is the {s} file of the input {f}"
    return None


#: what an output of each kind may replace unannounced (re-running a command into its own output):
#: a CMF file, a tdata directory (or an empty one); "new": nothing (an export is written for
#: other tools, and whatever is at its path is the user's)
OUTPUT_KINDS = ("cmf", "tdata", "new")


def check_output(out: str | os.PathLike, inputs, folder: bool = False, kind: str | None = None,
                 force: bool = False, also=()) -> None:
    """The one output rule of every writer, checked before any work.

    An output that is one of the command's inputs is refused, `force` or not, under any spelling
    (`..`, a symlink, a hard link): every writer replaces its output by a rename, which would
    silently replace that input. So is an output that is a shard of a sharded CMF input, inside
    an input folder, or whose own working names (PATH.partial, PATH.lock: `_SIBLINGS`) or the
    files in `also` (a report written beside it) are an input's file, and one that is an input's
    .partial or .lock (another writer of that input uses them). With `folder` (the output is a
    directory that replacing deletes whole), an input inside it is refused too. `inputs` may hold
    None (an optional input not given).

    Then, with `kind` (OUTPUT_KINDS), an existing output is replaced only when it is an output of
    that kind (a command run again), or with `force`; a directory is never replaced by a file."""
    out = Path(out)
    bad = file_in_way(out.parent)
    if bad is not None:
        raise CortiqError(f"{out}: {bad} is a file, not a folder")
    extra = [Path(a) for a in also]
    for i in inputs:
        why = None if i is None else _input_clash(out, Path(i), folder, extra)
        if why:
            raise CortiqError(f"{out}: {why}; give another output path")
    if kind is None or not os.path.lexists(out):
        return
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"output kind {kind!r} is not one of {OUTPUT_KINDS}")
    if not folder and out.is_dir():
        raise CortiqError(f"{out}: is a directory; give a file name for the output")
    what = _not_replaceable(out, kind)
    if what and not force:
        raise CortiqError(f"{out} exists ({what}); pass --force to overwrite")


def _not_replaceable(out: Path, kind: str) -> str | None:
    """Why the existing `out` is not an output of `kind` that a command may replace (None: it is)."""
    if kind == "tdata" or (kind == "new" and out.is_dir()):
        if not out.is_dir():
            return "a file, not a directory"
        if not any(out.iterdir()):
            return None
        if kind == "new":
            return "a directory that is not empty"
        try:
            stage = json.loads((out / META).read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            stage = None
        return None if stage == "tdata" else f"a directory that is not tdata: no {META} of a tdata build"
    if kind == "new":
        return "a file"
    from .cmf import _read_header

    try:
        header, _ = _read_header(out)
    except CortiqError:
        return "not a CMF model"
    meta = header.get("__metadata__")
    return None if isinstance(meta, dict) and "cmf" in meta else "a safetensors file that is not a CMF model"


def replace_dir(part: Path, final: Path) -> None:
    """Rename the finished directory `part` to `final`, replacing whatever `final` was (a file, a
    directory) only once `part` is in place: until then the old output is intact."""
    if not os.path.lexists(final):
        os.replace(part, final)
        return
    old = final.with_name(final.name + ".replaced")
    if os.path.lexists(old):
        _remove(old)
    os.replace(final, old)
    try:
        os.replace(part, final)
    except BaseException:
        os.replace(old, final)
        raise
    _remove(old)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def write_arrow(path: str | os.PathLike, table: pa.Table) -> None:
    """An Arrow IPC file (written to `.partial`, then renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with writing(path), pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` into `path` whole (written to `.partial`, then renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with writing(path):
            tmp.write_text(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_arrow(path: str | os.PathLike) -> pa.Table:
    """An Arrow IPC file, memory-mapped (columns are views of the map)."""
    try:
        src = pa.memory_map(str(path), "r")
        return ipc.open_file(src).read_all()
    except FileNotFoundError:
        raise CortiqError(f"{path}: no such file") from None
    except pa.ArrowInvalid as e:
        raise CortiqError(f"{path}: not an Arrow file ({e})") from None


def home() -> Path:
    """The cortiq home: outputs, caches and the default MLflow store (CORTIQ_HOME, else ~/.cortiq)."""
    return Path(os.environ.get("CORTIQ_HOME", Path.home() / ".cortiq"))


def work_root(work: str | os.PathLike | None = None) -> Path:
    """The folder stage outputs go under: `work` (a command's --work), else the cortiq home's
    work/. A file where it or a folder above it should be is refused now, in one line, rather
    than as the first stage's "File exists"."""
    d = Path(work) if work else home() / "work"
    bad = file_in_way(d)
    if bad is not None:
        label = f"--work {d}" if work else f"the work folder {d}"
        raise CortiqError(f"{label} is a file, not a folder" if bad == d else f"{label}: {bad} is a file, not a folder")
    return d


def file_in_way(d: Path) -> Path | None:
    """What keeps the folder `d` from being one or being made: the nearest existing path from it
    up, where that is not a folder (None: it is)."""
    for p in (d, *d.parents):
        if os.path.exists(p):
            return None if os.path.isdir(p) else p
    return None


def finish_dir(d: str | os.PathLike, meta: dict) -> None:
    """Mark a directory filled in place (a resumable stage's work directory,
    whose checkpoints must outlive a failed run) as finished: `meta.json`,
    written atomically, last."""
    write_text(Path(d) / META, _meta_json(meta))


def _meta_json(meta: dict) -> str:
    return json.dumps(meta, indent=2, sort_keys=True, default=str)
