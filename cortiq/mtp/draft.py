"""The draft as a one-layer model trained on its own trunk.

The draft is the model's MTP block: row p reads token p+j (its embedding,
through enorm) and a source row (through hnorm), `eh_proj` mixes them, one
full-attention layer and the block's norm follow, the shared head reads out.
At chain step 1 the source row is the trunk's final hidden row h_p; at step
j > 1 it is the draft's own output at step j−1 (what a speculative round
feeds it). Row p of step j predicts token p+j+1 and learns the trunk's top-k
distribution at row p+j (self-distillation; `hard` moves mass onto the
trunk's own token).

With `stride` 0 (every row starts a chain) the chain is computed as a decode
round computes it (cortiq.mtp.rounds): step j of the chain starting at row r
attends to the block's rows 0..r from the trunk and to its own chain's rows,
not to other chains' draft rows; the steps before the trained one run from
the current weights without a graph. With `stride` > 0 the later steps are
laid out as rounds every `stride` rows (measures.splice): one spliced source
per window, rebuilt from the current weights every `refresh` steps, trained
with shift 1.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .. import dist
from ..errors import CortiqError
from ..heal.loss import topk_kl
from ..heal.rows import RowWriter, WindowRows, open_table
from ..train_loop import Best, LoopState, Update, adam, lr_shape, skips_on_device, update
from . import measures as M
from .rounds import decode_steps
from .trunk import TrunkSet

#: top-k kept per row of a dumped chain step
KK = 4


class Chain:
    """Every window of every data set, the trunk's rows and the chain's sources.

    ids [N, T], lens [N] (in memory); ti/tp [T, k] and h [T, H] a window: the
    sets' memory-mapped rows indexed as one (WindowRows.join: a global window
    index, nothing copied), a batch's windows gathered as it runs; `held` [N]:
    every tenth window (global index % 10 == 9), or all of them. `start` [N]:
    the row of each window's prompt's last token, where a decode's first round
    starts (default 0); `chat` [N] bool: the window answers a chat question (a
    generated window whose prompt was put in the chat template); `span`: the
    new tokens a decode runs, what the measure walks (None: to the window's end)."""

    def __init__(self, model, sets: list[TrunkSet], chain: int, stride: int, pad: int, hold_all: bool = False,
                 batch: int = 4, chunk: int = 1024, start: torch.Tensor | None = None,
                 chat: torch.Tensor | None = None, span: int | None = None,
                 branches: int | tuple[int, ...] = 1, vocab: torch.Tensor | None = None):
        self.model, self.chain, self.stride, self.pad = model, chain, stride, pad
        self.vocab = vocab  # token ids [N] the draft picks among (None: every token), as a serving engine's draft_vocab
        # a draft tree's width at each chain step: an int N, N first guesses each chained (the tree
        # of cortiq.model.decode); a tuple, the draft's top w_j at every node of step j (1 past it)
        self.widths = (branches,) if isinstance(branches, int) else tuple(int(w) for w in branches)
        self.batch, self.chunk, self.span = batch, chunk, span
        self.names = [s.name for s in sets]
        self.bounds = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
        self.ids = torch.cat([s.ids for s in sets])
        self.lens = torch.cat([s.lens for s in sets])
        self.ti = WindowRows.join([s.ti for s in sets])
        self.tp = WindowRows.join([s.tp for s in sets])
        self.h = WindowRows.join([s.h for s in sets])
        T = int(self.ids.shape[1])
        # [N, T] the trunk's own next token: small, read once from the maps
        self.t1 = torch.from_numpy(np.concatenate([np.zeros((0, T), np.int64)]
                                                  + [p[..., 0].astype(np.int64) for p in self.ti.parts]))
        n = len(self.ids)
        self.held = torch.ones(n, dtype=torch.bool) if hold_all else (torch.arange(n) % 10 == 9)
        self.start = torch.zeros(n, dtype=torch.int64) if start is None else torch.as_tensor(start, dtype=torch.int64)
        self.chat = torch.zeros(n, dtype=torch.bool) if chat is None else torch.as_tensor(chat, dtype=torch.bool)
        if self.start.shape != (n,) or self.chat.shape != (n,):
            raise ValueError(f"Chain: start {tuple(self.start.shape)} and chat {tuple(self.chat.shape)} must be [{n}]")
        self.dev = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype  # the trunk rows are kept in f32; a bf16 model reads them as bf16
        # sources per training kind; kind 0 is always the trunk's rows with shift 1
        self.kinds: list[tuple[int, int]] = [(0, 1), (1, 1)] if stride > 0 and chain > 1 else [(j - 1, j) for j in range(1, chain + 1)]
        self.src: list[WindowRows] = [self.h]
        # the spliced sources (stride > 0) go to a file of the trunk cache's layout in a folder of
        # the system's temporary folder (TMPDIR), removed with the chain
        self._tmp = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    # ── a batch's rows, gathered from the maps ──
    def hidden(self, b: torch.Tensor, s: int = 0) -> torch.Tensor:
        """Source rows of windows b [B, T, H] (CPU): the trunk's (s 0, f32) or the spliced ones (in the model's dtype)."""
        x = torch.from_numpy(self.src[s].take(b.numpy()))
        return x if s == 0 else x.to(self.dtype)

    def top(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's top-k of windows b: (ids [B, T, k] int64, probs [B, T, k] f32)."""
        i = b.numpy()
        return torch.from_numpy(self.ti.take(i).astype(np.int64)), torch.from_numpy(self.tp.take(i))

    # ── the draft ──
    def draft(self, src: torch.Tensor, ids: torch.Tensor, j: int) -> torch.Tensor:
        """The block on source rows src [B, T, H] reading tokens p+j -> normed output [B, T, H]."""
        return self.model.mtp_forward(src.to(self.dev), M.shifted(ids.to(self.dev), j, self.pad))

    def _batches(self, idx: torch.Tensor):
        for a in range(0, len(idx), self.batch):
            yield idx[a : a + self.batch]

    @torch.no_grad()
    def spliced(self, idx: torch.Tensor, off: torch.Tensor):
        """Source rows laid out as rounds (chains every `stride` rows from `off`) for windows idx,
        a batch at a time: yields (the batch's windows, its rows [B, T, H] on the CPU)."""
        for a in range(0, len(idx), self.batch):
            b = idx[a : a + self.batch]
            x = self.hidden(b).to(self.dev, self.dtype)
            ids, lens, o = self.ids[b].to(self.dev), self.lens[b].to(self.dev), off[a : a + self.batch].to(self.dev)
            for j in range(2, self.chain + 1):
                y = self.model.mtp_forward(x, M.shifted(ids, 1, self.pad))
                x = M.splice(x, y, lens, o, self.stride, j)
            yield b, x.cpu()

    def steps(self, b: torch.Tensor, upto: int, train_step: int | None = None) -> list[torch.Tensor]:
        """Steps 1..upto of every row's chain in windows b, as decode rounds compute them. [B, T, H] each"""
        return decode_steps(self.model, self.hidden(b).to(self.dev, self.dtype), self.ids[b].to(self.dev), upto, self.pad,
                            train_step)

    @torch.no_grad()
    def refresh(self, round_: int = 0) -> None:
        """Rebuild the spliced sources (stride > 0) from the current weights; stride 0 computes them per batch."""
        if self.chain == 1 or self.stride == 0:
            return
        import tempfile

        all_ = torch.arange(len(self))
        off = (all_ * 5 + round_ * 3) % self.stride
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="cortiq-chain-")
        path = Path(self._tmp.name) / "spliced.arrow"  # the last refresh's map outlives its name
        T, H = self.h.shape
        with RowWriter(path, {"h": (pa.float32(), T * H)}) as wr:
            for _, x in self.spliced(all_, off):
                wr.write(h=x.float().numpy())
        self.src = [self.h, WindowRows(open_table(path), "h", (T, H))]

    # ── one training batch ──
    def rows(self, b: torch.Tensor, kind: int, hard: float, grad: bool = True):
        """(hidden rows [n, H], target ids [n, k], probs [n, k]) for windows b at `kind`."""
        s, j = self.kinds[kind]
        ids = self.ids[b]
        if self.stride == 0:
            out = self.steps(b, j, j if torch.is_grad_enabled() else None)[-1]  # [B, T, H] step j
        else:
            out = self.draft(self.hidden(b, s), ids, j)  # [B, T, H]
        T = ids.shape[1]
        pos = torch.arange(T)[None, :]
        valid = pos < (self.lens[b][:, None] - j)  # [B, T] rows whose target exists
        if self.stride == 0:
            # chains from a row inside the prompt: a decode never starts one there (the prompt's
            # text is the data's, not the model's); they stay context for the rows after
            valid &= pos >= self.start[b][:, None]
        ti, tp = self.top(b)
        ti = torch.roll(ti, -j, 1)[valid]  # [n, k] the trunk's top-k at p+j
        tp = torch.roll(tp, -j, 1)[valid]
        if hard > 0:
            mass = tp.sum(1)  # [n]
            tp = tp * (1 - hard)
            tp[:, 0] += hard * mass
        return out[valid.to(out.device)], ti.to(out.device), tp.to(out.device)

    def loss(self, b, kind, hard: float):
        x, ti, tp = self.rows(b, kind, hard)
        n = max(int(x.shape[0]), 1)
        return topk_kl(x, self.model.head_weight, ti, tp, self.chunk) / n, n

    @torch.no_grad()
    def val_kl(self, idx: torch.Tensor) -> list[float]:
        """Held-out KL to the trunk per kind (mean per row)."""
        out = []
        for kind in range(len(self.kinds)):
            s = n = 0.0
            for b in self._batches(idx):
                x, ti, tp = self.rows(b, kind, 0.0)
                s += float(topk_kl(x, self.model.head_weight, ti, tp, self.chunk))
                n += x.shape[0]
            out.append(s / max(n, 1))
        return out

    # ── measures ──
    def _top1(self, out: torch.Tensor, k: int = 1):
        ti, tp = self.model.topk_next(out, k, self.chunk, self.vocab)
        return ti.cpu(), tp.cpu()

    @torch.no_grad()
    def tops(self, idx: torch.Tensor, dump=None) -> torch.Tensor:
        """The draft's top-1 on windows idx for every chain start, computed as a decode round
        computes it: [chain, n, T], index p of step j the chain starting at row p (its guess
        for token p+j+1). `dump(j, out, top-k ids, probs)` sees every step's rows.

        With a draft tree (`branches`), what the tree keeps: step j's guess is the trunk's token
        where it is among the draft's top w_j (the tree's width at step j), the node holding it
        being the one whose children the later steps follow (each step reads the trunk's own
        tokens, the tokens of that path), so a walk over these counts keeps what the tree's
        rounds keep."""
        tops = []
        for b in self._batches(idx):
            steps = []
            for j, o in enumerate(self.steps(b, self.chain), 1):
                nb = self.widths[j - 1] if j <= len(self.widths) else 1
                di, dp = self._top1(o, max(KK if dump is not None else 1, nb))
                if nb > 1:
                    want = M.shifted(self.t1[b], j, -1)  # [n, T] the trunk's token step j guesses
                    steps.append(torch.where((di[..., :nb] == want[..., None]).any(-1), want, di[..., 0]))
                else:
                    steps.append(di[..., 0])
                if dump is not None:
                    dump(j, o, di, dp)
            tops.append(torch.stack(steps))
        return torch.cat(tops, 1)  # [chain, n, T]

    @torch.no_grad()
    def chain_counts(self, idx: torch.Tensor, dump=None, tops: torch.Tensor | None = None) -> torch.Tensor:
        """Hold counts on windows idx, every row starting a chain computed as a decode round does."""
        d = self.tops(idx, dump) if tops is None else tops
        return M.chain_counts(self.ids[idx], self.lens[idx], self.t1[idx], d)

    @torch.no_grad()
    def walk_counts(self, idx: torch.Tensor, tops: torch.Tensor | None = None) -> torch.Tensor:
        """Hold counts on windows idx over the rounds a decode walks from each prompt's end
        for `span` new tokens (measures.walk_counts): what speculative decoding accepts."""
        d = self.tops(idx) if tops is None else tops
        return M.walk_counts(self.ids[idx], self.lens[idx], self.t1[idx], d, self.start[idx], self.span)

    @torch.no_grad()
    def measure(self, idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Counts [chain, 2] on windows idx (default: the held-out ones) from one pass of the
        draft: "walk" the decode's rounds (the headline), "data" / "chat" the same over the
        windows of each prompt kind, "every_row" a chain from every row of every window."""
        idx = self.held.nonzero().flatten() if idx is None else idx
        zero = torch.zeros(self.chain, 2, dtype=torch.int64)
        if len(idx) == 0:
            return {"walk": zero, "data": zero, "chat": zero, "every_row": zero}
        d = self.tops(idx)
        chat = self.chat[idx]
        out = {"walk": self.walk_counts(idx, d), "every_row": self.chain_counts(idx, tops=d)}
        for kind, sel in (("data", ~chat), ("chat", chat)):
            out[kind] = self.walk_counts(idx[sel], d[:, sel]) if bool(sel.any()) else zero
        return out

    @torch.no_grad()
    def _layout_top1(self, idx: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        outs = [self._top1(self.draft(x, self.ids[b], 1))[0][..., 0] for b, x in self.spliced(idx, off)]
        return torch.cat(outs)  # [n, T]

    @torch.no_grad()
    def round_counts(self, idx: torch.Tensor) -> torch.Tensor:
        """Seed `round_pass`: chains laid out as rounds, two offsets a window."""
        total = torch.zeros(self.chain, 2, dtype=torch.int64)
        for o in sorted({0, self.stride // 2}):
            off = torch.full((len(idx),), o, dtype=torch.int64)
            d = self._layout_top1(idx, off)
            total += M.round_counts(self.ids[idx], self.lens[idx], self.t1[idx], d, off, self.stride, self.chain)
        return total

    @torch.no_grad()
    def order_counts(self, idx: torch.Tensor) -> torch.Tensor:
        """Seed `order_pass`: the walk where each round starts after what the one before kept."""
        tops = torch.stack([self._layout_top1(idx, torch.full((len(idx),), o, dtype=torch.int64)) for o in range(self.stride)])
        return M.order_counts(self.ids[idx], self.lens[idx], self.t1[idx], tops, self.stride, self.chain)

    def hold(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The hold counts a checkpoint is chosen by, on held-out windows (or idx): the rounds a
        decode walks from each prompt's end (stride 0), or the layout trained (stride > 0)."""
        idx = self.held.nonzero().flatten() if idx is None else idx
        if len(idx) == 0:
            return torch.zeros(self.chain, 2, dtype=torch.int64)
        return self.round_counts(idx) if self.stride > 0 else self.walk_counts(idx)

    def per_set(self, fn) -> dict[str, torch.Tensor]:
        """fn(held-out windows of a set) per data set."""
        out = {}
        for i, name in enumerate(self.names):
            a, b = int(self.bounds[i]), int(self.bounds[i + 1])
            idx = torch.arange(a, b)[self.held[a:b]]
            if len(idx):
                out[name] = fn(idx)
        return out


def trained_params(model, train_input: bool) -> list[tuple[str, torch.nn.Parameter]]:
    """The draft's trained weights: its layer and norm (and its input side when asked)."""
    mtp = model.mtp
    keep = ["layers.", "norm."] + (["eh_proj.", "enorm.", "hnorm."] if train_input else [])
    return [(n, p) for n, p in mtp.named_parameters() if any(n.startswith(k) for k in keep)]


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.mtp.named_parameters()}


def restore(model, snap: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.mtp.named_parameters():
            p.copy_(snap[n])


def _held_out(ch: Chain, val: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """(the counts a checkpoint is chosen by, drafts a round per prompt kind present) on windows val."""
    if ch.stride > 0:
        return ch.hold(val), {}
    m = ch.measure(val)
    return m["walk"], {k: M.drafts_per_round(m[k]) for k in ("data", "chat") if int(m[k][0, 0]) > 0}


def share_loss(ch: Chain, b: torch.Tensor, kind: int, hard: float):
    """A step's loss on this rank's share of batch `b` (cortiq.dist): its rows'
    summed KL over the whole batch's row count, so the ranks' gradients add up
    to one process's. One process: `ch.loss` as is. -> (loss, rows of the batch)"""
    if not dist.active():
        return ch.loss(b, kind, hard)
    share = dist.shard(len(b))
    x, ti, tp = ch.rows(b[share.start : share.stop], kind, hard)
    n = dist.sum_(float(x.shape[0]))
    return topk_kl(x, ch.model.head_weight, ti, tp, ch.chunk) / max(n, 1.0), n


def sum_grads(params) -> None:
    """Add up the trained weights' gradients over ranks: one all-reduce of one
    flat buffer. (Not DDP: a chain step runs the block once per chain step and
    from rows made without a graph, outside the one-forward-one-backward
    pattern DDP's hooks follow; the sum after backward is all it would do.)"""
    if not dist.active():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params]
    flat = dist.sum_(torch.cat([g.reshape(-1) for g in grads]))
    off = 0
    for (_, p), g in zip(params, grads):
        p.grad = flat[off : off + g.numel()].view_as(p)
        off += g.numel()


class DraftRun:
    """One draft training (`train`): its setup and its named parts, which `train`'s loop calls."""

    def __init__(self, ch: Chain, s, logger, say):
        import sys

        from tqdm import tqdm

        self.ch, self.s, self.model = ch, s, ch.model
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.params = trained_params(self.model, s.train_input)
        for _, p in self.params:
            p.requires_grad_(True)
        self.opt = adam([{"params": [p for _, p in self.params]}], s.lr, self.params[0][1].device)
        self.on_device = skips_on_device(self.opt)
        self.val = ch.held.nonzero().flatten()
        train_idx = (~ch.held).nonzero().flatten()
        if s.batch < dist.world():
            raise CortiqError(f"mtp heal: batch {s.batch} is smaller than the {dist.world()} ranks")
        nb = len(train_idx) // s.batch
        self.batches = [train_idx[i * s.batch : (i + 1) * s.batch] for i in range(nb)]
        self.jobs = [(b, k) for b in range(nb) for k in range(len(ch.kinds))]
        self.total = max(math.ceil(s.epochs * len(self.jobs)), 1)
        self.order = self.job_order(torch.Generator().manual_seed(s.seed))
        main = dist.is_main()  # rank 0 speaks for all
        self.logger = logger if main else None
        self.say = (say if main else None) or (lambda *a, **k: None)
        self.bar = tqdm(total=self.total, desc="mtp heal", unit="step", file=sys.stderr, dynamic_ncols=True,
                        disable=not main)
        self.write = self.bar.write if main else (lambda *a, **k: None)
        self.st = LoopState()
        self.write(f"mtp heal: {self.total} steps ({len(self.batches)} batches of {s.batch} windows x "
                   f"{len(ch.kinds)} chain kinds x {s.epochs:g} epochs); measuring the draft before training",
                   file=sys.stderr)
        ch.refresh(0)
        self.kl0 = ch.val_kl(self.val)
        h0, _ = _held_out(ch, self.val)
        self.best = Best(M.drafts_per_round(h0), 0, snapshot(self.model))
        self.best_kl = sum(self.kl0) / len(self.kl0)
        self.say(f"mtp heal: held-out KL per kind before training {', '.join(f'{x:.4f}' for x in self.kl0)}; "
                 f"drafts a round {self.best.value:.4f}")
        self.shown = "/".join(f"{x:.2f}" for x in M.rates(h0))  # the last held-out hold rates per chain step
        self.bar.set_postfix(hold=self.shown, dpr=f"{self.best.value:.3f}", refresh=False)
        self.t0 = time.perf_counter()  # the time limit counts training, not the measure before it

    def job_order(self, g: torch.Generator):
        """The (batch, chain kind) jobs, each pass over them in a new order drawn from `g`."""
        while self.jobs:
            for oi in torch.randperm(len(self.jobs), generator=g).tolist():
                yield self.jobs[oi]

    def set_rate(self, step: int) -> float:
        lr = self.s.lr * lr_shape(step, self.total, self.s.warm)
        for grp in self.opt.param_groups:
            grp["lr"] = lr
        return lr

    def step(self, job) -> tuple[Update, dict | None]:
        """Forward, backward and the update of one job; a non-finite one is skipped and counted.
        -> (the update, its history row; None when skipped)"""
        bi, kind = job
        st, s = self.st, self.s
        loss, _ = share_loss(self.ch, self.batches[bi], kind, s.hard)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        sum_grads(self.params)
        gn = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], s.clip)  # [] on the device
        done = st.done
        up = update(self.opt, dist.sum_(loss.detach().clone()), gn, lambda: self.set_rate(done + 1), self.on_device)
        if up.skipped:
            self.opt.zero_grad(set_to_none=True)
            try:
                st.skip("mtp heal", f"lower lr (now {s.lr:g}) or check the model for inf/nan weights")
            except CortiqError:
                self.bar.close()
                raise
            return up, None
        rec = st.counted(up, 0.0, kind=kind)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{up.loss:.4f}", hold=self.shown, dpr=f"{self.best.value:.3f}", refresh=False)
        ch = self.ch
        if ch.chain > 1 and s.refresh > 0 and st.done % s.refresh == 0 and st.done < self.total:
            ch.refresh(st.done // s.refresh)
        return up, rec

    def evaluate(self, rec: dict) -> None:
        """Held-out KL and hold rates now, into `rec`; the best draft by drafts a round kept."""
        import sys

        model, ch, st = self.model, self.ch, self.st
        model.eval()
        v = ch.val_kl(self.val)
        hh, kinds = _held_out(ch, self.val)
        dpr = M.drafts_per_round(hh)
        rr = M.rates(hh)
        rec.update({"heldout_kl": sum(v) / len(v), "drafts_per_round": dpr,
                    **{f"hold_{j + 1}": r for j, r in enumerate(rr)},
                    **{f"drafts_per_round_{k}": x for k, x in kinds.items()}})
        if self.best.offer(dpr, st.done, lambda: snapshot(model), higher=True):
            self.best_kl = sum(v) / len(v)
        self.shown = "/".join(f"{x:.2f}" for x in rr)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", hold=self.shown, dpr=f"{self.best.value:.3f}", refresh=True)
        split = "".join(f", {k} {x:.3f}" for k, x in kinds.items()) if len(kinds) > 1 else ""
        self.write(f"  step {st.done}: held-out hold {self.shown}, {dpr:.3f} drafts a round{split} "
                   f"(best {self.best.value:.3f} at step {self.best.step})", file=sys.stderr)
        model.train()

    def out_of_time(self) -> bool:
        return self.s.time_limit > 0 and time.perf_counter() - self.t0 >= self.s.time_limit

    def maybe_stop(self, out_of_time: bool) -> None:
        """No new best in `patience` evaluations, or the time limit reached (before the last step)."""
        st, s = self.st, self.s
        if st.done >= self.total:
            return
        if s.patience > 0 and st.done - self.best.step >= s.patience * s.eval_every:
            self.say(f"mtp heal: no new best in {s.patience} evaluations: stopping at step {st.done} of {self.total}")
            st.stopped = st.done
        if out_of_time:
            self.say(f"mtp heal: time limit of {s.time_limit:g} s reached: stopping at step {st.done} of {self.total}")
            st.stopped = st.done

    def log(self, rec: dict) -> None:
        if self.logger is not None:
            self.logger.log_metrics({k: v for k, v in rec.items() if k not in ("step", "kind")}, step=self.st.done)

    def report(self) -> dict:
        """The best draft back in the model, frozen, and the run's report."""
        seconds = time.perf_counter() - self.t0
        self.bar.close()
        model = self.model
        model.eval()
        restore(model, self.best.state)
        for p in model.parameters():
            p.requires_grad_(False)
        st = self.st
        return {"steps": st.done, "total_steps": self.total, "best_step": self.best.step, "history": st.history,
                "kl_start": sum(self.kl0) / len(self.kl0), "kl_best": self.best_kl, "best_dpr": self.best.value,
                "skipped": st.skipped, "seconds": seconds}


def train(ch: Chain, s, logger=None, say=print) -> dict:
    """Train the draft of `ch.model` by the settings `s` (MtpSettings, resolved); keep
    the checkpoint that keeps the most drafts a round on held-out windows, by the rounds a
    decode walks from each prompt's end (Chain.hold: what real decoding accepts).

    A step whose loss or gradient is not finite is skipped and counted (the shared
    update rule, cortiq.train_loop); at MAX_SKIPPED of them training stops with one
    line. A bar on stderr shows steps, ETA, the loss and the last held-out hold rates.
    -> {"steps", "best_step", "history", "kl_start", "kl_best", "best_dpr", "skipped", "seconds"}.

    Across ranks (cortiq.dist) each takes its share of every batch and the
    gradients are summed: the steps one process takes. The held-out measures
    run whole on every rank (so every rank keeps the same best weights); only
    rank 0 shows progress."""
    run = DraftRun(ch, s, logger, say)
    st = run.st
    run.model.train()
    while st.done < run.total and not st.stopped and run.jobs:
        up, rec = run.step(next(run.order))
        if up.skipped:
            continue
        late = run.out_of_time()
        if st.done % s.eval_every == 0 or st.done == run.total or late:
            run.evaluate(rec)
            run.maybe_stop(late)
        run.log(rec)
    return run.report()
