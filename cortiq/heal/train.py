"""Student training (S4): the layers from `train_from` up (all of them, or
their MLPs only) learn the targets (top-k, top-k plus a rest bucket, sampled
teacher tokens, or the teacher's whole distribution run online: `Objective`).

f32 master weights, Adam, compute under autocast (bf16 on CUDA); warm-up then
cosine to 0.1 of the peak, or the Genesis schedule; gradient clipping; a
non-finite step is skipped (f16 compute: the loss scale halves), 20 abort.
The held-out loss is measured every `eval_every` steps and at the end; the
best checkpoint by it is what the run returns. A checkpoint every
`checkpoint_every` steps (trained weights, optimizer, step, data order, RNG,
best so far) lets a killed run continue to the same end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import dist, tracking
from ..data.windowing import batch_indices
from ..errors import CortiqError
from . import memory as mem
from .disk import OFF, REPLACE, plan_checkpoints
from .kinds import DEFAULT, KINDS, TargetKind
from .rows import WindowRows
from ..train_loop import Best, LoopState, Update, lr_shape, skips_on_device, update
from .schedule import genesis_decay, genesis_from
from .shadow import Average
from .settings import HealSettings

#: the f16 loss scale's start (halved at each non-finite step)
F16_SCALE = 4096.0


# ── the data one step consumes ──────────────────────────────────────────


@dataclass
class SplitData:
    """One split's windows and targets; `index` [n_batches, batch] names the windows of each batch."""

    ids: np.ndarray  # [N, T] int64
    tids: WindowRows  # [T, k] per window
    tprobs: WindowRows  # [T, k] per window
    total: np.ndarray  # [N] summed row weights
    index: np.ndarray  # [n_batches, batch]
    h0: WindowRows | None = None  # [T, H] per window: the frozen prefix's output
    #: [n_batches, global batch]: the whole batches when `index` holds this rank's share of each
    #: (a share's loss is divided by its whole batch's row weight: see cortiq.heal.parallel)
    group: np.ndarray | None = None
    #: with retain data: [N] the source of each window (train), [n_batches] of each batch (val,
    #: whose batches hold one source each), and the sources' names
    source: np.ndarray | None = None
    names: tuple[str, ...] = ()

    @property
    def n_batches(self) -> int:
        return int(self.index.shape[0])

    def batch(self, b: int, device):
        i = self.index[b]
        # pinned host copies go to a CUDA device without blocking the host (see Ahead)
        cuda = torch.device(device).type == "cuda"

        def put(a: np.ndarray, dtype=None) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a))
            return (t.pin_memory() if cuda else t).to(device, dtype, non_blocking=cuda)

        ids = put(self.ids[i])  # [B, T]
        k = self.tids.shape[-1]
        tid = put(self.tids.take(i).astype(np.int64)).reshape(-1, k)  # [B·T, k]
        tp = put(self.tprobs.take(i)).reshape(-1, k)  # [B·T, k]
        h0 = None if self.h0 is None else put(self.h0.take(i), torch.float32)  # [B, T, H]
        return ids, h0, tid, tp, float(self.total[i if self.group is None else self.group[b]].sum())


class Ahead:
    """The next batch on its way to a CUDA device while this step computes: its
    host gather (numpy), pinning and copy run on a worker thread, issued right
    after the step's backward is launched, so the main thread goes on launching
    the step's kernels (on two GPUs the main thread is the bottleneck of a
    sharded step, and pinning a batch there cost it a part of every step:
    bench/RESULTS.md, "The sharded step's CPU cost"); the copy goes on a
    side stream that the step's stream waits for when the batch is taken.
    Elsewhere a batch is read when asked (a CPU has no copy to hide, and its
    ops stay on the main thread's own intra-op threads)."""

    def __init__(self, data: SplitData, device):
        from concurrent.futures import ThreadPoolExecutor

        self.data, self.device = data, torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="cortiq-ahead") if cuda else None
        self.pending = None  # (batch number, future of its tensors)

    def _load(self, b: int) -> tuple:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return self.data.batch(b, self.device)

    def prefetch(self, b: int) -> None:
        if self.pool is not None:
            self.pending = (b, self.pool.submit(self._load, b))

    def get(self, b: int) -> tuple:
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != b:
            if pending is not None:
                pending[1].result()  # a stale one is finished (its copies queued), then dropped
            return self.data.batch(b, self.device)
        out = pending[1].result()
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(self.stream)  # the thread has queued its copies: this waits for them
        for t in out:
            if isinstance(t, torch.Tensor):
                t.record_stream(cur)  # allocated on the side stream, used on this one
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def train_index(n: int, batch: int) -> np.ndarray:
    """Train batches: whole batches only (the tail windows are dropped)."""
    nb = n // batch
    return np.arange(nb * batch, dtype=np.int64).reshape(nb, batch)


def val_index_by_source(source: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Val batches of one source each (the held-out loss of every source apart):
    (index [n_batches, batch], the source of each batch [n_batches])."""
    idx, src = [], []
    for k in np.unique(source):  # sources, a handful
        mine = np.flatnonzero(source == k)
        rows = mine[batch_indices(len(mine), batch)]
        idx.append(rows)
        src.append(np.full(len(rows), k, dtype=np.int64))
    return np.concatenate(idx), np.concatenate(src)


def total_steps_of(s: HealSettings, n_batches: int, step_tokens: int) -> int:
    """The run's steps: `epochs` passes over the batches, or (epochs 0) the `tokens` budget."""
    if s.epochs > 0:
        return max(1, math.ceil(s.epochs * n_batches))
    return max(1, math.ceil(s.tokens / max(step_tokens, 1)))


# ── the student's trained tail ──────────────────────────────────────────


class StudentTail:
    """The student as the trainer sees it: a frozen start (embedding and layers
    below `train_from`), the trained layers, the frozen final norm and head.

    Embedding, final norm and head stay frozen: they are shared with the
    teacher's geometry (a tied head is the embedding) and a fold does not
    touch them; the seed trains the layers only."""

    def __init__(self, model, train_from: int, ffn_only: bool, drop_prefix: bool):
        self.model = model
        self.train_from = train_from
        self.num_layers = len(model.layers)
        self.drop_prefix = drop_prefix
        if drop_prefix:
            # the cache replaces them: the student holds only the tail
            for i in range(train_from):
                model.layers[i] = _Dropped(i)
        self.ffn_only = ffn_only
        #: the tail wrapped for training across ranks (cortiq.heal.parallel), or None
        self.wrapped: torch.nn.Module | None = None
        for p in model.parameters():
            p.requires_grad_(False)
        self.collect(mark=True)
        if not self.params:
            raise CortiqError(f"heal: nothing to train from layer {train_from} (ffn_only={ffn_only})")
        self.checkpointed = 0  # (a model reused from another tail may carry its marks)

    @property
    def checkpointed(self) -> int:
        """How many trained layers, from the lowest, recompute their activations
        in the backward (memory "checkpoint"; 0: none). The lowest: the backward
        reaches them last, when the upper layers' activations are already freed,
        so their recompute adds to the gradients alone, never to the forward's
        peak (checkpointing the top ones would recompute them while every lower
        layer's activations are still held)."""
        return self._checkpointed

    @checkpointed.setter
    def checkpointed(self, k: int) -> None:
        self._checkpointed = k = min(k, self.num_layers - self.train_from)
        for i in range(self.train_from, self.num_layers):
            layer, mark = self.model.layers[i], i < self.train_from + k
            if not hasattr(layer, "recompute"):  # a layer that would ignore the mark saves nothing
                if mark:
                    raise CortiqError(f"heal: {type(layer).__name__} layers cannot recompute their activations; "
                                      "use memory plain or micro")
                continue
            layer.recompute = mark

    def collect(self, mark: bool = False) -> None:
        """The trained parameters by layer (again after sharding replaced them); `mark`: they require grad."""
        self.params: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in self.model.named_parameters():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                continue
            layer = int(parts[2])
            if layer < self.train_from or (self.ffn_only and parts[3] != "mlp"):
                continue
            self.params.setdefault(layer, []).append((name, p))
            if mark:
                p.requires_grad_(True)

    @property
    def running(self) -> range:
        """The trunk layers this tail runs: all of them, or only the trained
        ones when the cached prefix replaced the layers below them."""
        return range(self.train_from if self.drop_prefix else 0, self.num_layers)

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [np_ for l in sorted(self.params) for np_ in self.params[l]]

    @torch.no_grad()
    def start(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.run_layers(self.model.embed(ids), 0, self.train_from)  # [B, T, H]

    def tail(self, h0: torch.Tensor) -> torch.Tensor:
        return self.run_tail(h0) if self.wrapped is None else self.wrapped(h0)

    def run_tail(self, h0: torch.Tensor) -> torch.Tensor:
        h = self.model.run_layers(h0, self.train_from, self.num_layers)  # [B, T, H]
        return self.model.model.norm(h)

    def set_active(self, lowest: int) -> None:
        """Genesis: layers below `lowest` get no gradient this epoch."""
        for l, ps in self.params.items():
            for _, p in ps:
                p.requires_grad_(l >= lowest)

    def state(self) -> dict[str, torch.Tensor]:
        """Whole CPU copies of the trained weights (sharded ones gathered: every rank calls it)."""
        from .parallel import full

        return {n: full(p.detach()).to("cpu", copy=True) for n, p in self.named()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        from .parallel import put

        for n, p in self.named():
            put(p, state[n])


class _Dropped(torch.nn.Module):
    """A prefix layer whose output is cached: running it is a bug, said loudly."""

    def __init__(self, i: int):
        super().__init__()
        self.i = i

    def forward(self, *a, **k):
        raise RuntimeError(f"heal: layer {self.i} was dropped (its output is cached) but was run")


@dataclass
class Objective:
    """How a batch's stored target rows become a loss: the target kind (what the
    targets stage stored; a name is looked up in KINDS), and for a kind whose
    teacher runs online ("full") that teacher and ce."""

    kind: TargetKind | str = DEFAULT
    teacher: torch.nn.Module | None = None
    ce: float = 0.0

    def __post_init__(self):
        if isinstance(self.kind, str):
            self.kind = KINDS[self.kind]


def batch_loss(tail: StudentTail, ids, h0, tid, tp, chunk: int, device, cdt,
               obj: Objective | None = None) -> torch.Tensor:
    """The summed loss of one batch against its targets (divide by the batch's total weight)."""
    obj = obj or Objective()
    if h0 is None:
        h0 = tail.start(ids)
    with torch.autocast(device.type, dtype=cdt, enabled=cdt != torch.float32):
        hf = tail.tail(h0)  # [B, T, H]
        return obj.kind.loss(hf.reshape(-1, hf.shape[-1]), tail.model.head_weight, tid, tp, chunk, ids, obj.teacher,
                             obj.ce)


def step_backward(tail: StudentTail, batch: tuple, micro: int, chunk: int, device, cdt, obj: Objective | None,
                  scale: float = 1.0, nosync=contextlib.nullcontext) -> torch.Tensor:
    """Forward and backward of one step's batch, `micro` windows at a time (0:
    all at once). Each part's summed loss is divided by the whole step's total
    weight before its backward, so the accumulated gradients are the one
    batch's. `nosync()` wraps every part but the last (across ranks: the
    gradients are reduced once, after the last). Returns the step's normalised
    loss (detached)."""
    ids, h0, tid, tp, tot = batch
    B, T = ids.shape
    m = B if micro <= 0 else min(micro, B)
    den = max(tot, 1e-9)
    loss = None
    for a in range(0, B, m):  # micro-batches, not tokens: at most a handful
        rows = slice(a * T, (a + m) * T)  # target rows of windows a..a+m-1
        # DDP decides in the forward whether the backward reduces: both go inside
        with nosync() if a + m < B else contextlib.nullcontext():
            part = batch_loss(tail, ids[a : a + m], None if h0 is None else h0[a : a + m], tid[rows], tp[rows],
                              chunk, device, cdt, obj) / den
            (part * scale).backward()
        loss = part.detach() if loss is None else loss + part.detach()
    return loss


def memory_plan(tail: StudentTail, s: HealSettings, device, obj: Objective | None = None) -> mem.MemoryPlan:
    """The memory savings this run's step uses: what `s.memory` names, or for
    auto the estimate against what the step may use: `s.device_mem_gb` less what
    is already on the device (the model and a teacher run online; on a CPU their
    weights), else STEP_SHARE of the device's free memory (plain on a CPU without a budget)."""
    shape = mem.shape_of(tail, s.batch, s.window, s.head_chunk, s.target_kind)
    allow, budget = None, ""
    if s.memory == "auto":
        models = [tail.model] + ([obj.teacher] if obj is not None and obj.teacher is not None else [])
        there = torch.cuda.memory_allocated(device) if device.type == "cuda" else \
            sum(t.numel() * t.element_size() for m in models for t in (*m.parameters(), *m.buffers()))
        allow, budget = mem.allowance(s.device_mem_gb, device, there)
    return mem.choose_memory(s.memory, s.memory_parts(), shape, s.micro_windows(), allow, mem.have_adam8,
                      s.checkpoint_layers, budget, say=dist.is_main())  # one line, not one per rank


# ── data order ──────────────────────────────────────────────────────────


class Order:
    """The seed's shuffle of batch numbers: Fisher–Yates driven by xorshift64,
    the permutation reshuffled at each epoch from the previous one (its state
    is checkpointed). A loop over batches once per epoch, not on the hot path."""

    MASK = (1 << 64) - 1

    def __init__(self, n: int, seed: int):
        self.rng = (0x9E3779B97F4A7C15 ^ (seed * 0x2545F4914F6CDD1D)) & self.MASK or 1
        self.perm = list(range(n))

    def shuffle(self) -> None:
        rng, perm = self.rng, self.perm
        for i in range(len(perm) - 1, 0, -1):
            rng ^= (rng << 13) & self.MASK
            rng ^= rng >> 7
            rng ^= (rng << 17) & self.MASK
            j = rng % (i + 1)
            perm[i], perm[j] = perm[j], perm[i]
        self.rng = rng


# ── the loop ────────────────────────────────────────────────────────────


@dataclass
class HealState(LoopState):
    """The heal loop's state: the shared one, the batch cursor (train batches read,
    skipped ones too), the f16 loss scale and the dynamic mix's state. Its plain form
    is a checkpoint's "state" table (the same keys since checkpoints began, so an
    older checkpoint resumes)."""

    cursor: int = 0
    scale: float = 1.0
    mix: dict | None = None


class HealRun:
    """One `fit`: its setup (data shares, memory plan, optimizer, resume or the first
    evaluation) and its named parts, which `fit`'s loop calls."""

    def __init__(self, tail: StudentTail, train: SplitData, val: SplitData, s: HealSettings, work_dir, device, cdt,
                 key: str, logger: tracking.Logger, progress: bool, obj: Objective | None, sharding):
        from tqdm import tqdm

        from .parallel import prepare

        self.tail, self.s, self.device, self.cdt, self.key, self.logger = tail, s, device, cdt, key, logger
        self.obj = obj
        self.progress = progress and dist.is_main()  # one bar, not one per rank
        self.sharding = sh = prepare(tail, s, device, cdt) if sharding is None else sharding
        self.tokens = train.index.shape[1] * train.ids.shape[1]  # a whole step's, over every rank
        self.whole = train  # the global batches the dynamic mix composes, before each rank takes its share
        self.train, self.val = train, val = sh.local(train), sh.local(val)
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.nb = nb = train.n_batches
        if nb < 1:
            raise CortiqError(f"heal: {len(train.ids)} train windows of {s.window} tokens, fewer than one batch of {s.batch}")
        if val.n_batches < 1:
            raise CortiqError("heal: the val split has no scored window")
        self.total_steps = total_steps_of(s, nb, self.tokens)
        self.mixer = None
        if s.mix == "dynamic" and self.whole.source is not None and len(self.whole.names) > 1:
            from .mix import Mixer

            self.mixer = Mixer(self.whole.source, len(self.whole.names), s.seed, s.mix_lr)
        groups = [{"params": [p for _, p in tail.params[l]], "lr": s.lr, "layer": l} for l in sorted(tail.params)]
        self.params = [p for _, p in tail.named()]
        # before the memory plan, which counts what is on the device; a resume loads its checkpoint's over it
        self.average = Average(tail.named(), s.average) if s.average else None
        self.mplan = mplan = memory_plan(tail, s, device, obj)
        if "adam8" in mplan and sh.kind != "single":
            raise CortiqError("heal: 8-bit Adam moments (memory adam8) run on one process only; on more than one GPU "
                              "use memory checkpoint+micro (FSDP already splits the Adam state across the GPUs)")
        tail.checkpointed = mplan.layers
        self.micro = s.micro_windows() if "micro" in mplan else 0
        self.opt = mem.make_optimizer(groups, s.lr, device, adam8="adam8" in mplan)
        self.on_device = skips_on_device(self.opt)
        self.lowest = tail.train_from
        self.order = Order(nb, s.seed)
        # room for the checkpoints beside the healed model (its trained weights in 16 bits); rank 0's
        # decision on every rank, which must save alike
        trained = sum(p.numel() for p in self.params)
        self.checkpoints = dist.agree(plan_checkpoints(s.checkpoint_every, trained, "adam8" in mplan, 2 * trained,
                                                       self.work_dir, s.disk_gb, say=dist.is_main(),
                                                       averaged=self.average is not None))
        self.resume()
        self.bar = tqdm(total=self.total_steps, initial=self.st.done, desc="heal", unit="step", disable=not self.progress,
                        file=sys.stderr, dynamic_ncols=True)
        self.ahead = Ahead(train, device)

    # ── the state: a checkpoint's, or a fresh one ──
    def resume(self) -> None:
        """The state of this run's checkpoint (weights, optimizer and RNG loaded in place
        by the sharding), else a fresh one after the first held-out evaluation."""
        ck = self.sharding.resume(self.work_dir, self.key, self.opt)
        if ck is not None:
            self.order.rng, self.order.perm = int(ck["order_rng"]), [int(x) for x in ck["order_perm"]]
            self.st = HealState.from_checkpoint(ck["state"])
            self.start = ck["e0"]
            self.best = Best(ck["best_loss"], ck["best_step"], ck["best_state"])
            if self.average is not None:
                self.average.load(ck["average_state"])
            if self.mixer is not None:
                self.mixer.load(self.st.mix)
            return
        self.st = HealState(scale=F16_SCALE if self.cdt == torch.float16 else 1.0)
        self.start, per = self.heldout()
        self.best = Best(self.start, 0, self.sharding.snapshot())
        self.record_eval(self.start, per)

    def save(self) -> None:
        """A resumable checkpoint: the sharding writes weights, optimizer and RNG beside this loop state."""
        if self.checkpoints == OFF:
            return
        if self.checkpoints == REPLACE:
            self.sharding.drop_checkpoint(self.work_dir)
        self.st.mix = None if self.mixer is None else self.mixer.state()
        self.sharding.save(self.work_dir, {"key": self.key, "order_rng": self.order.rng, "order_perm": list(self.order.perm),
                                       "state": self.st.to_checkpoint(), "e0": self.start, "best_loss": self.best.value,
                                       "best_step": self.best.step, "best_state": self.best.state,
                                       **({} if self.average is None else {"average_state": self.average.state})},
                           self.opt)

    # ── held-out evaluation ──
    def heldout(self) -> tuple[float, dict]:
        """The held-out loss, and with retain data each source's ({name: loss})."""
        val, s = self.val, self.s
        K = len(val.names) if val.source is not None else 0
        num, den = np.zeros(max(K, 1)), np.zeros(max(K, 1))
        with torch.no_grad():
            for b in range(val.n_batches):
                ids, h0, tid, tp, tot = val.batch(b, self.device)
                k = int(val.source[b]) if K else 0
                num[k] += float(batch_loss(self.tail, ids, h0, tid, tp, s.head_chunk, self.device, self.cdt, self.obj))
                den[k] += tot  # the whole batch's: each rank's share of it sums to it
        num = np.array([self.sharding.sum_(float(x)) for x in num])
        per = {name: float(num[k] / den[k]) for k, name in enumerate(val.names) if den[k] > 0} if K else {}
        return float(num.sum() / max(den.sum(), 1e-9)), per

    def record_eval(self, e: float, per: dict) -> None:
        if self.mixer is not None:
            self.mixer.update([per.get(n, 0.0) for n in self.whole.names])
        row = {"step": self.st.done, "heldout": e, **{f"heldout.{n}": v for n, v in per.items()}}
        if self.mixer is not None:
            row.update({f"mix.{n}": float(w) for n, w in zip(self.whole.names, self.mixer.w)})
        self.st.evals.append(row)
        self.logger.log_metrics({k: v for k, v in row.items() if k != "step"}, step=self.st.done)

    @contextlib.contextmanager
    def averaged(self):
        """The average in the trained weights' place for the block, where the run keeps one."""
        if self.average is None:
            yield
            return
        self.average.swap()
        self.sharding.written()
        try:
            yield
        finally:
            self.average.swap()
            self.sharding.written()

    def evaluate(self) -> float:
        """The held-out loss now (of the average, where the run keeps one): the plateau count, the best
        weights and the mix follow it."""
        with self.averaged():
            e, per = self.heldout()
            # an evaluation counts as better when it lowers the best by min_improve of it
            self.st.stale = 0 if e < self.best.value * (1.0 - self.s.min_improve) else self.st.stale + 1
            self.best.offer(e, self.st.done, self.sharding.snapshot)
        self.record_eval(e, per)
        return e

    def maybe_stop(self, e: float) -> None:
        """The plateau stop: `patience` evaluations in a row without a better loss (before the last step)."""
        st, s = self.st, self.s
        if s.patience and st.stale >= s.patience and st.done < self.total_steps:
            st.stopped = st.done
        if self.progress:
            self.bar.write(f"  step {st.done}: held-out loss {e:.5f} (best {self.best.value:.5f} at step "
                           f"{self.best.step})" + ("; plateau, stopping" if st.stopped else ""), file=sys.stderr)

    # ── one step ──
    def set_rate(self, step: int) -> float:
        """Each group's rate for update number `step` (the schedule; Genesis: each layer's decay)."""
        s = self.s
        lr = s.lr * lr_shape(step, self.total_steps, s.warm, s.genesis)
        for g in self.opt.param_groups:
            mem.set_lr(g, lr * (genesis_decay(g["layer"], self.lowest, step // self.nb) if s.genesis else 1.0))
        return lr

    def batch(self):
        """The next train batch in the seed's order (the order reshuffled at each epoch's start)."""
        st, nb = self.st, self.nb
        pos = st.cursor % nb
        if pos == 0:
            # a checkpoint is taken after the cursor moves, so a resumed run
            # at an epoch boundary shuffles here just as the first run did
            self.order.shuffle()
        if self.s.genesis:
            self.lowest = genesis_from(st.done // nb, self.tail.num_layers, self.tail.train_from)
            self.tail.set_active(self.lowest)
            self.sharding.following()
        if self.mixer is not None:  # this step's windows by the current shares (each rank its share of them)
            index = self.mixer.batch(self.whole.index.shape[1])[None]
            return self.sharding.local(dataclasses.replace(self.whole, index=index)).batch(0, self.device)
        return self.ahead.get(self.order.perm[pos])

    def step(self) -> Update:
        """Forward, backward and the update of one batch; a non-finite one is skipped and counted."""
        st, s, sh = self.st, self.s, self.sharding
        t0 = time.perf_counter()
        pos = st.cursor % self.nb
        batch = self.batch()
        # this rank's share of the whole batch's mean (grad_scale: DDP averages over ranks, the loss is a sum)
        loss = step_backward(self.tail, batch, self.micro, s.head_chunk, self.device, self.cdt, self.obj,
                             st.scale * sh.grad_scale, sh.nosync)
        if self.mixer is None and pos + 1 < self.nb:  # the next batch of this epoch's order, while the GPU works
            self.ahead.prefetch(self.order.perm[pos + 1])
        if st.scale != 1.0:  # f16: the loss scale off the gradients, one multi-tensor kernel
            torch._foreach_div_([p.grad for p in self.params if p.grad is not None], st.scale)
        gn = sh.clip(self.params, s.clip)  # [] on the device
        lt = sh.sum_(loss)  # [] the whole batch's loss, alike on every rank
        st.cursor += 1
        done = st.done
        up = update(self.opt, lt, gn, lambda: self.set_rate(done + 1), self.on_device)
        self.opt.zero_grad(set_to_none=True)
        if up.skipped:
            if self.cdt == torch.float16:
                st.scale = max(st.scale / 2, 1.0)
            st.skip("heal", "lower lr or use f32/bf16 compute")
            return up
        if self.average is not None:
            self.average.update(st.done)
        dt = time.perf_counter() - t0
        st.counted(up, dt)
        self.logger.log_metrics({"loss": up.loss, "lr": up.lr, "grad_norm": up.grad_norm,
                                 "tokens_per_s": self.tokens / max(dt, 1e-9)}, step=st.done)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{up.loss:.4f}", lr=f"{up.lr:.2e}", s_step=f"{st.step_secs / st.done:.2f}",
                             refresh=False)
        return up

    def due(self, every: int) -> bool:
        """Whether this step (counted) is one of every `every` (0: never), or the last."""
        return bool(every) and (self.st.done % every == 0 or self.st.done == self.total_steps)

    # ── the end ──
    def close(self) -> None:
        self.ahead.close()

    def report(self) -> dict:
        """The best weights back in the tail, and the run's report."""
        self.bar.close()
        self.sharding.restore(self.best.state)
        if self.s.genesis:
            self.tail.set_active(self.tail.train_from)
        st = self.st
        steps = st.done
        return {
            "metrics": {"heldout_start": self.start, "heldout_best": self.best.value, "best_step": self.best.step,
                        "steps": steps, "skipped": st.skipped, "sec_per_step": st.step_secs / max(steps, 1),
                        "trained_weights": sum(p.numel() for p in self.params), "total_steps": self.total_steps,
                        "tokens": steps * self.tokens, "stopped_at": st.stopped},
            "history": st.history, "evals": st.evals, "memory": str(self.mplan),
        }


def fit(tail: StudentTail, train: SplitData, val: SplitData, s: HealSettings, work_dir, device, cdt,
        key: str = "", logger: tracking.Logger = tracking.NULL, progress: bool = True,
        obj: Objective | None = None, sharding=None) -> dict:
    """Train `tail` in place; returns the report. On return the tail holds the best weights.

    `sharding` (cortiq.heal.parallel) says how the tail runs when torchrun started
    several processes; by default it is made here from `s.shard` (one process: as is)."""
    run = HealRun(tail, train, val, s, work_dir, device, cdt, key, logger, progress, obj, sharding)
    st = run.st
    try:
        while st.done < run.total_steps and not st.stopped:
            if run.step().skipped:
                continue
            if run.due(s.eval_every):
                run.maybe_stop(run.evaluate())
            if run.due(s.checkpoint_every) or (s.checkpoint_every and st.stopped):
                run.save()
    finally:
        run.close()
    return run.report()
