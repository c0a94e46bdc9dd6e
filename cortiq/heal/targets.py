"""The heal targets: per row, the teacher's top-k next-token distribution
(renormalised), the data's own next token mixed in with weight `ce`, every
row scaled by its weight (unscored rows weigh 0).

Output (a stage directory): `train.arrow` and `val.arrow`, one row per window:
`ids` [T·k] uint32, `probs` [T·k] f32, `total` (the window's summed row weights).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import store, tracking
from ..errors import CortiqError
from .rows import RowWriter, WindowRows, open_table
from .settings import HealSettings

STAGE = "heal-targets"
VERSION = 1
SPLITS = ("train", "val")


def mix_targets(ids: torch.Tensor, probs: torch.Tensor, nxt: torch.Tensor, weight: torch.Tensor, ce: float):
    """Targets of rows: teacher `ids`/`probs` [N, k], the data's next token `nxt` [N],
    row `weight` [N] -> (ids [N, k], probs [N, k]) = weight·(α·onehot(next) + (1−α)·topk).

    With 0 < α < 1 the hard target takes a slot: its own if the teacher ranked
    it, else the weakest entry's (ids stay distinct); the teacher part is
    renormalised over what is left. α = 0: the teacher alone; α = 1: the one-hot."""
    ids = ids.clone()
    probs = probs.float().clone()
    nxt = nxt.to(ids.dtype)
    alpha = float(ce)
    if alpha >= 1.0:
        ids = nxt[:, None]
        probs = torch.ones_like(ids, dtype=torch.float32)
    elif alpha > 0.0:
        k = ids.shape[1]
        match = ids == nxt[:, None]  # [N, k]
        has = match.any(1)  # [N]
        slot = torch.where(has, match.to(torch.int8).argmax(1), torch.full_like(nxt, k - 1))  # [N]
        miss = ~has
        ids[miss, k - 1] = nxt[miss]
        probs[miss, k - 1] = 0.0
        s = probs.sum(1, keepdim=True).clamp_min(1e-12)
        probs = (1.0 - alpha) * probs / s
        probs.scatter_add_(1, slot[:, None], torch.full((len(slot), 1), alpha, dtype=probs.dtype, device=probs.device))
    return ids, probs * weight.float()[:, None]


def mix_targets_reference(ids, probs, nxt, weight, ce, vocab: int) -> torch.Tensor:
    """Dense [N, V] targets built row by row, the plain way (tests)."""
    n, k = ids.shape
    out = torch.zeros(n, vocab, dtype=torch.float64)
    for r in range(n):
        tid = [int(x) for x in ids[r]]
        tp = [float(x) for x in probs[r]]
        if ce >= 1.0:
            out[r, int(nxt[r])] = 1.0
        else:
            if ce > 0.0 and int(nxt[r]) not in tid:
                tid[-1], tp[-1] = int(nxt[r]), 0.0
            s = max(sum(tp), 1e-12)
            for i, p in zip(tid, tp):
                out[r, i] += (1.0 - ce) * p / s if ce > 0.0 else p
            if ce > 0.0:
                out[r, int(nxt[r])] += ce
        out[r] *= float(weight[r])
    return out


def window_sets(tdata_dir, s: HealSettings):
    """The train and val windows of a tdata stage directory (cortiq.data)."""
    from ..data import Tdata, windows

    td = Tdata.open(tdata_dir)
    return td, {split: windows(td, split, s.window, loss_on=s.loss_on) for split in SPLITS}


def digest_of(teacher_cmf, tdata_dir, s: HealSettings) -> str:
    inputs = [store.file_digest(tdata_dir)] + ([] if s.ce >= 1.0 else [store.file_digest(teacher_cmf)])
    return store.digest(STAGE, VERSION, s.targets_key(), inputs)


def teacher_targets(teacher_cmf, tdata_dir, settings: HealSettings, out, logger: tracking.Logger = tracking.NULL,
                    progress: bool = True) -> dict:
    """Run the teacher over the train and val windows (unless ce = 1) and write the targets to `out`."""
    import sys
    import time

    from tqdm import tqdm

    from .settings import resolve_compute, resolve_device

    s = settings
    out = Path(out)
    _, wins = window_sets(tdata_dir, s)
    k = s.slots
    teacher = None
    dev = resolve_device(s.device)
    if s.ce < 1.0:
        from ..model import load_model

        teacher = load_model(teacher_cmf, dtype=torch.float32, device=dev).eval()
        if s.compile and dev.type == "cuda":
            teacher.compile_layers()
        if teacher.arch.vocab_size < k:
            raise CortiqError(f"{teacher_cmf}: vocabulary of {teacher.arch.vocab_size} is smaller than topk {k}")
    cdt = resolve_compute(s.compute_dtype, dev)
    digest = out.name.rsplit("-", 1)[-1]
    meta = {"stage": STAGE, "version": VERSION, "digest": digest, "settings": s.targets_key(),
            "inputs": {"teacher": str(teacher_cmf) if teacher is not None else None, "tdata": str(tdata_dir)},
            "slots": k, "window": s.window, "counts": {sp: len(w) for sp, w in wins.items()}}
    t0 = time.perf_counter()
    T = s.window
    with store.stage_dir(out, meta) as part:
        for split, w in wins.items():
            with RowWriter(part / f"{split}.arrow", {"ids": (pa.uint32(), T * k), "probs": (pa.float32(), T * k)},
                           {"total": pa.float64()}) as wr, \
                    tqdm(total=len(w), desc=f"teacher top-{k} ({split})", unit="win",
                         disable=not progress or teacher is None, file=sys.stderr) as bar:
                for a in range(0, len(w), s.batch):
                    ids = torch.from_numpy(w.ids[a : a + s.batch]).to(dev)  # [B, T]
                    nxt = torch.from_numpy(w.next[a : a + s.batch]).reshape(-1).to(dev)  # [B·T]
                    wt = torch.from_numpy(w.weight[a : a + s.batch]).reshape(-1).to(dev)  # [B·T]
                    if teacher is not None:
                        with torch.no_grad(), torch.autocast(dev.type, dtype=cdt, enabled=cdt != torch.float32):
                            h, _ = teacher.forward_hidden(ids)
                            tid, tp = teacher.topk_next(h, k, chunk=s.head_chunk)  # [B, T, k]
                        tid, tp = tid.reshape(-1, k), tp.reshape(-1, k)
                    else:
                        tid, tp = nxt[:, None], torch.ones(len(nxt), 1, device=dev)
                    tid, tp = mix_targets(tid, tp, nxt, wt, s.ce)
                    B = ids.shape[0]
                    wr.write(ids=tid.to(torch.int64).cpu().numpy().astype(np.uint32).reshape(B, -1),
                             probs=tp.float().cpu().numpy().reshape(B, -1),
                             total=w.weight[a : a + s.batch].astype(np.float64).sum(1))
                    bar.update(B)
    secs = time.perf_counter() - t0
    report = {"metrics": {"teacher_secs": secs, "train_windows": len(wins["train"]), "val_windows": len(wins["val"])},
              "slots": k, "teacher": teacher is not None}
    logger.log_metrics({"heal.teacher_secs": secs})
    return report


class Targets:
    """A finished targets stage directory: per split, windows' ids/probs [T, k] and totals."""

    def __init__(self, d):
        d = Path(d)
        self.meta = store.read_meta(d)
        self.k, self.T = int(self.meta["slots"]), int(self.meta["window"])
        self.ids, self.probs, self.total = {}, {}, {}
        for split in SPLITS:
            t = open_table(d / f"{split}.arrow")
            self.ids[split] = WindowRows(t, "ids", (self.T, self.k))
            self.probs[split] = WindowRows(t, "probs", (self.T, self.k))
            self.total[split] = t.column("total").to_numpy()
