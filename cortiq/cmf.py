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


def _read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header of `path` and where its data begins."""
    try:
        size = path.stat().st_size
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
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CmfError(f"{path}: not a CMF file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise CmfError(f"{path}: not a CMF file (the header is not a JSON object)")
    return header, 8 + n


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
        try:
            self.doc: dict = json.loads(meta["cmf"])
        except json.JSONDecodeError:
            raise CmfError(f"{self.path}: the cmf document is not JSON") from None
        if not isinstance(self.doc, dict) or self.doc.get("format") != "cmf":
            raise CmfError(f"{self.path}: not a CMF file (format {self.doc.get('format')!r})")
        if int(self.doc.get("version", 0)) > FORMAT_VERSION:
            raise CmfError(f"{self.path}: CMF version {self.doc['version']} is newer than this cortiq reads ({FORMAT_VERSION})")
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
                if not p.is_file():
                    raise CmfError(f"{self.path}: shard {p.name} is missing")
                h, d0 = _read_header(p)
                smeta = h.pop("__metadata__", None) or {}
                try:
                    sdoc = json.loads(smeta["cmf_shard"])
                    ok = sdoc["index"] == si and sdoc["of"] == len(self.paths)
                except (KeyError, TypeError, json.JSONDecodeError):
                    ok = False
                if not ok:
                    raise CmfError(f"{p}: not shard {si + 1} of {len(self.paths)} of {self.path.name}")
            size = p.stat().st_size
            ranges = []
            for name, e in h.items():
                try:
                    b, en = (int(x) for x in e["data_offsets"])
                    st_dtype, st_shape = e["dtype"], tuple(int(x) for x in e["shape"])
                except (KeyError, TypeError, ValueError):
                    raise CmfError(f"{p}: not a CMF file (malformed entry {name!r})") from None
                if st_dtype not in _ST_DTYPES:
                    raise CmfError(f"{p}: tensor {name!r} has unsupported dtype {st_dtype}")
                if en - b != math.prod(st_shape) * _ST_DTYPES[st_dtype][2] or b > en or b < 0:
                    raise CmfError(f"{p}: tensor {name!r}: its byte range does not match its shape")
                if name in self.infos:
                    raise CmfError(f"{p}: tensor {name!r} appears twice")
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

    @staticmethod
    def _coded(p: Path, name: str, entry, st_dtype: str, st_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """(codec, logical shape) of a tensor the document says is encoded, checked against its storage."""
        try:
            codec, shape = entry["codec"], tuple(int(x) for x in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CmfError(f"{p}: tensor {name!r}: malformed codec entry") from None
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

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Names whose stored bytes do not match their recorded sha256 (or have none)."""
        hashes = self.doc.get("hashes", {})
        bad = []
        for k, name in enumerate(self.infos):
            if hashes.get(name) != self.hash_of(name):
                bad.append(name)
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
    # widest elements first keeps every typed tensor aligned in the map
    order = sorted(specs, key=lambda s: -_ST_DTYPES[s.st[0]][2])
    shards: list[list[Spec]] = [[]]
    used = 0
    for s in order:
        if used + s.nbytes > shard_bytes and shards[-1]:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += s.nbytes
    paths = shard_names(path, len(shards))
    doc = copy.deepcopy(doc)
    doc["codecs"] = {s.name: {"codec": s.codec, "shape": list(s.shape)} for s in specs if not codecs.get(s.codec).plain}
    doc["hashes"] = {s.name: "0" * 64 for s in specs}
    if len(shards) > 1:
        doc["shards"] = [p.name for p in paths[1:]]
    else:
        doc.pop("shards", None)

    def entries(group: list[Spec]) -> dict:
        out, off = {}, 0
        for s in group:
            out[s.name] = {"dtype": s.st[0], "shape": list(s.st[1]), "data_offsets": [off, off + s.nbytes]}
            off += s.nbytes
        return out

    partials = [p.with_name(p.name + ".partial") for p in paths]
    try:
        for si, (group, part) in enumerate(zip(shards, partials)):
            shard_meta = None if si == 0 else {"cmf_shard": json.dumps({"index": si, "of": len(shards), "first": path.name})}
            head = _header_bytes(entries(group), doc if si == 0 else None, shard_meta)
            with open(part, "wb") as f:
                f.write(struct.pack("<Q", len(head)))
                f.write(head)
                for s in group:
                    try:
                        data = _encode(s)
                    except CortiqError as e:
                        raise CortiqError(f"{path}: {e}") from None
                    buf = codecs.to_numpy_bytes(data)
                    if buf.nbytes != s.nbytes:
                        raise CortiqError(f"{path}: tensor {s.name!r}: {buf.nbytes} bytes encoded, {s.nbytes} expected")
                    doc["hashes"][s.name] = hashlib.sha256(buf).hexdigest()
                    f.write(buf.tobytes() if not buf.flags.c_contiguous else memoryview(buf))
                    if progress:
                        progress(s.name)
        # the real hashes: same length as the placeholders, so the header is rewritten in place
        head = _header_bytes(entries(shards[0]), doc)
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
            raise CortiqError(f"{path}: cannot write ({e.strerror or e})") from None
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


def copy_specs(src: CmfFile, codec_for: Callable[[str, TensorInfo], str] | None = None, replace: dict | None = None) -> list[Spec]:
    """Specs that stream `src`'s tensors into a new file: each kept as stored
    when its codec does not change, else decoded and re-encoded. `replace`
    maps names to new logical values (or callables giving them)."""
    replace = replace or {}
    out = []
    for name, info in src.infos.items():
        codec = codec_for(name, info) if codec_for else info.codec
        if name in replace:
            v = replace[name]
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v[0])
            get = (lambda v=v: v) if isinstance(v, torch.Tensor) else v[1]
            out.append(Spec(name, codec, shape, get))
        elif codec == info.codec:
            out.append(Spec(name, codec, info.shape, lambda n=name: Stored(src.stored(n))))
        else:
            out.append(Spec(name, codec, info.shape, lambda n=name: src.tensor(n)))
    return out


def specs_from_tensors(tensors: Iterable[tuple[str, torch.Tensor]], codec: str | Callable[[str], str] = "f32") -> list[Spec]:
    out = []
    for name, t in tensors:
        c = codec(name) if callable(codec) else codec
        out.append(Spec(name, c, tuple(t.shape), lambda t=t: t))
    return out
