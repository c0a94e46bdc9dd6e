"""The trunk pass: per window the trunk's final hidden rows and its next-token
top-k, kept in an Arrow cache a later run reads back.

The hidden rows are the trunk's final hidden state AFTER `model.norm`: that
is what cortiq's MTP block reads (cortiq.model.mtp), what vLLM feeds the
Qwen3-Next / DeepSeek MTP modules, and the same role the draft's own (normed)
output plays at chain steps 2.., so a chain is fed alike at every step.

The cache is one directory per data set, `NAME-wT-kK/` with `trunk.arrow`
and `meta.json` (written last). Its key is a digest of the trunk (the CMF's
per-tensor hashes and geometry less everything under `model.mtp.*`, so a draft
retrained in the same file keeps the key), the windows' ids, the window and k.
A directory whose key differs is rebuilt, with a logged warning.

On N ranks (cortiq.dist) each runs the trunk over its share of the windows
and writes `trunk-R-of-N.arrow`; meta.json's `files` lists the shards in
order and they read back as one set (a temporary directory stands in for the
cache when none is given).
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
from ..cmf import CmfFile, open_cmf
from ..errors import CortiqError

log = logging.getLogger(__name__)

STAGE = "mtp-trunk"
VERSION = 1
ARROW = "trunk.arrow"


@dataclass
class TrunkSet:
    """One data set's windows with the trunk's view of them."""

    name: str
    ids: torch.Tensor  # [N, T] int64
    lens: torch.Tensor  # [N] int64
    ti: torch.Tensor  # [N, T, k] int64 the trunk's top-k ids per row (row p: token p+1)
    tp: torch.Tensor  # [N, T, k] f32 their probabilities, renormalised over the k
    h: torch.Tensor  # [N, T, H] f32 the trunk's final hidden rows (after model.norm)

    def __len__(self) -> int:
        return int(self.ids.shape[0])


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
def run_trunk(model, ids: torch.Tensor, k: int, batch: int = 4, chunk: int = 1024, progress=None):
    """The trunk on windows ids [N, T]: (ti [N, T, k], tp [N, T, k], h [N, T, H]) on the CPU."""
    dev = next(model.parameters()).device
    if ids.shape[0] == 0:  # a rank's empty share
        H = model.arch.hidden_size
        return (torch.zeros(0, ids.shape[1], k, dtype=torch.int64), torch.zeros(0, ids.shape[1], k),
                torch.zeros(0, ids.shape[1], H))
    outs_i, outs_p, outs_h = [], [], []
    for a in range(0, ids.shape[0], batch):
        x = ids[a : a + batch].to(dev)
        h, _ = model.forward_hidden(x)  # [B, T, H] after model.norm
        ti, tp = model.topk_next(h, k, chunk)
        outs_i.append(ti.cpu())
        outs_p.append(tp.cpu())
        outs_h.append(h.float().cpu())
        if progress is not None:
            progress(int(x.shape[0]))
    return torch.cat(outs_i), torch.cat(outs_p), torch.cat(outs_h)


def _fixed(values: np.ndarray, per_row: int, typ) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), typ), per_row)


def _table(s: TrunkSet) -> pa.Table:
    N, T, k = s.ti.shape
    H = s.h.shape[-1]
    return pa.table({
        "length": pa.array(s.lens.numpy().astype(np.int32), pa.int32()),
        "ids": _fixed(s.ids.numpy().astype(np.uint32), T, pa.uint32()),
        "ti": _fixed(s.ti.numpy().astype(np.uint32), T * k, pa.uint32()),
        "tp": _fixed(s.tp.numpy().astype(np.float32), T * k, pa.float32()),
        "h": _fixed(s.h.numpy().astype(np.float32), T * H, pa.float32()),
    })


def write_set(d: Path, s: TrunkSet, meta: dict) -> None:
    with store.stage_dir(d, meta) as part:
        store.write_arrow(part / ARROW, _table(s))


def _col(table: pa.Table, name: str) -> np.ndarray:
    c = table.column(name).combine_chunks()
    return c.flatten().to_numpy(zero_copy_only=False) if isinstance(c, pa.FixedSizeListArray) else c.to_numpy()


def read_set(d: Path, name: str) -> TrunkSet:
    meta = store.read_meta(d)
    names = meta.get("files") or [ARROW]
    parts = [store.read_arrow(d / n) for n in names]
    t = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
    N, T, k, H = (int(meta[x]) for x in ("windows", "window", "topk", "hidden"))
    if t.num_rows != N:
        raise CortiqError(f"{d / ARROW}: {t.num_rows} windows, meta.json says {N}")
    return TrunkSet(
        name,
        torch.from_numpy(_col(t, "ids").astype(np.int64)).view(N, T),
        torch.from_numpy(_col(t, "length").astype(np.int64)),
        torch.from_numpy(_col(t, "ti").astype(np.int64)).view(N, T, k),
        torch.from_numpy(_col(t, "tp").copy()).view(N, T, k),
        torch.from_numpy(_col(t, "h").copy()).view(N, T, H),
    )


def trunk_sets(model, f: CmfFile, packed: list, window: int, k: int, cache: str | os.PathLike | None = None,
               batch: int = 4, chunk: int = 1024) -> tuple[list[TrunkSet], list[dict]]:
    """The trunk's pass over each packed data set (cortiq.data Packed), read
    from `cache` when its key matches, else computed (and cached). -> (sets, per-set info)."""
    from tqdm import tqdm

    tkey = trunk_key(f)
    sets, info = [], []
    scratch = None
    if dist.active() and not cache:
        # the ranks' shards meet on disk: a directory of rank 0's, gone once every rank has read it
        import tempfile

        scratch = dist.agree(tempfile.mkdtemp(prefix="cortiq-trunk-") if dist.is_main() else None)
        cache = scratch
    for p in packed:
        ids = torch.as_tensor(np.asarray(p.ids), dtype=torch.int64)
        lens = torch.as_tensor(np.asarray(p.lengths), dtype=torch.int64)
        key = set_key(tkey, ids.numpy(), lens.numpy(), window, k)
        d = Path(cache) / f"{p.name}-w{window}-k{k}" if cache else None
        if d is not None and dist.agree(store.is_complete(d)):
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
        bar = tqdm(total=len(share), desc=f"mtp trunk {p.name}", unit="win", file=sys.stderr, dynamic_ncols=True,
                   disable=not dist.is_main())
        ti, tp, h = run_trunk(model, ids[share.start:share.stop], k, batch, chunk, bar.update)
        bar.close()
        s = TrunkSet(p.name, ids, lens, ti, tp, h)
        meta = {"stage": STAGE, "version": VERSION, "digest": key, "key": key, "trunk": tkey, "set": p.name,
                "windows": len(ids), "window": window, "topk": k, "hidden": int(h.shape[-1]),
                "tokens": int(lens.sum()), "model": str(f.path)}
        if dist.active():
            mine = TrunkSet(p.name, ids[share.start:share.stop], lens[share.start:share.stop], ti, tp, h)
            meta["files"] = dist.shard_names("trunk")
            with dist.stage_dir(d, meta) as part:
                store.write_arrow(part / dist.shard_name("trunk"), _table(mine))
            s = read_set(d, p.name)  # every rank: the whole set, in one rank's order
        elif d is not None:
            write_set(d, s, meta)
        sets.append(s)
        info.append({"set": p.name, "windows": len(s), "cache": None if d is None or scratch else str(d),
                     "read_back": False})
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
