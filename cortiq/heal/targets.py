"""The heal targets: per row, a sparse picture of the teacher's next-token
distribution, the data's own next token mixed in with weight `ce`, every row
scaled by its weight (unscored rows weigh 0). What a row holds depends on the
target kind in effect (cortiq.heal.kinds: topk, topk+rest, sampled, full, ce).

Output (a stage directory): `train.arrow` and `val.arrow`, one row per window:
`ids` [T·slots] uint32, `probs` [T·slots] f32, `total` (the window's summed
row weights). Run on N ranks (cortiq.dist), each writes its share of the
windows as `SPLIT-R-of-N.arrow` and meta.json's `files` lists them in order:
read as one table, they are the rows one rank writes.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import store, tracking
from ..errors import CortiqError
from .. import dist
from .kinds import KINDS, REST_ID, mix_targets
from .rows import RowWriter, WindowRows, open_split
from .settings import HealSettings

SPLITS = ("train", "val")


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


def sparse_rows(z: torch.Tensor, nxt: torch.Tensor, weight: torch.Tensor, kind: str, k: int, ce: float,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of teacher logits `z` [c, V], the data's next token `nxt` [c]
    and row `weight` [c] -> stored (ids int64 [c, slots], probs f32 [c, slots])
    of the kind named `kind` ("topk+rest" or "sampled": TargetKind.chunk_rows)."""
    return KINDS[kind].chunk_rows(z, nxt, weight, k, ce, generator)


def topk_rest_reference(z, nxt, weight, k: int, ce: float) -> list[dict]:
    """The "topk+rest" rows built one by one in f64, the plain way (tests):
    per row {id: mass} over the listed ids and "rest": the mass off them."""
    out = []
    for r in range(z.shape[0]):
        p = torch.softmax(z[r].double(), -1)
        order = [int(i) for i in torch.argsort(p, descending=True)]
        listed = order[:k]
        t = int(nxt[r])
        if ce > 0.0:
            listed.append(order[k] if t in listed else t)
        row = {i: (1.0 - ce) * float(p[i]) + (ce if i == t else 0.0) for i in listed}
        row["rest"] = (1.0 - ce) * (1.0 - sum(float(p[i]) for i in listed))
        out.append({key: v * float(weight[r]) for key, v in row.items()})
    return out


@torch.no_grad()
def teacher_rows(teacher, h: torch.Tensor, nxt: torch.Tensor, weight: torch.Tensor, s: HealSettings,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored target rows of the teacher's final hidden rows `h` [B, T, H]:
    (ids [B·T, slots], probs [B·T, slots]) of the settings' kind (TargetKind.teacher_rows)."""
    return s.target_kind.teacher_rows(teacher, h, nxt, weight, s.topk, s.ce, s.head_chunk, generator)


def weigh_confident(tid: torch.Tensor, tp: torch.Tensor, weight: torch.Tensor, confident: float):
    """Stored rows reweighted by the teacher's confidence: ids/probs [N, slots] (probs already
    scaled by the row's `weight` [N]) -> (probs, weight) scaled by 1 + confident·p_top, p_top the
    largest listed entry over the row's weight (the rest bucket of topk+rest is not a token)."""
    listed = torch.where(tid == REST_ID, torch.zeros_like(tp), tp)
    top = (listed.max(1).values / weight.clamp_min(1e-30)).clamp(0, 1)  # [N]
    f = 1.0 + confident * torch.where(weight > 0, top, torch.zeros_like(top))
    return tp * f[:, None].to(tp.dtype), weight * f.to(weight.dtype)


def window_sets(tdata_dir, s: HealSettings):
    """The train and val windows of a tdata stage directory (cortiq.data)."""
    from ..data import Tdata, windows

    td = Tdata.open(tdata_dir)
    return td, {split: windows(td, split, s.window, loss_on=s.loss_on) for split in SPLITS}


def draws(dev, seed: int, split: int, batch: int) -> torch.Generator:
    """The "sampled" draws of one batch of windows: a stream of their own, so a
    batch draws alike whichever rank runs it (and after whatever batches)."""
    return torch.Generator(device=dev).manual_seed(((seed * len(SPLITS) + split) << 32 | batch) & ((1 << 63) - 1))


def write_targets(teacher_cmf, tdata_dir, settings: HealSettings, out, record: dict,
                  logger: tracking.Logger = tracking.NULL, progress: bool = True) -> dict:
    """Run the teacher over the train and val windows (unless ce = 1 or the
    target is "full") and write the targets to `out`, its meta.json opening with
    `record` (the stage's name, version, digest and key: cortiq.heal.stages.teacher_targets)."""
    import sys
    import time

    from tqdm import tqdm

    from ..devices import rank_device
    from ..devices import resolve_compute

    s = settings
    out = Path(out)
    _, wins = window_sets(tdata_dir, s)
    k = s.slots
    teacher = None
    dev = rank_device(s.device, "heal settings")
    kind = s.target_kind
    if kind.teacher_pass:
        from ..model import load_model

        teacher = load_model(teacher_cmf, dtype=torch.float32, device=dev).eval()
        if s.compile and dev.type == "cuda":
            teacher.compile_layers()
        if teacher.arch.vocab_size < k:
            raise CortiqError(f"{teacher_cmf}: vocabulary of {teacher.arch.vocab_size} is smaller than topk {k}")
    cdt = resolve_compute(s.compute_dtype, dev)
    meta = {**record, "inputs": {"teacher": str(teacher_cmf) if kind.names_teacher else None, "tdata": str(tdata_dir)},
            "slots": k, "window": s.window, "kind": kind.name, "counts": {sp: len(w) for sp, w in wins.items()}}
    t0 = time.perf_counter()
    T = s.window
    if dist.active():
        meta["files"] = {split: dist.shard_names(split) for split in SPLITS}
    with dist.stage_dir(out, meta) as part:
        for si, split in enumerate(SPLITS):
            w = wins[split]
            share = dist.shard(len(w), s.batch)  # whole batches: the batches one rank runs
            with RowWriter(part / dist.shard_name(split), {"ids": (pa.uint32(), T * k), "probs": (pa.float32(), T * k)},
                           {"total": pa.float64()}) as wr, \
                    tqdm(total=len(share), desc=f"teacher top-{k} ({split})", unit="win",
                         disable=not progress or teacher is None or not dist.is_main(), file=sys.stderr) as bar:
                for a in range(share.start, share.stop, s.batch):
                    gen = draws(dev, s.seed, si, a // s.batch) if kind.seeded else None
                    ids = torch.from_numpy(w.ids[a : a + s.batch]).to(dev)  # [B, T]
                    nxt = torch.from_numpy(w.next[a : a + s.batch]).reshape(-1).to(dev)  # [B·T]
                    wt = torch.from_numpy(w.weight[a : a + s.batch]).reshape(-1).to(dev)  # [B·T]
                    if teacher is not None:
                        with torch.no_grad(), torch.autocast(dev.type, dtype=cdt, enabled=cdt != torch.float32):
                            h, _ = teacher.forward_hidden(ids)
                            tid, tp = teacher_rows(teacher, h, nxt, wt, s, gen)  # [B·T, slots]
                        if s.confident_weight:
                            tp, wt = weigh_confident(tid, tp, wt.float(), s.confident_weight)
                    else:
                        tid, tp = mix_targets(nxt[:, None], torch.ones(len(nxt), 1, device=dev), nxt, wt, 1.0)
                    B = ids.shape[0]
                    wr.write(ids=tid.to(torch.int64).cpu().numpy().astype(np.uint32).reshape(B, -1),
                             probs=tp.float().cpu().numpy().reshape(B, -1),
                             total=(wt.double().reshape(B, -1).sum(1).cpu().numpy() if s.confident_weight else
                                    w.weight[a : a + s.batch].astype(np.float64).sum(1)))
                    bar.update(B)
    secs = time.perf_counter() - t0
    report = {"metrics": {"teacher_secs": secs, "train_windows": len(wins["train"]), "val_windows": len(wins["val"])},
              "slots": k, "teacher": teacher is not None}
    logger.log_metrics(report["metrics"])
    return report


def same_targets(p: dict) -> dict:
    """The parameters with what cannot change the targets made alike: with ce = 1 no teacher
    runs, so neither the teacher nor the target kind matters ("full" stores no teacher output,
    but its trainer reads the teacher this stage names); only sampled targets draw from the seed."""
    s = p["settings"]
    if not s.target_kind.seeded and s.seed != 0:
        s = replace(s, seed=0)
    if s.ce >= 1.0:
        # "ce" is the kind the stage records for no teacher; set on a copy, past the choices
        # check, so the targets of every target setting under ce = 1 share one digest
        s = copy.copy(s)
        s.target = "ce"
        return {**p, "settings": s, "teacher": None}
    return {**p, "settings": s}


class Targets:
    """A finished targets stage directory: per split, windows' ids/probs [T, k] and totals."""

    def __init__(self, d):
        d = Path(d)
        self.meta = store.read_meta(d)
        self.k, self.T = int(self.meta["slots"]), int(self.meta["window"])
        #: the name of their kind (cortiq.heal.kinds); targets written before kinds were named are "topk" ones
        self.kind = self.meta.get("kind", "topk")
        self.teacher = (self.meta.get("inputs") or {}).get("teacher")
        self.ids, self.probs, self.total = {}, {}, {}
        for split in SPLITS:
            t = open_split(d, split, self.meta)
            self.ids[split] = WindowRows(t, "ids", (self.T, self.k))
            self.probs[split] = WindowRows(t, "probs", (self.T, self.k))
            self.total[split] = t.column("total").to_numpy()
