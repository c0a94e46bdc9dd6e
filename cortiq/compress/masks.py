"""S2, DTG-MA: learned neuron gates σ(m) on every MLP neuron.

The gate logits are the only trainable parameters (the weights are frozen).
The loss is the caller's (the task's LM loss, or a KL to a teacher) plus an
L1 pull l1/n_all·Σσ(m); at each evaluation below the target the pressure
grows l1 ← l1·grow + step (a linear rise stalls; ×1.5 reaches 25 % pruned in
a few hundred steps on the original tool's runs). Every evaluation scores the hard
mask (σ > τ) on held-out windows; the checkpoint kept is the best one at or
past the target, and the loop stops `settle` evaluations after first reaching
it. Failing the target, the most pruned checkpoint ranks the neurons.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..errors import CortiqError
from .memory import MaskPlan
from .settings import MaskSettings

MAX_NONFINITE = 20


@dataclass
class MaskResult:
    #: per layer, the gate logits of the selected checkpoint [I_l]
    logits: list[torch.Tensor]
    #: held-out loss of the open model (every gate 1) and of the selected hard mask
    nll_open: float
    nll_hard: float
    #: share of neurons the selected hard mask prunes
    pruned: float
    #: step of the selected checkpoint, steps run, non-finite steps skipped
    step: int
    steps: int
    skipped: int
    reached: bool
    history: list[dict] = field(default_factory=list)

    def report(self) -> dict:
        return {
            "metrics": {"mask_nll_open": self.nll_open, "mask_nll_hard": self.nll_hard, "mask_pruned": self.pruned,
                        "mask_step": float(self.step), "mask_steps": float(self.steps), "mask_skipped": float(self.skipped)},
            "reached_target": self.reached,
            "history": self.history,
        }


def _set_hard(params: Sequence[nn.Parameter], tau: float) -> int:
    """Gates to exactly 0/1 (logits ±inf: σ is then exact); returns the count kept
    (counted on the gates' device: one host sync, not one per layer)."""
    with torch.no_grad():
        alive = torch.zeros((), dtype=torch.long, device=params[0].device)
        for p in params:
            on = torch.sigmoid(p) > tau
            alive += on.sum()
            p.copy_(torch.where(on, float("inf"), -float("inf")))
    return int(alive)


def l1_pull(params: Sequence[torch.Tensor], l1, n_all: int) -> torch.Tensor:
    """The L1 pull l1/n_all·Σσ(m) (its gradient per neuron l1/n_all·σ'(m)): one
    sum over every layer's logits, one kernel rather than one per layer; `l1`
    a float or a 0-d tensor (a CUDA graph's input)."""
    return torch.sigmoid(torch.cat([p.reshape(-1) for p in params])).sum() * (l1 / n_all)


@dataclass
class _MaskLoop:
    """The mask loop's state: the L1 pressure, the steps run and skipped, and the checkpoints
    kept, each (held-out loss of its hard mask, its logits, the share it prunes, its step)."""

    s: MaskSettings
    #: the share of neurons to prune
    target: float
    #: neurons in all
    n_all: int
    l1: float
    #: the most pruned checkpoint so far: what ranks the neurons when the target is not reached
    most: tuple
    #: the best checkpoint at or past the target
    best: tuple | None = None
    first_at_target: int | None = None
    done: int = 0
    skipped: int = 0
    in_a_row: int = 0
    history: list[dict] = field(default_factory=list)

    def skip(self) -> None:
        """A non-finite step, left out; too many in a row end the run."""
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_NONFINITE:
            raise CortiqError(f"DTG-MA: {MAX_NONFINITE} non-finite steps in a row")

    def settled(self) -> bool:
        """`settle` evaluations have passed since the target was first reached."""
        return self.first_at_target is not None and self.done >= self.first_at_target + self.s.settle * self.s.eval_every

    def keep(self, e: float, saved: list[torch.Tensor], pruned: float) -> None:
        """An evaluation's checkpoint: the pressure rises short of the target, and the
        checkpoint is kept where it is the most pruned or the best at the target."""
        if pruned < self.target:
            self.l1 = self.l1 * self.s.l1_grow + self.s.l1_step
        # ties go to the later checkpoint: short of any pruning, the most
        # trained logits still rank the neurons (the first ones do not)
        if pruned >= self.most[2]:
            self.most = (e, saved, pruned, self.done)
        if pruned >= self.target:
            if self.first_at_target is None:
                self.first_at_target = self.done
            if self.best is None or e < self.best[0]:
                self.best = (e, saved, pruned, self.done)

    def result(self, nll_open: float, dev) -> MaskResult:
        nll_hard, logits, pruned, step = self.best if self.best is not None else self.most
        return MaskResult([t.to(dev) for t in logits], nll_open, nll_hard, pruned, step, self.done, self.skipped,
                          self.best is not None, self.history)


def _open_loss(params: Sequence[nn.Parameter], val: Callable[[], float], mask_init: float) -> float:
    """The held-out loss of the open model (every gate exactly 1); the logits are then set to mask_init."""
    with torch.no_grad():
        for p in params:
            p.fill_(1e4)
    nll_open = float(val())
    with torch.no_grad():
        for p in params:
            p.fill_(mask_init)
    return nll_open


def _plain_step(opt, params: Sequence[nn.Parameter], step_loss: Callable[[int], torch.Tensor], n_all: int):
    """The eager step(b, l1): batch b's loss plus the L1 pull, backward; the task loss returned."""

    def step(b: int, l1: float) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        task = step_loss(b)
        (task + l1_pull(params, l1, n_all)).backward()
        return task.detach()

    return step


def _finite_loss(task: torch.Tensor, params: Sequence[nn.Parameter]) -> float | None:
    """The step's loss, or None when it or any gradient is not finite (one host sync a step)."""
    if any(p.grad is None for p in params):
        return None
    t = task.float().reshape(1)
    ok = torch.isfinite(torch.cat([t] + [p.grad.reshape(-1).float() for p in params])).all()
    loss, ok = torch.cat([t, ok.float().reshape(1)]).tolist()
    return loss if ok == 1.0 else None


def _evaluate(st: _MaskLoop, params: Sequence[nn.Parameter], val: Callable[[], float], loss: float) -> dict:
    """Score the hard mask (σ > τ) on the held-out windows, put the logits back, and offer the
    checkpoint to the loop. -> the history row."""
    saved = [p.detach().clone() for p in params]
    alive = _set_hard(params, st.s.tau)
    with torch.no_grad():
        e = float(val())
        for p, v in zip(params, saved):
            p.copy_(v)
    pruned = 1.0 - alive / st.n_all
    st.keep(e, saved, pruned)
    row = {"step": st.done, "loss": loss, "val_hard": e, "pruned": pruned, "l1": st.l1}
    st.history.append(row)
    return row


def train_masks(
    params: Sequence[nn.Parameter],
    n_train_batches: int,
    step_loss: Callable[[int], torch.Tensor],
    val: Callable[[], float],
    settings: MaskSettings,
    on_eval: Callable[[dict], None] | None = None,
    progress: Callable[[int, dict], None] | None = None,
    step: Callable[[int, float], torch.Tensor] | None = None,
) -> MaskResult:
    """The mask loop on gate logits `params` (one per layer, set to mask_init
    here): `step_loss(b)` is the caller's loss on train batch b (a scalar with
    a graph down to the logits), `val()` the held-out loss under the current
    gates (no grad). `step(b, l1)`, when given, replaces the plain step built
    from `step_loss`: it runs batch b's loss plus the L1 pull at pressure l1
    forward and backward, leaves this step's gradients (not accumulated) in
    the logits' .grad, and returns the detached task loss (a replayed CUDA
    graph does this; see learn_model_masks)."""
    if n_train_batches < 1:
        raise CortiqError("DTG-MA: no train batches")
    s = settings
    dev = params[0].device
    n_all = sum(p.numel() for p in params)
    nll_open = _open_loss(params, val, s.mask_init)
    # fused on CUDA: one kernel for every layer's logits instead of a launch train per tensor
    opt = torch.optim.Adam(params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, fused=dev.type == "cuda")
    step = step or _plain_step(opt, params, step_loss, n_all)
    st = _MaskLoop(s, min(max(1.0 - s.keep_frac, 0.0), 0.95), n_all, s.l1_init,
                   most=(nll_open, [p.detach().clone() for p in params], 0.0, 0))
    gen = torch.Generator().manual_seed(s.seed)
    while not st.settled() and st.done < s.max_steps:
        for b in torch.randperm(n_train_batches, generator=gen).tolist():
            if st.done >= s.max_steps or st.settled():
                break
            loss = _finite_loss(step(b, st.l1), params)
            if loss is None:
                st.skip()
                continue
            st.in_a_row = 0
            opt.step()
            st.done += 1
            if progress:
                progress(st.done, {"loss": loss, "l1": st.l1})
            if st.done % s.eval_every == 0:
                row = _evaluate(st, params, val, loss)
                if on_eval:
                    on_eval(row)
    return st.result(nll_open, dev)


# ── on a model ────────────────────────────────────────────────────────────


def weighted_ce(model, ids: torch.Tensor, nxt: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·NLL, Σ w) of the next tokens: ids/nxt [B, T] int64, weight [B, T]."""
    logits = model(ids)  # [B, T, V]
    nll = nn.functional.cross_entropy(logits.float().flatten(0, 1), nxt.flatten(), reduction="none")  # [B·T]
    w = weight.flatten().to(nll.dtype)
    return (nll * w).sum(), w.sum()


def open_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits [B, T, V] of `model` with its neuron gates taken out: the source the gated
    model is pruned from (no grad)."""
    mlps = [layer.mlp for layer in model.layers]
    gates = [m.neuron_logits for m in mlps]
    try:
        for m in mlps:
            m.neuron_logits = None
        with torch.no_grad():
            return model(ids)
    finally:
        for m, g in zip(mlps, gates):
            m.neuron_logits = g


def weighted_kl(model, ids: torch.Tensor, nxt: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·KL(source ‖ gated), Σ w) over the next-token distributions: the gated model scored
    against the same model with its gates taken out, so that neurons count by what they change
    in every confident prediction, not only in the data's own next token (`nxt` is unused).
    ids [B, T] int64, weight [B, T]."""
    t = torch.log_softmax(open_logits(model, ids).float(), -1).flatten(0, 1)  # [B·T, V]
    s = torch.log_softmax(model(ids).float(), -1).flatten(0, 1)  # [B·T, V]
    kl = (t.exp() * (t - s)).sum(-1)  # [B·T]
    w = weight.flatten().to(kl.dtype)
    return (kl * w).sum(), w.sum()


#: the mask loss of each MaskSettings.objective
OBJECTIVES = {"data": weighted_ce, "teacher": weighted_kl}


class _Graphed:
    """The mask step (forward, loss, L1 pull, backward) and the held-out pass,
    each captured once as a CUDA graph and replayed: the step is a few
    thousand small kernels whose launches, not their arithmetic, bound it
    eagerly (bench/RESULTS.md, "The DTG-MA mask step, eager against CUDA graphs").

    Inputs are static device buffers the caller's batches are copied into,
    the pressure l1 a 0-d tensor; the gradients live in the graph's pool
    (captured from .grad = None, so each replay writes them afresh). The
    logits are read in place, so the loop's in-place edits (hard gates for an
    evaluation, restored after) are seen by the next replay. Autocast's weight
    cache is off: a graph may not keep a cast made at capture time."""

    def __init__(self, model, params, n_all, compute, train, batch, window, val_batches, loss=weighted_ce):
        dev = params[0].device
        self.model, self.params, self.n_all, self.compute, self.loss = model, params, n_all, compute, loss
        self.train, self.batch = train, batch
        self.ids = torch.zeros(batch, window, dtype=torch.long, device=dev)
        self.nxt = torch.zeros_like(self.ids)
        self.weight = torch.zeros(batch, window, dtype=torch.float32, device=dev)
        self.l1 = torch.zeros((), dtype=torch.float32, device=dev)
        self.val_batches = val_batches
        self.step_graph = self.val_graph = None

    def _autocast(self):
        return torch.autocast("cuda", dtype=self.compute, enabled=self.compute != torch.float32, cache_enabled=False)

    def _step_body(self):
        with self._autocast():
            tot, w = self.loss(self.model, self.ids, self.nxt, self.weight)
        task = tot / w.clamp_min(1e-9)
        (task + l1_pull(self.params, self.l1, self.n_all)).backward()
        return task.detach()

    def _val_body(self):
        with torch.no_grad(), self._autocast():
            tot = torch.zeros((), dtype=torch.float64, device=self.l1.device)
            cnt = torch.zeros((), dtype=torch.float64, device=self.l1.device)
            for ids, nxt, weight in self.val_batches:
                t, w = self.loss(self.model, ids, nxt, weight)
                tot += t.double()
                cnt += w.double()
            return tot / cnt.clamp_min(1e-9)

    def _capture(self, body, fresh_grads: bool):
        # warm-up on a side stream first (lazy inits, cuBLAS workspaces), as graph capture asks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                if fresh_grads:
                    for p in self.params:
                        p.grad = None
                body()
        torch.cuda.current_stream().wait_stream(side)
        if fresh_grads:
            for p in self.params:
                p.grad = None
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = body()
        return g, out

    def step(self, b: int, l1: float) -> torch.Tensor:
        bt = self.train.batch(b, self.batch)
        self.ids.copy_(torch.from_numpy(bt.ids))
        self.nxt.copy_(torch.from_numpy(bt.next))
        self.weight.copy_(torch.from_numpy(bt.weight))
        self.l1.fill_(l1)
        if self.step_graph is None:
            self.step_graph, self.step_out = self._capture(self._step_body, fresh_grads=True)
        self.step_graph.replay()
        return self.step_out

    def val(self) -> float:
        if self.val_graph is None:
            self.val_graph, self.val_out = self._capture(self._val_body, fresh_grads=False)
        self.val_graph.replay()
        return float(self.val_out)


def _micro_step(params: Sequence[nn.Parameter], batch_loss: Callable, train, batch: int, micro: int, n_all: int):
    """The step(b, l1) of a batch in micro-batches of `micro` windows: each part's summed loss
    over the whole batch's weight, backward part by part (the gradients add up to the one
    batch's), then the L1 pull's; the task loss returned."""

    def step(b: int, l1: float) -> torch.Tensor:
        for p in params:
            p.grad = None
        bt = train.batch(b, batch)
        den = max(float(bt.weight.sum(dtype=np.float64)), 1e-9)
        task = None
        for a in range(0, bt.ids.shape[0], micro):  # micro-batches, a handful
            part = batch_loss(bt.ids[a : a + micro], bt.next[a : a + micro], bt.weight[a : a + micro]) / den
            part.backward()
            task = part.detach() if task is None else task + part.detach()
        l1_pull(params, l1, n_all).backward()
        return task

    return step


def learn_model_masks(model, train, val, settings: MaskSettings, on_eval=None, progress=None,
                      compute: torch.dtype = torch.float32, graph: bool = False,
                      plan: MaskPlan | None = None) -> MaskResult:
    """DTG-MA on `model` (a cortiq CausalLM, on the device it should run on)
    with the loss of `settings.objective` (OBJECTIVES): `train`, `val` are cortiq.data.Windows. The
    weights stay as loaded (frozen); the forward runs under autocast to
    `compute` when that is not f32 (bf16 on CUDA: the gates' gradients are
    f32, cross-entropy is taken on f32 logits). With `graph` on CUDA the step
    and the held-out pass replay CUDA graphs (what `cortiq compress` does on a
    GPU: several times faster a step, bench/RESULTS.md, "The DTG-MA mask step,
    eager against CUDA graphs"; the plain eager step is the reference
    they are tested against, and the CPU's path). `plan` (cortiq.compress.memory)
    recomputes the lowest layers in the backward and runs micro-batches, for a step
    that does not fit the device otherwise: the same gradients, run eagerly (graphs
    pay where kernel launches bound a small model's step; a model that needs the
    savings is bound by its arithmetic). The gates are removed again at the end."""
    s = settings
    if len(train) == 0 or len(val) == 0:
        raise CortiqError(f"DTG-MA: {len(train)} train / {len(val)} val windows of {s.window} tokens")
    dev = next(model.parameters()).device
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_neuron_gates(True, init=s.mask_init)
    params = [layer.mlp.neuron_logits for layer in model.layers]
    loss = OBJECTIVES[s.objective]
    n_val_b = val.n_batches(s.batch)
    if s.val_windows:
        n_val_b = min(n_val_b, max(1, s.val_windows // s.batch))

    def autocast():
        return torch.autocast(dev.type, dtype=compute, enabled=compute != torch.float32)

    def to(x):
        return torch.from_numpy(x).to(dev, non_blocking=True)

    def step_loss(b):
        bt = train.batch(b, s.batch)
        with autocast():
            tot, w = loss(model, to(bt.ids), to(bt.next), to(bt.weight))
        return tot / w.clamp_min(1e-9)

    def summed(ids, nxt, weight):
        with autocast():
            return loss(model, to(ids), to(nxt), to(weight))[0]

    # the few held-out batches every evaluation scores live on the device for the whole run
    val_batches = [tuple(to(x) for x in val.batch(b, s.batch)) for b in range(n_val_b)]

    def val_loss():
        # summed on the device, read once: no host sync per batch
        with torch.no_grad(), autocast():
            tot = torch.zeros((), dtype=torch.float64, device=dev)
            cnt = torch.zeros((), dtype=torch.float64, device=dev)
            for ids, nxt, weight in val_batches:
                t, w = loss(model, ids, nxt, weight)
                tot += t.double()
                cnt += w.double()
            return float(tot / cnt.clamp_min(1e-9))

    plan = plan or MaskPlan()
    step = None
    n_all = sum(p.numel() for p in params)
    if plan.micro:
        step = _micro_step(params, summed, train, s.batch, plan.micro, n_all)
    elif graph and dev.type == "cuda" and plan.plain:
        g = _Graphed(model, params, n_all, compute, train, s.batch, s.window, val_batches, loss)
        step, val_loss = g.step, g.val
    for i, layer in enumerate(model.layers):
        layer.recompute = i < plan.checkpoint  # the lowest: see cortiq.heal.train.StudentTail.checkpointed
    try:
        return train_masks(params, train.n_batches(s.batch), step_loss, val_loss, s, on_eval, progress, step)
    finally:
        for layer in model.layers:
            layer.recompute = False
        for p in params:
            p.grad = None
        model.set_neuron_gates(False)
