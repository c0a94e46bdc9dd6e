"""CMF, the model file: a safetensors file whose `__metadata__` holds one key,
`cmf`, a JSON document.

The document::

    {"format": "cmf", "version": 1,
     "arch": {...},                       # cortiq.arch.Arch
     "tokenizer": {"json": "<tokenizer.json text>", "eos_ids": [..], "bos_id": ..,
                   "special_ids": [..], "chat_template": ".." | null},
     "codecs": {name: {"codec": "q8", "shape": [..]}},   # tensors not stored f32/f16/bf16
     "hashes": {name: "<sha256 of the stored bytes>"},
     "provenance": {stage: {...}, ...},   # each stage adds its own key
     "shards": ["m-00002-of-00003.cmf", ...]}             # first file only, when sharded

Tensors are read lazily from a memory map; the writer streams (it holds one
tensor at a time) and writes `NAME.partial` files that are renamed only when
complete, shards before the first file, so a reader never sees half a model.
Quantized tensors are stored as flat uint8 tensors (the codec says how to read
them); plain ones as typed tensors of their logical shape, so any safetensors
reader can open a CMF file.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import codecs
from .arch import Arch
from .errors import CortiqError

FORMAT_VERSION = 1
#: default shard limit; a model over it is written as numbered shards
SHARD_BYTES = 4 << 30
_HEADER_MAX = 100 << 20  # the safetensors library refuses larger headers
#: the layer index of a decoder tensor's name
_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")
_ST_DTYPES = {
    "F32": (np.float32, torch.float32, 4),
    "F16": (np.float16, torch.float16, 2),
    "BF16": (np.int16, torch.bfloat16, 2),
    "U8": (np.uint8, torch.uint8, 1),
    "I8": (np.int8, torch.int8, 1),
    "I32": (np.int32, torch.int32, 4),
    "I64": (np.int64, torch.int64, 8),
}
_TORCH_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8"}


class CmfError(CortiqError):
    """A file that is not a readable CMF file (truncated, not CMF, hash mismatch...)."""


@dataclass
class TensorInfo:
    name: str
    codec: str
    shape: tuple[int, ...]
    #: safetensors dtype and shape of what is stored
    st_dtype: str
    st_shape: tuple[int, ...]
    shard: int
    #: absolute byte range in its shard file
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def shard_names(path: Path, n: int) -> list[Path]:
    """Paths of an n-shard model whose first file is `path`."""
    if n <= 1:
        return [path]
    stem = path.name[: -len(".cmf")] if path.name.endswith(".cmf") else path.name
    return [path] + [path.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.cmf") for i in range(1, n)]


def regular_size(path, limit: int | None = None, what: str = "CMF file", error: type = None) -> int:
    """The size of `path`, which must be a regular file (a FIFO or device would block or never end), at
    most `limit` bytes; each failure is one `error` (CmfError by default) naming the path."""
    error = error or CmfError
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (a pipe, socket or device cannot be a {what})")
    if limit is not None and st.st_size > limit:
        raise error(f"{path}: {st.st_size} bytes; a {what} is at most {limit} bytes")
    return st.st_size


def _loads(raw, what: str, path: Path):
    """JSON text → value; a deep nesting or bad text is one CmfError."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError):
        raise CmfError(f"{path}: not a CMF file ({what} is not JSON)") from None
    except RecursionError:
        raise CmfError(f"{path}: not a CMF file ({what} is nested too deeply)") from None


def _read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header of `path` and where its data begins."""
    size = regular_size(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CmfError(f"{path}: not a CMF file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _HEADER_MAX or 8 + n > size:
                raise CmfError(f"{path}: not a CMF file (no safetensors header)" if n > _HEADER_MAX or n == 0 else f"{path}: truncated (header runs past the end of the file)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CmfError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CmfError(f"{path}: is a directory, not a CMF file") from None
    except OSError as e:
        raise CmfError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CmfError(f"{path}: not a CMF file (the header is not JSON)") from None
    header = _loads(text, "the header", path)
    if not isinstance(header, dict):
        raise CmfError(f"{path}: not a CMF file (the header is not a JSON object)")
    return header, 8 + n


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v, lo: int = 0, hi: int = 1 << 62) -> bool:
    return isinstance(v, list) and all(_is_int(x) and lo <= x <= hi for x in v)


_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def check_doc(doc, path: Path) -> None:
    """The cmf document's schema: every key of the right type and within bounds, so
    nothing later trips over a list where a table belongs. Raises CmfError naming the key."""
    def bad(what: str):
        raise CmfError(f"{path}: malformed cmf document: {what}")

    if not isinstance(doc, dict):
        raise CmfError(f"{path}: not a CMF file (the cmf document is {type(doc).__name__}, not a JSON object)")
    if doc.get("format") != "cmf":
        raise CmfError(f"{path}: not a CMF file (format {str(doc.get('format'))[:40]!r})")
    v = doc.get("version")
    if not _is_int(v) or v < 1:
        bad(f"version is {str(v)[:40]!r}, not a positive integer")
    if v > FORMAT_VERSION:
        raise CmfError(f"{path}: CMF version {v} is newer than this cortiq reads ({FORMAT_VERSION})")
    tok = doc.get("tokenizer")
    if tok is not None:
        if not isinstance(tok, dict):
            bad(f"tokenizer is {type(tok).__name__}, not a table")
        if not isinstance(tok.get("json"), (str, type(None))):
            bad("tokenizer.json is not a string")
        if not _int_list(tok.get("eos_ids", []), 0, 1 << 31):
            bad("tokenizer.eos_ids is not a list of token ids")
        if not _int_list(tok.get("special_ids", []) or [], 0, 1 << 31):
            bad("tokenizer.special_ids is not a list of token ids")
        b = tok.get("bos_id")
        if b is not None and not (_is_int(b) and 0 <= b < 1 << 31):
            bad("tokenizer.bos_id is not a token id")
        if not isinstance(tok.get("chat_template"), (str, type(None))):
            bad("tokenizer.chat_template is not a string")
    c = doc.get("codecs", {})
    if not isinstance(c, dict):
        bad(f"codecs is {type(c).__name__}, not a table")
    for name, e in c.items():
        if not isinstance(e, dict) or not isinstance(e.get("codec"), str) or not _int_list(e.get("shape")) \
                or len(e["shape"]) > 8:
            bad(f"codecs entry of {name[:80]!r} is not {{codec: name, shape: [non-negative integers]}}")
    h = doc.get("hashes", {})
    if not isinstance(h, dict):
        bad(f"hashes is {type(h).__name__}, not a table")
    for name, x in h.items():
        if not isinstance(x, str) or not _SHA256.fullmatch(x):
            bad(f"the hash of {name[:80]!r} is not a sha256 hex string")
    if not isinstance(doc.get("provenance", {}), dict):
        bad(f"provenance is {type(doc.get('provenance')).__name__}, not a table")
    sh = doc.get("shards", [])
    if not isinstance(sh, list) or not all(isinstance(x, str) for x in sh):
        bad("shards is not a list of file names")
    for x in sh:
        # a shard lies beside the first file: a path is never followed out of its folder
        if not x or "/" in x or "\\" in x or x in (".", "..") or "\0" in x:
            bad(f"shard {x[:80]!r} is not a plain file name beside {path.name}")
    if len(set(sh)) != len(sh) or path.name in sh:
        bad("shards are named twice")


class CmfFile:
    """A CMF model opened for reading: metadata at once, tensors on demand.

    `tensor(name)` decodes to f32 (or `dtype`); `stored(name)` is the raw
    storage tensor, a view of the memory map (no copy)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header, data0 = _read_header(self.path)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not isinstance(meta.get("cmf"), str):
            raise CmfError(f"{self.path}: not a CMF file (a safetensors file without the cmf document)")
        self.doc: dict = _loads(meta["cmf"], "the cmf document", self.path)
        check_doc(self.doc, self.path)
        try:
            self.arch = Arch.from_dict(self.doc["arch"])
        except (KeyError, TypeError, ValueError, CortiqError) as e:
            raise CmfError(f"{self.path}: the arch is missing or malformed ({e})") from None
        self.paths = [self.path] + [self.path.with_name(s) for s in self.doc.get("shards", [])]
        self.infos: dict[str, TensorInfo] = {}
        self._maps: list[np.memmap | None] = [None] * len(self.paths)
        cdoc = self.doc.get("codecs", {})
        for si, p in enumerate(self.paths):
            if si == 0:
                h, d0 = header, data0
            else:
                if not os.path.lexists(p):
                    raise CmfError(f"{self.path}: shard {p.name} is missing")
                h, d0 = _read_header(p)
                smeta = h.pop("__metadata__", None) or {}
                try:
                    sdoc = json.loads(smeta["cmf_shard"])
                    ok = sdoc["index"] == si and sdoc["of"] == len(self.paths)
                except (KeyError, TypeError, ValueError, RecursionError):
                    ok = False
                if not ok:
                    raise CmfError(f"{p}: not shard {si + 1} of {len(self.paths)} of {self.path.name}")
            size = regular_size(p)
            ranges = []
            for name, e in h.items():
                try:
                    b, en = e["data_offsets"]
                    st_dtype, st_shape = e["dtype"], e["shape"]
                    if not (_is_int(b) and _is_int(en) and isinstance(st_dtype, str) and _int_list(st_shape)
                            and len(st_shape) <= 8):
                        raise TypeError
                    st_shape = tuple(st_shape)
                except (KeyError, TypeError, ValueError):
                    raise CmfError(f"{p}: not a CMF file (malformed entry {name[:80]!r}: offsets and shape must be "
                                   "non-negative integers)") from None
                if st_dtype not in _ST_DTYPES:
                    raise CmfError(f"{p}: tensor {name!r} has unsupported dtype {st_dtype[:20]}")
                if en - b != math.prod(st_shape) * _ST_DTYPES[st_dtype][2] or b > en or b < 0:
                    raise CmfError(f"{p}: tensor {name!r}: its byte range does not match its shape")
                if d0 + en > size:
                    raise CmfError(f"{p}: truncated ({size} bytes, tensor {name!r} needs {d0 + en})")
                if name in self.infos:
                    raise CmfError(f"{p}: tensor {name!r} appears twice")
                if not _NAME.fullmatch(name):  # exporters make file keys of names: no paths, no odd characters
                    raise CmfError(f"{p}: tensor name {name[:80]!r} is not a dotted name (letters, digits, _ and .)")
                ranges.append((b, en, name))
                if name in cdoc:
                    codec, shape = self._coded(p, name, cdoc[name], st_dtype, st_shape)
                else:
                    if st_dtype not in codecs.PLAIN:
                        raise CmfError(f"{p}: tensor {name!r} is {st_dtype} with no codec recorded")
                    codec, shape = codecs.PLAIN[st_dtype], st_shape
                self.infos[name] = TensorInfo(name, codec, shape, st_dtype, st_shape, si, d0 + b, d0 + en)
            # as safetensors requires: the tensors tile the data, in order, without gaps or overlaps
            end = 0
            for b, en, name in sorted(ranges):
                if b != end:
                    raise CmfError(f"{p}: tensor {name!r} does not start where the previous one ends")
                end = en
            if d0 + end > size:
                raise CmfError(f"{p}: truncated ({size} bytes, the header needs {d0 + end})")
            if d0 + end < size:  # bytes no tensor owns: another file's tail, or one appended to
                raise CmfError(f"{p}: {size - d0 - end} trailing bytes after the last tensor")
        orphans = sorted(set(cdoc) - set(self.infos))
        if orphans:
            raise CmfError(f"{self.path}: codec entries for tensors the file does not hold: {orphans[:4]}")
        self._check_arch()

    def _check_arch(self) -> None:
        """The arch against the tensors present, before anything is sized from it: no tensor of a
        layer the arch does not have, an embedding of the arch's [vocab, hidden]. (A file may hold
        fewer tensors than a model, a tokenizer carrier say: `check_layers` is for loading.)"""
        a = self.arch
        layers = self._layers()
        if layers and max(layers) >= a.num_layers:
            raise CmfError(f"{self.path}: holds tensors of layer {max(layers)}, its arch says {a.num_layers} layers")
        emb = self.infos.get("model.embed_tokens.weight")
        if emb is not None and emb.shape != (a.vocab_size, a.hidden_size):
            raise CmfError(f"{self.path}: model.embed_tokens.weight is {list(emb.shape)}, its arch says "
                           f"[{a.vocab_size}, {a.hidden_size}] (vocab, hidden)")

    def _layers(self) -> set[int]:
        return {int(m.group(1)) for n in self.infos if (m := _LAYER.match(n))}

    def check_layers(self) -> None:
        """Refuse a file that does not hold tensors of exactly the layers its arch counts (before a
        model of that many layers is built)."""
        layers, n = self._layers(), self.arch.num_layers
        if layers != set(range(n)):
            raise CmfError(f"{self.path}: holds tensors of {len(layers)} layers, its arch says {n}")

    @staticmethod
    def _coded(p: Path, name: str, entry, st_dtype: str, st_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """(codec, logical shape) of a tensor the document says is encoded, checked against its storage."""
        codec, shape = entry["codec"], tuple(entry["shape"])  # their types: check_doc
        try:
            c = codecs.get(codec)  # unknown codec: a clear error now, not at first use
        except codecs.CodecError as e:
            raise CmfError(f"{p}: tensor {name!r}: {e}") from None
        want = (_TORCH_TO_ST[c.dtype], shape) if c.plain else ("U8", (c.nbytes(shape),))
        if (st_dtype, st_shape) != want:
            raise CmfError(f"{p}: tensor {name!r}: stored as {st_dtype}{list(st_shape)}, codec {codec} of "
                           f"{list(shape)} needs {want[0]}{list(want[1])}")
        return codec, shape

    # ── metadata ──
    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    @property
    def tokenizer(self) -> dict | None:
        return self.doc.get("tokenizer")

    @property
    def provenance(self) -> dict:
        return self.doc.get("provenance", {})

    @property
    def eos_id(self) -> int:
        tok = self.tokenizer or {}
        ids = tok.get("eos_ids") or [0]
        return int(ids[0])

    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CmfError(f"{self.path}: no tensor {name!r}") from None

    # ── data ──
    def _map(self, shard: int) -> np.memmap:
        m = self._maps[shard]
        if m is None:
            # copy-on-write: tensors made from it are writable, the file never changes
            m = self._maps[shard] = np.memmap(self.paths[shard], dtype=np.uint8, mode="c")
        return m

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of `name` (a uint8 view of the memory map)."""
        i = self.info(name)
        return self._map(i.shard)[i.start : i.end]

    def stored(self, name: str) -> torch.Tensor:
        """The storage tensor of `name`, as safetensors types it (no copy)."""
        i = self.info(name)
        np_dt, t_dt, _ = _ST_DTYPES[i.st_dtype]
        arr = self.raw(name).view(np_dt).reshape(i.st_shape)
        t = torch.from_numpy(arr)
        return t.view(t_dt) if t_dt == torch.bfloat16 else t

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`name` decoded to its logical shape in `dtype` (a fresh tensor)."""
        i = self.info(name)
        st = self.stored(name)
        out = codecs.get(i.codec).decode(st, i.shape)
        if out.dtype != dtype or (out.numel() and out.data_ptr() == st.data_ptr()):
            out = out.to(dtype, copy=True)
        return out

    def hash_of(self, name: str) -> str:
        return hashlib.sha256(self.raw(name)).hexdigest()

    def check_hash(self, name: str) -> None:
        """Refuse `name` unless its stored bytes match the sha256 the header records for it.
        Readers call it as they read each tensor (one pass: the bytes hashed are the bytes
        decoded next, from the page cache), so a damaged file is never laundered into a new one."""
        want = self.doc.get("hashes", {}).get(name)
        if want is None:
            raise CmfError(f"{self.path}: tensor {name!r} has no recorded sha256, so it cannot be checked "
                           "(--no-verify reads it unchecked)")
        if self.hash_of(name) != want:
            raise CmfError(f"{self.path}: tensor {name!r} does not match its recorded sha256: the file is damaged "
                           "or was altered (--no-verify reads it unchecked)")

    def checked_tensor(self, name: str, dtype: torch.dtype = torch.float32, verify: bool = True,
                       finite: bool = True) -> torch.Tensor:
        """`tensor(name, dtype)`, its sha256 checked first (`verify`) and NaN/Inf refused (`finite`)."""
        if verify:
            self.check_hash(name)
        t = self.tensor(name, dtype)
        if finite:
            check_finite(t, f"{self.path}: tensor {name!r}")
        return t

    def verify(self, progress: Callable[[int, int], None] | None = None, nonfinite: list[str] | None = None) -> list[str]:
        """Names whose stored bytes do not match their recorded sha256 (or have none). With a
        `nonfinite` list, the names of intact tensors holding NaN or Inf are appended to it
        (each tensor is decoded right after it is hashed: one pass over the file)."""
        hashes = self.doc.get("hashes", {})
        bad = []
        for k, name in enumerate(self.infos):
            if hashes.get(name) != self.hash_of(name):
                bad.append(name)
            elif nonfinite is not None:
                t = self.tensor(name)
                if t.numel() and not bool(torch.isfinite(t).all()):
                    nonfinite.append(name)
            if progress:
                progress(k + 1, len(self.infos))
        return bad

    def close(self):
        self._maps = [None] * len(self.paths)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_cmf(path: str | os.PathLike) -> CmfFile:
    return CmfFile(path)


def check_finite(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor holding NaN or Inf (a model that computes NaN is a damaged model)."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CmfError(f"{what} holds {bad} NaN or Inf values (--allow-nonfinite reads it anyway)")


# ── writing ─────────────────────────────────────────────────────────────


@dataclass
class Stored:
    """Already-encoded storage for a tensor (copied as is, not re-encoded)."""

    data: torch.Tensor


@dataclass
class Spec:
    """One tensor to write: its name, codec, logical shape and how to get it.

    `get()` returns the logical values (any float dtype; encoded by the codec)
    or a `Stored` whose storage matches the codec already."""

    name: str
    codec: str
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor | Stored]
    st: tuple[str, tuple[int, ...]] = field(init=False)

    def __post_init__(self):
        self.shape = tuple(int(x) for x in self.shape)
        c = codecs.get(self.codec)
        if c.plain:
            self.st = (_TORCH_TO_ST[c.dtype], self.shape)
        else:
            self.st = ("U8", (c.nbytes(self.shape),))

    @property
    def nbytes(self) -> int:
        return math.prod(self.st[1]) * _ST_DTYPES[self.st[0]][2]


def new_doc(arch: Arch, tokenizer: dict | None, provenance: dict | None = None) -> dict:
    return {
        "format": "cmf",
        "version": FORMAT_VERSION,
        "arch": arch.to_dict(),
        "tokenizer": tokenizer,
        "provenance": copy.deepcopy(provenance or {}),
    }


def with_provenance(doc: dict, stage: str, block: dict) -> dict:
    """A copy of `doc` whose provenance gains `stage`; what was there stays.
    A stage already recorded (a second recode, say) is added as `stage#2`,
    `stage#3`...: the keys keep the order the stages ran in."""
    out = copy.deepcopy(doc)
    prov = out.setdefault("provenance", {})
    key, k = stage, 1
    while key in prov:
        k += 1
        key = f"{stage}#{k}"
    prov[key] = copy.deepcopy(block)
    return out


def _header_bytes(entries: dict, meta_doc: dict | None, extra_meta: dict | None = None) -> bytes:
    h = dict(entries)
    meta = dict(extra_meta or {})
    if meta_doc is not None:
        meta["cmf"] = json.dumps(meta_doc)  # insertion order: provenance reads in the order stages ran
    if meta:
        h["__metadata__"] = meta
    raw = json.dumps(h).encode("utf-8")
    raw += b" " * ((-len(raw)) % 8)  # 8-byte aligned data, as safetensors pads
    return raw


def _shards(specs: Sequence[Spec], shard_bytes: int) -> list[list[Spec]]:
    """The specs in files of at most `shard_bytes` (a tensor over it alone), widest elements
    first: that keeps every typed tensor aligned in the map."""
    order = sorted(specs, key=lambda s: -_ST_DTYPES[s.st[0]][2])
    shards: list[list[Spec]] = [[]]
    used = 0
    for s in order:
        if used + s.nbytes > shard_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += s.nbytes
    return shards


def _entries(group: list[Spec]) -> dict:
    """The safetensors header entries of one file's tensors, in order."""
    out, off = {}, 0
    for s in group:
        out[s.name] = {"dtype": s.st[0], "shape": list(s.st[1]), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    return out


def _write_shard(part: Path, head: bytes, group: list[Spec], path: Path, hashes: dict,
                 progress: Callable[[str], None] | None) -> None:
    """One file: its header, then each tensor encoded as it is read (its sha256 into `hashes`)."""
    with open(part, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for s in group:
            try:
                data = _encode(s)
            except CmfError:  # the source file's own problem: it names that file
                raise
            except CortiqError as e:
                raise CortiqError(f"{path}: {e}") from None
            buf = codecs.to_numpy_bytes(data)
            if buf.nbytes != s.nbytes:
                raise CortiqError(f"{path}: tensor {s.name!r}: {buf.nbytes} bytes encoded, {s.nbytes} expected")
            hashes[s.name] = hashlib.sha256(buf).hexdigest()
            f.write(buf.tobytes() if not buf.flags.c_contiguous else memoryview(buf))
            if progress:
                progress(s.name)


def write_cmf(
    path: str | os.PathLike,
    doc: dict,
    specs: Sequence[Spec],
    shard_bytes: int = SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write `specs` as a CMF model at `path`, streaming one tensor at a time.

    `doc` is the cmf document less `codecs`, `hashes` and `shards` (which are
    made here). Files are written as `.partial` and renamed when complete;
    on any error the partial files are removed and nothing is left behind."""
    path = Path(path)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise CortiqError(f"{path}: duplicate tensor names")
    shards = _shards(specs, shard_bytes)
    paths = shard_names(path, len(shards))
    doc = copy.deepcopy(doc)
    doc["codecs"] = {s.name: {"codec": s.codec, "shape": list(s.shape)} for s in specs if not codecs.get(s.codec).plain}
    doc["hashes"] = {s.name: "0" * 64 for s in specs}
    if len(shards) > 1:
        doc["shards"] = [p.name for p in paths[1:]]
    else:
        doc.pop("shards", None)
    partials = [p.with_name(p.name + ".partial") for p in paths]
    try:
        for si, (group, part) in enumerate(zip(shards, partials)):
            shard_meta = None if si == 0 else {"cmf_shard": json.dumps({"index": si, "of": len(shards), "first": path.name})}
            head = _header_bytes(_entries(group), doc if si == 0 else None, shard_meta)
            _write_shard(part, head, group, path, doc["hashes"], progress)
        # the real hashes: same length as the placeholders, so the header is rewritten in place
        head = _header_bytes(_entries(shards[0]), doc)
        with open(partials[0], "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n != len(head):
                raise CortiqError(f"{path}: header changed length while writing")
            f.write(head)
        for p, part in list(zip(paths, partials))[::-1]:  # shards first, the first file last
            os.replace(part, p)
    except BaseException as e:
        for part in partials:
            part.unlink(missing_ok=True)
        if isinstance(e, OSError):
            from .errors import write_error

            raise write_error(path, e) from None
        raise
    return path


def _encode(s: Spec) -> torch.Tensor:
    v = s.get()
    c = codecs.get(s.codec)
    if isinstance(v, Stored):
        data = v.data
    else:
        if tuple(v.shape) != s.shape:
            raise CortiqError(f"tensor {s.name!r}: shape {list(v.shape)} is not the planned {list(s.shape)}")
        try:
            data = c.encode(v.detach().to("cpu"))
        except codecs.CodecError as e:
            raise CortiqError(f"tensor {s.name!r}: {e}") from None
    want_dt = _ST_DTYPES[s.st[0]][1]
    if data.dtype != want_dt:
        raise CortiqError(f"tensor {s.name!r}: stored as {data.dtype}, codec {s.codec} stores {want_dt}")
    return data.contiguous()


def copy_specs(src: CmfFile, codec_for: Callable[[str, TensorInfo], str] | None = None, replace: dict | None = None,
               verify: bool = True, finite: bool = False, q4_grid: str = "asymmetric") -> list[Spec]:
    """Specs that stream `src`'s tensors into a new file: each kept as stored
    when its codec does not change, else decoded and re-encoded. `replace`
    maps names to new logical values (or callables giving them). Each copied
    tensor's sha256 is checked as it is read (`verify`), so a damaged tensor is
    not written into a file whose new hashes would vouch for it; `finite`
    refuses NaN/Inf values too. `q4_grid` "symmetric": every q4 tensor written
    has symmetric blocks (codecs.encoder): one in q4 already is kept when its
    blocks are, else re-encoded from its values."""
    replace = replace or {}
    out = []

    def stored(n: str) -> Stored:
        if verify:
            src.check_hash(n)
        st = src.stored(n)
        if finite:
            check_finite(st if st.is_floating_point() else src.tensor(n), f"{src.path}: tensor {n!r}")
        return Stored(st)

    def regridded(n: str, enc: codecs.Codec, same: bool) -> Stored:
        if same and enc.symmetric_blocks((st := stored(n)).data):
            return st
        try:
            return Stored(enc.encode(src.checked_tensor(n, verify=verify, finite=finite)))
        except codecs.CodecError as e:
            raise CortiqError(f"tensor {n!r}: {e}") from None

    for name, info in src.infos.items():
        codec = codec_for(name, info) if codec_for else info.codec
        enc = codecs.encoder(codec, q4_grid)
        if name in replace:
            v = replace[name]
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v[0])
            get = (lambda v=v: v) if isinstance(v, torch.Tensor) else v[1]
            out.append(Spec(name, codec, shape, get))
        elif enc is not codecs.get(codec):
            out.append(Spec(name, codec, info.shape, lambda n=name, e=enc, same=codec == info.codec: regridded(n, e, same)))
        elif codec == info.codec:
            out.append(Spec(name, codec, info.shape, lambda n=name: stored(n)))
        else:
            out.append(Spec(name, codec, info.shape, lambda n=name: src.checked_tensor(n, verify=verify, finite=finite)))
    return out


def specs_from_tensors(tensors: Iterable[tuple[str, torch.Tensor]], codec: str | Callable[[str], str] = "f32") -> list[Spec]:
    out = []
    for name, t in tensors:
        c = codec(name) if callable(codec) else codec
        out.append(Spec(name, c, tuple(t.shape), lambda t=t: t))
    return out
