"""The frozen prefix: layers below `train_from` run once per window and their
output is kept, so training runs (and holds) only the trained tail.

Kept in f32 when that fits 0.3 of the memory budget, in f16 when half of it
does, not at all otherwise (the trainer then runs the prefix every step).
Output (a stage directory): `train.arrow`, `val.arrow` with one row per
window, `h` = [T·H] f32 or f16; meta `dtype` says which ("none": no files).
On N ranks each writes its share of the windows (`SPLIT-R-of-N.arrow`, listed
in order by meta.json's `files`), read back as one table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import dist, store, tracking
from .rows import RowWriter, WindowRows, open_split
from ..devices import rank_device
from .settings import HealSettings, mem_budget_bytes
from .targets import SPLITS, window_sets

#: share of the memory budget the cache may take
SHARE = 0.3


def prefix_dtype(n_windows: int, T: int, hidden: int, budget_bytes: int, train_from: int) -> str:
    """"f32", "f16" or "none" for a cache of n_windows × [T, hidden]."""
    if train_from <= 0 or n_windows == 0:
        return "none"  # the prefix is the embedding: nothing worth caching
    bytes32 = n_windows * T * hidden * 4
    room = SHARE * budget_bytes
    if bytes32 <= room:
        return "f32"
    return "f16" if bytes32 / 2 <= room else "none"


@torch.no_grad()
def run_prefix(model, ids: torch.Tensor, train_from: int) -> torch.Tensor:
    """Embedding and layers 0..train_from-1: [B, T] -> [B, T, H]."""
    return model.run_layers(model.embed(ids), 0, train_from)


def write_prefix(student_cmf, tdata_dir, settings: HealSettings, out, record: dict,
                 logger: tracking.Logger = tracking.NULL, progress: bool = True) -> dict:
    """The frozen layers' output for every train and val window at `out` (in the dtype the memory
    budget allows), its meta.json opening with `record` (cortiq.heal.stages.prefix_cache)."""
    from tqdm import tqdm

    from ..cmf import open_cmf

    s = settings
    out = Path(out)
    _, wins = window_sets(tdata_dir, s)
    arch = open_cmf(student_cmf).arch
    n = sum(len(w) for w in wins.values())
    dtype = prefix_dtype(n, s.window, arch.hidden_size, mem_budget_bytes(s.mem_budget_gb), s.train_from)
    meta = {**record, "inputs": {"student": str(student_cmf), "tdata": str(tdata_dir)}, "dtype": dtype,
            "window": s.window, "hidden": arch.hidden_size, "train_from": s.train_from,
            "counts": {sp: len(w) for sp, w in wins.items()}}
    t0 = time.perf_counter()
    if dist.active() and dtype != "none":
        meta["files"] = {split: dist.shard_names(split) for split in wins}
    with dist.stage_dir(out, meta) as part:
        if dtype != "none":
            from ..model import load_model

            dev = rank_device(s.device, "heal settings")
            model = load_model(student_cmf, dtype=torch.float32, device="cpu").eval()
            # only the prefix travels to the device
            del model.layers[s.train_from:]
            model.to(dev)
            pa_t, np_t = (pa.float32(), np.float32) if dtype == "f32" else (pa.float16(), np.float16)
            for split, w in wins.items():
                share = dist.shard(len(w), s.batch)  # whole batches, as one rank runs them
                with RowWriter(part / dist.shard_name(split), {"h": (pa_t, s.window * arch.hidden_size)}) as wr, \
                        tqdm(total=len(share), desc=f"prefix 0..{s.train_from} ({split})", unit="win",
                             disable=not progress or not dist.is_main(), file=sys.stderr) as bar:
                    for a in range(share.start, share.stop, s.batch):
                        # f32 compute: the cached rows are the trainer's exact inputs
                        h = run_prefix(model, torch.from_numpy(w.ids[a : a + s.batch]).to(dev), s.train_from)  # [B, T, H]
                        wr.write(h=h.float().cpu().numpy().astype(np_t).reshape(h.shape[0], -1))
                        bar.update(h.shape[0])
    secs = time.perf_counter() - t0
    gb = n * s.window * arch.hidden_size * {"f32": 4, "f16": 2, "none": 0}[dtype] / 1e9
    report = {"metrics": {"prefix_secs": secs, "prefix_gb": gb}, "dtype": dtype}
    logger.log_metrics(report["metrics"])
    return report


class Prefix:
    """A finished prefix stage directory: per split the windows' [T, H] rows, or None when not cached."""

    def __init__(self, d):
        d = Path(d)
        self.meta = store.read_meta(d)
        self.dtype = self.meta["dtype"]
        self.train_from = int(self.meta["train_from"])
        self.h: dict[str, WindowRows] = {}
        if self.dtype != "none":
            shape = (int(self.meta["window"]), int(self.meta["hidden"]))
            for split in SPLITS:
                self.h[split] = WindowRows(open_split(d, split, self.meta), "h", shape)

    @property
    def cached(self) -> bool:
        return self.dtype != "none"
