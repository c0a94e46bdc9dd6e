"""The trunk pass: per window the trunk's final hidden rows and its next-token
top-k, kept in an Arrow cache a later run reads back.

The hidden rows are the trunk's final hidden state AFTER `model.norm`: that
is what cortiq's MTP block reads (cortiq.model.mtp), what vLLM feeds the
Qwen3-Next / DeepSeek MTP modules, and the same role the draft's own (normed)
output plays at chain steps 2.., so a chain is fed alike at every step.

The cache is one directory per data set, `NAME-wT-kK/` with `trunk.arrow`
and `meta.json` (written last). The pass writes one Arrow record batch per
forward batch as it runs and the set reads back memory-mapped (cortiq.heal.rows,
as heal's teacher and prefix caches do): host memory holds a batch's rows,
never the set's. Its key is a digest of the trunk (the CMF's
per-tensor hashes and geometry less everything under `model.mtp.*`, so a draft
retrained in the same file keeps the key), the windows' ids, the window and k.
A directory whose key differs is rebuilt, with a logged warning.

On N ranks (cortiq.dist) each runs the trunk over its share of the windows
and writes `trunk-R-of-N.arrow`; meta.json's `files` lists the shards in
order and they read back as one set. With no cache given, a temporary
directory (TMPDIR) stands in, removed once the set is mapped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import dist, store
from ..heal.rows import RowWriter, WindowRows, open_files
from ..cmf import CmfFile, open_cmf
from ..errors import CortiqError

log = logging.getLogger(__name__)

STAGE = "mtp-trunk"
VERSION = 1
ARROW = "trunk.arrow"


@dataclass
class TrunkSet:
    """One data set's windows with the trunk's view of them. The per-window rows
    are views of the cache's memory map (WindowRows.take gathers a batch of
    windows), so a set is never whole in host memory; `held` wraps rows that are."""

    name: str
    ids: torch.Tensor  # [N, T] int64
    lens: torch.Tensor  # [N] int64
    ti: WindowRows  # [T, k] a window: the trunk's top-k ids per row (row p: token p+1)
    tp: WindowRows  # [T, k] f32 their probabilities, renormalised over the k
    h: WindowRows  # [T, H] f32 the trunk's final hidden rows (after model.norm)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def held(cls, name: str, ids: torch.Tensor, lens: torch.Tensor, ti: torch.Tensor, tp: torch.Tensor,
             h: torch.Tensor) -> "TrunkSet":
        """A set from tensors in memory (a few windows: measure_text's)."""
        return cls(name, ids, lens, *(WindowRows.of([x.numpy()]) for x in (ti, tp, h)))


def trunk_key(f: CmfFile) -> str:
    """What tells one trunk from another: its tensors' hashes and geometry, less the draft."""
    arch = f.arch.to_dict()
    for k in ("mtp_layers", "mtp_intermediate_size"):
        arch.pop(k, None)
    hashes = {n: h for n, h in f.doc.get("hashes", {}).items() if not n.startswith("model.mtp.")}
    codecs = {n: c for n, c in f.doc.get("codecs", {}).items() if not n.startswith("model.mtp.")}
    blob = json.dumps({"arch": arch, "hashes": hashes, "codecs": codecs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def set_key(tkey: str, ids: np.ndarray, lens: np.ndarray, window: int, k: int) -> str:
    h = hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(lens, dtype=np.int64).tobytes())
    return store.digest(STAGE, VERSION, {"window": int(window), "topk": int(k)}, [tkey, h.hexdigest()[:32]])


@torch.no_grad()
def trunk_batches(model, ids: torch.Tensor, k: int, batch: int = 4, chunk: int = 1024):
    """The trunk on windows ids [N, T], a forward batch at a time: yields
    (ti [B, T, k] int64, tp [B, T, k], h [B, T, H] f32) on the CPU."""
    dev = next(model.parameters()).device
    for a in range(0, ids.shape[0], batch):
        h, _ = model.forward_hidden(ids[a : a + batch].to(dev))  # [B, T, H] after model.norm
        ti, tp = model.topk_next(h, k, chunk)
        yield ti.cpu(), tp.cpu(), h.float().cpu()


def run_trunk(model, ids: torch.Tensor, k: int, batch: int = 4, chunk: int = 1024):
    """The trunk on a few windows ids [N, T], whole in memory: (ti [N, T, k], tp [N, T, k], h [N, T, H])."""
    outs = list(trunk_batches(model, ids, k, batch, chunk))
    if not outs:
        H = model.arch.hidden_size
        return (torch.zeros(0, ids.shape[1], k, dtype=torch.int64), torch.zeros(0, ids.shape[1], k),
                torch.zeros(0, ids.shape[1], H))
    return tuple(torch.cat(x) for x in zip(*outs))


def write_trunk(path: Path, model, ids: torch.Tensor, lens: torch.Tensor, k: int, batch: int = 4,
                chunk: int = 1024, progress=None) -> None:
    """The trunk pass over windows ids [N, T] into the Arrow file `path`, one record batch per
    forward batch as it runs: host memory holds one batch's rows, never the set's."""
    T, H = int(ids.shape[1]), int(model.arch.hidden_size)
    fields = {"ids": (pa.uint32(), T), "ti": (pa.uint32(), T * k), "tp": (pa.float32(), T * k),
              "h": (pa.float32(), T * H)}
    with RowWriter(Path(path), fields, {"length": pa.int32()}) as wr:
        for a, (ti, tp, h) in zip(range(0, len(ids), batch), trunk_batches(model, ids, k, batch, chunk)):
            n = int(h.shape[0])
            wr.write(ids=ids[a : a + n].numpy().astype(np.uint32), ti=ti.numpy().astype(np.uint32),
                     tp=tp.numpy().astype(np.float32), h=h.numpy(), length=lens[a : a + n].numpy().astype(np.int32))
            if progress is not None:
                progress(n)


def _col(table: pa.Table, name: str) -> np.ndarray:
    c = table.column(name).combine_chunks()
    return c.flatten().to_numpy(zero_copy_only=False) if isinstance(c, pa.FixedSizeListArray) else c.to_numpy()


def read_set(d: Path, name: str) -> TrunkSet:
    """A finished cache directory's set: ids and lengths in memory, the rows memory-mapped
    (every rank's shard, in order, as one set)."""
    meta = store.read_meta(d)
    t = open_files(d, meta.get("files") or [ARROW])
    N, T, k, H = (int(meta[x]) for x in ("windows", "window", "topk", "hidden"))
    if t.num_rows != N:
        raise CortiqError(f"{d / ARROW}: {t.num_rows} windows, meta.json says {N}")
    ids = torch.from_numpy(_col(t, "ids").astype(np.int64)).view(N, T)
    lens = torch.from_numpy(_col(t, "length").astype(np.int64))
    return TrunkSet(name, ids, lens, WindowRows(t, "ti", (T, k)), WindowRows(t, "tp", (T, k)),
                    WindowRows(t, "h", (T, H)))


def trunk_sets(model, f: CmfFile, packed: list, window: int, k: int, cache: str | os.PathLike | None = None,
               batch: int = 4, chunk: int = 1024) -> tuple[list[TrunkSet], list[dict]]:
    """The trunk's pass over each packed data set (cortiq.data Packed), read
    from `cache` when its key matches, else computed (and cached). -> (sets, per-set info)."""
    from tqdm import tqdm

    tkey = trunk_key(f)
    sets, info = [], []
    scratch = None
    if not cache:
        # the rows go to disk as the pass runs (and the ranks' shards meet there): a directory
        # of rank 0's, gone once every rank has mapped it (a map outlives its file's name)
        import tempfile

        scratch = dist.agree(tempfile.mkdtemp(prefix="cortiq-trunk-") if dist.is_main() else None)
        cache = scratch
    for p in packed:
        ids = torch.as_tensor(np.asarray(p.ids), dtype=torch.int64)
        lens = torch.as_tensor(np.asarray(p.lengths), dtype=torch.int64)
        key = set_key(tkey, ids.numpy(), lens.numpy(), window, k)
        d = Path(cache) / f"{p.name}-w{window}-k{k}"
        if dist.agree(store.is_complete(d)):
            old = store.read_meta(d).get("key")
            if old == key and scratch is None:
                s = read_set(d, p.name)
                sets.append(s)
                info.append({"set": p.name, "windows": len(s), "cache": str(d), "read_back": True})
                continue
            if dist.is_main():
                log.warning("mtp: trunk cache %s was made from another trunk or data (key %s, now %s): rebuilding", d, str(old)[:12], key[:12])
                shutil.rmtree(d)
            dist.barrier()
        share = dist.shard(len(ids), batch)  # whole forward batches, as one rank runs them
        meta = {"stage": STAGE, "version": VERSION, "digest": key, "key": key, "trunk": tkey, "set": p.name,
                "windows": len(ids), "window": window, "topk": k, "hidden": int(model.arch.hidden_size),
                "tokens": int(lens.sum()), "model": str(f.path)}
        if dist.active():
            meta["files"] = dist.shard_names("trunk")
        with dist.stage_dir(d, meta) as part, \
                tqdm(total=len(share), desc=f"mtp trunk {p.name}", unit="win", file=sys.stderr, dynamic_ncols=True,
                     disable=not dist.is_main()) as bar:
            write_trunk(part / dist.shard_name("trunk"), model, ids[share.start:share.stop],
                        lens[share.start:share.stop], k, batch, chunk, bar.update)
        s = read_set(d, p.name)  # every rank: the whole set, in one rank's order
        sets.append(s)
        info.append({"set": p.name, "windows": len(s), "cache": None if scratch else str(d), "read_back": False})
    if scratch is not None:
        dist.barrier()
        if dist.is_main():
            shutil.rmtree(scratch, ignore_errors=True)
    return sets, info


@torch.no_grad()
def write_taps(model, ids: torch.Tensor, lens: torch.Tensor, t1: torch.Tensor, held: torch.Tensor, out: Path, layers: list[int]) -> None:
    """The trunk layers' output rows (before any norm) for the held-out windows:
    what a draft model built elsewhere reads from its target (seed file set)."""
    out = Path(out)
    if store.is_complete(out):
        return
    n = len(model.layers)
    bad = [l for l in layers if not 0 <= l < n]
    if bad:
        raise CortiqError(f"mtp taps: layers {bad} are outside the trunk's {n} layers")
    dev = next(model.parameters()).device
    idx = held.nonzero().flatten()
    part = out.with_name(out.name + ".partial")
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    with open(part / "taps.f16", "wb") as ft:
        for i in idx.tolist():
            _, caught = model.forward_hidden(ids[i : i + 1].to(dev), capture=layers)
            rows = torch.stack([caught[l][0] for l in layers])  # [L, T, H]
            ft.write(rows.to(torch.float16).cpu().numpy().tobytes())
    lens[idx].numpy().astype("<u4").tofile(part / "len.u32")
    ids[idx].numpy().astype("<u4").tofile(part / "ids.u32")
    t1[idx].numpy().astype("<u4").tofile(part / "ti.u32")
    (part / "meta.json").write_text(json.dumps({
        "windows": idx.tolist(), "window": int(ids.shape[1]), "hidden": int(model.arch.hidden_size), "layers": layers,
        "taps": "[window][layer][row][hidden] f16, a layer's output before any norm",
        "ti": "the trunk's own next token per row",
    }, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(part, out)
