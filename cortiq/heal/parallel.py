"""Heal training across ranks: how the trained tail runs when more than one
process takes part (cortiq.dist), kept apart from the training loop, which
calls the few hooks of `Sharding` and is otherwise the same for one process.

- Data: every rank takes its contiguous share of each global batch (the batch
  of `batch` windows one process would run), and each share's loss is divided
  by the whole batch's row weight, so the ranks' summed gradients are the one
  process's gradient and the loss curve is the same.
- "ddp": torch's DistributedDataParallel over the trained layers (each rank
  holds them whole; the gradients are averaged, hence the loss is scaled by
  the number of ranks). For a smaller tail that fits one device.
- "fsdp": FSDP2 (`fully_shard`) on units of trained layers and on the tail:
  the weights, gradients and Adam state are split across ranks (bf16
  parameters in compute, f32 residual stream and gradient reduction); for a
  tail of 1B weights and more, or one too big for one device (`choose_sharding`).
- Checkpoints: `torch.distributed.checkpoint` (one directory, each rank writing
  its shard of each tensor), resharded on load, so a run killed on N ranks
  resumes on M (one included); a single process writes and reads the plain
  `checkpoint.pt` as before, and reads a distributed run's directory too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from .. import dist
from . import memory as mem
from ..errors import CortiqError
from .settings import SHARDS

#: a one-process run's checkpoint (tensors and plain values, torch.save)
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_DIR = "checkpoint.dcp"
#: the sets of trained weights a checkpoint holds beside the weights as they are, by the loop's key for
#: each (a table by name) and its prefix in a distributed checkpoint: the best so far, and the moving
#: average where the run keeps one (HealSettings.average)
WEIGHT_SETS = {"best_state": "b", "average_state": "a"}
#: share of one device's memory the whole-tail (ddp) sharding may fill with weights, gradients and Adam state
DDP_SHARE = 0.5
#: trained weights from which `shard: auto` picks FSDP2 over DDP where both fit. One rank wrapped each
#: way (bench/RESULTS.md, "The sharded step's CPU cost": 16 windows of 512 a step, where the step of two
#: GPUs is CPU-bound): at the Qwen3-1.7B geometry (1.4B trained) FSDP2 cost less than DDP, and on two GPUs
#: it was the faster in less memory; at Qwen3-0.6B (0.44B) FSDP2's per-unit hooks weigh more against the
#: smaller layers and DDP cost less
FSDP_FROM = 1_000_000_000
#: share of one device's memory under which FSDP2 keeps each layer's gathered bf16 weights from its
#: forward to its backward (one all-gather a step instead of two; the whole tail's compute weights stay)
KEEP_GATHERED_SHARE = 0.1
#: decoder layers per FSDP2 unit (one all-gather, one reduce-scatter, one set of hooks) when the gathered
#: weights are kept. FSDP2's hooks cost about as much CPU a unit as a 1.7B layer's forward at 8192 tokens
#: takes on the GPU, so units of one layer leave the GPU waiting on the CPU: a one-rank FSDP2 heal of the
#: Qwen3-1.7B geometry left it idle less than half as long a step with units of four as with units of one
#: (bench/RESULTS.md, "Where the two-GPU step goes" and "The sharded step's CPU cost")
UNIT_LAYERS = 4


def is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a sharded one gathered from every rank: a collective)."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a sharded one's local shard (a view: writing it writes the
    parameter), else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


@torch.no_grad()
def put(dst: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a whole tensor into `dst`, which may be this rank's shard of it."""
    if is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        part = dst.to_local()
        dst.copy_(distribute_tensor(whole.to(part.device, part.dtype), dst.device_mesh, dst.placements))
    else:
        dst.copy_(whole)


class _Trained(torch.nn.Module):
    """The trained tail as one module (the layers from `train_from` up and the
    final norm), which DDP or fully_shard wrap; its forward is the tail's own."""

    def __init__(self, tail):
        super().__init__()
        self.layers = torch.nn.ModuleList(tail.model.layers[tail.train_from:])
        self.norm = tail.model.model.norm
        object.__setattr__(self, "_tail", tail)  # not a submodule: the model stays the tail's

    def forward(self, h0):
        return self._tail.run_tail(h0)


def device_bytes(device) -> int:
    """The memory of a CUDA device, or this machine's on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_sharding(kind: str, tail, device, genesis: bool = False) -> str:
    """"single" for one process; else "ddp" or "fsdp" as asked; "auto": fsdp on
    CUDA when the trained weights number at least FSDP_FROM, or when with their
    gradients and Adam state (16 bytes each) and the rest of the model (4 bytes a
    weight) they take more than DDP_SHARE of a device; else ddp (and ddp for
    Genesis, which FSDP2 does not follow)."""
    if kind not in SHARDS:
        raise CortiqError(f"heal settings: shard {kind!r} is not one of {', '.join(SHARDS)}")
    if not dist.active():
        return "single"
    if kind != "auto":
        return kind
    if torch.device(device).type != "cuda" or genesis:
        return "ddp"
    trained = sum(p.numel() for _, p in tail.named())
    total = sum(p.numel() for p in tail.model.parameters())
    need = 16 * trained + 4 * (total - trained)
    return "fsdp" if trained >= FSDP_FROM or need > DDP_SHARE * device_bytes(device) else "ddp"


class Sharding:
    """How `fit` runs the tail on this process, one subclass a kind (SHARDINGS): `Single` for
    one process, `Ddp` and `Fsdp` across ranks. `fit` calls these hooks and is otherwise the
    same for every kind. Each kind gives `local`, `sum_`, `snapshot`, `restore`, `save` and, for
    reading a one-process checkpoint, `_adopt` and `_weights_to_load`; `wrap`, `nosync` and
    `following` do nothing where a kind does not say otherwise."""

    kind = ""

    def __init__(self, tail, device, cdt, genesis: bool = False):
        self.tail, self.device, self.cdt = tail, torch.device(device), cdt
        self.genesis = genesis
        self.world = dist.world()
        #: gradients are averaged over ranks: a share's loss counts `world` times
        self.grad_scale = 1.0
        self.module = None

    # ── wrapping ──
    def wrap(self) -> "Sharding":
        return self

    def nosync(self):
        """A context for the backward passes of a step's micro-batches but the last."""
        return contextlib.nullcontext()

    def following(self) -> None:
        """After Genesis changed which layers train."""

    def written(self) -> None:
        """After the trained weights were written other than by the optimizer (the heal's average
        swapped in for an evaluation, or back out)."""

    def _requires(self) -> tuple:
        return tuple(p.requires_grad for _, p in self.tail.named())

    # ── data ──
    def clip(self, params, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm` in place; their whole norm before, a [] tensor
        on the device (read by the caller: no host wait here)."""
        gn = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
        return full(gn)

    # ── checkpoints ──
    def _tensors(self, opt, sets: dict[str, dict]) -> dict:
        """Every tensor of a distributed checkpoint by name (shards stay shards); `sets`: the loop's
        tables of weights by their WEIGHT_SETS key."""
        out = {"rng": torch.get_rng_state()}
        state = adam_state(opt, self.tail.named())
        for n, p in self.tail.named():
            out[f"w/{n}"] = p.detach()
            out[f"m/{n}"], out[f"v/{n}"], out[f"t/{n}"] = state[n]
            for key, table in sets.items():
                out[f"{WEIGHT_SETS[key]}/{n}"] = table[n]
        return out

    def drop_checkpoint(self, work_dir: Path) -> None:
        """Remove the last checkpoint, of either kind: before the next is written where the disk holds
        only one (cortiq.heal.disk)."""
        if dist.is_main():
            (work_dir / CHECKPOINT).unlink(missing_ok=True)
            shutil.rmtree(work_dir / CHECKPOINT_DIR, ignore_errors=True)
        dist.barrier()

    def resume(self, work_dir: Path, key: str, opt) -> dict | None:
        """The loop's state of the checkpoint under `work_dir` when it was made
        with `key` (its weights, Adam state and RNG loaded in place), else None.
        Either kind of checkpoint is read by either kind of run."""
        d, pt = work_dir / CHECKPOINT_DIR, work_dir / CHECKPOINT
        if (d / "loop.json").is_file():
            return self._resume_dcp(d, key, opt)
        ck = load_checkpoint(pt) if dist.agree(pt.exists()) else None
        if ck is None or ck.get("key") != key:
            return None
        self.tail.load(ck["trained"])
        kind = ck.get("optim_kind", "adam")
        if kind != mem.optimizer_kind(opt):
            # the memory plan changed the moments' kind: they start afresh, the rest resumes
            if dist.is_main():
                print(f"cortiq: {pt}: the checkpoint's {kind} moments do not fit this run's "
                      f"{mem.optimizer_kind(opt)} optimizer; its moments restart", file=sys.stderr)
        else:
            self._adopt(ck, opt)
        torch.set_rng_state(ck["rng"])
        return ck

    def _resume_dcp(self, d: Path, key: str, opt) -> dict | None:
        import torch.distributed.checkpoint as dcp

        try:
            plain = json.loads((d / "loop.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CortiqError(f"{d / 'loop.json'}: a damaged checkpoint ({e}); delete {d} to start over") from None
        if plain.get("key") != key:
            return None
        sets = {key: self._weights_to_load() for key in plain.get("sets", ["best_state"])}
        tensors = self._tensors(opt, sets)
        dcp.load(tensors, checkpoint_id=str(d))  # in place: weights, Adam state, best so far, average (resharded)
        torch.set_rng_state(tensors["rng"])
        return {**plain, **sets}


class Single(Sharding):
    """One process: the tail as it is, checkpoints in the plain `checkpoint.pt`."""

    kind = "single"

    def local(self, split):
        """Every batch of `split` whole."""
        return split

    def sum_(self, x):
        return x

    def snapshot(self) -> dict:
        """The trained weights as they are now (CPU copies)."""
        return self.tail.state()

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        self.tail.load(snap)

    def save(self, work_dir: Path, plain: dict, opt) -> None:
        """A resumable checkpoint: trained weights, Adam state, RNG and the loop's
        `plain` state (key, data order, history, best so far)."""
        save_checkpoint(work_dir / CHECKPOINT, {**plain, "trained": self.tail.state(), "optim": mem.optim_state(opt),
                                                "optim_kind": mem.optimizer_kind(opt), "rng": torch.get_rng_state()})
        shutil.rmtree(work_dir / CHECKPOINT_DIR, ignore_errors=True)

    def _adopt(self, ck: dict, opt) -> None:
        """A one-process checkpoint's Adam state into `opt`."""
        mem.load_optim_state(opt, ck["optim"])

    def _weights_to_load(self) -> dict:
        """Tensors a distributed checkpoint's set of weights (the best, the average) loads into (whole, on the CPU)."""
        return {n: torch.zeros_like(full(p), device="cpu") for n, p in self.tail.named()}


class _Ranks(Sharding):
    """What DDP and FSDP2 share: every rank takes its share of each batch, sums across
    ranks, keeps its shard's best weights in place and writes a distributed checkpoint."""

    def __init__(self, tail, device, cdt, genesis: bool = False):
        super().__init__(tail, device, cdt, genesis)
        self.grad_scale = float(self.world)

    def wrap(self) -> "Sharding":
        if self.tail.num_layers - self.tail.train_from < 1:
            raise CortiqError("heal: nothing to train across ranks")
        self._wrap()
        return self

    def _wrap(self) -> None:
        raise NotImplementedError

    def local(self, split):
        """This rank's share of every batch of `split` (the whole batch kept as `group`)."""
        share = dist.shard(split.index.shape[1])
        if len(share) == 0:
            raise CortiqError(f"heal: batch {split.index.shape[1]} is smaller than the {self.world} ranks")
        return dataclasses.replace(split, index=split.index[:, share.start:share.stop], group=split.index)

    def sum_(self, x):
        return dist.sum_(x)

    def snapshot(self) -> dict:
        """The trained weights as they are now (copies of each shard in place)."""
        return {n: p.detach().clone() for n, p in self.tail.named()}

    @torch.no_grad()
    def restore(self, snap: dict) -> None:
        for n, p in self.tail.named():
            p.copy_(snap[n])

    def save(self, work_dir: Path, plain: dict, opt) -> None:
        import torch.distributed.checkpoint as dcp

        d, part = work_dir / CHECKPOINT_DIR, work_dir / (CHECKPOINT_DIR + ".partial")
        if dist.is_main():
            shutil.rmtree(part, ignore_errors=True)
        dist.barrier()
        sets = {k: v for k, v in plain.items() if k in WEIGHT_SETS}
        dcp.save(self._tensors(opt, sets), checkpoint_id=str(part))
        if dist.is_main():
            rest = {k: v for k, v in plain.items() if k not in WEIGHT_SETS}
            (part / "loop.json").write_text(json.dumps({**rest, "world": self.world, "sets": list(sets)}))
            shutil.rmtree(d, ignore_errors=True)
            os.replace(part, d)
            (work_dir / CHECKPOINT).unlink(missing_ok=True)
        dist.barrier()

    def _adopt(self, ck: dict, opt) -> None:
        """A single process's checkpoint spread over these ranks: by parameter order."""
        sd = ck["optim"]
        order = [i for g in sd["param_groups"] for i in g["params"]]
        state = adam_state(opt, self.tail.named())
        for (n, _), i in zip(self.tail.named(), order):
            m, v, t = state[n]
            s = sd["state"].get(i)
            if s is not None:
                put(m, s["exp_avg"])
                put(v, s["exp_avg_sq"])
                t.copy_(s["step"])
        # in WEIGHT_SETS' order on every rank: each spread is a collective (a set's order is the
        # process's string hashes', which differ between ranks)
        for key in (k for k in WEIGHT_SETS if k in ck):
            ck[key] = self._spread(ck[key])

    def _spread(self, whole: dict) -> dict:
        out = {}
        for n, p in self.tail.named():
            out[n] = p.detach().clone()
            put(out[n], whole[n])
        return out

    def _weights_to_load(self) -> dict:
        return self.snapshot()


class Ddp(_Ranks):
    """torch's DistributedDataParallel over the trained layers (each rank holds them whole)."""

    kind = "ddp"

    def __init__(self, tail, device, cdt, genesis: bool = False):
        super().__init__(tail, device, cdt, genesis)
        self.active: tuple | None = None

    def _wrap(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.active = self._requires()
        ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: the gradients live in DDP's reduction buckets
        # instead of beside them (one f32 copy of the trained weights less: 6.8 GB
        # at 1.7B) and need no copy back after the all-reduce
        self.module = DDP(_Trained(self.tail), device_ids=ids, gradient_as_bucket_view=True)
        self.tail.wrapped = self.module

    def nosync(self):
        """DDP adds the micro-batches' gradients up locally and reduces once, at the last one
        (the same sum, one all-reduce a step instead of one per micro-batch)."""
        return self.module.no_sync()

    def following(self) -> None:
        """DDP is rebuilt over the new set of trained layers."""
        if self._requires() != self.active:
            self._wrap()


class Fsdp(_Ranks):
    """FSDP2 (`fully_shard`) on units of trained layers and on the tail. It keeps reducing
    each micro-batch (no `nosync`): skipping it would hold every layer's unsharded gradient
    until the last one, the memory FSDP is there to save."""

    kind = "fsdp"

    def _wrap(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.genesis:
            raise CortiqError("heal: genesis changes which layers train each epoch, which fully sharded training "
                              "does not follow: use shard ddp (or one GPU)")
        mesh = dist.mesh(self.device.type)
        low = None if self.cdt == torch.float32 else self.cdt
        # the inputs stay as they come (f32): FSDP2's default casts each unit's input to the bf16 of its
        # weights, which would carry the residual stream between units in bf16, where one GPU's
        # autocast keeps it in f32
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False)
        root = _Trained(self.tail)
        reshard = not self.keep_gathered()
        per = UNIT_LAYERS if not reshard else 1
        units = []  # each unit's first layer (a unit's modules share its FSDP2 state)
        for a in range(0, len(root.layers), per):  # a loop over units of layers, a few dozen
            group = list(root.layers[a : a + per])
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
            units.append(group[0])
        fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        # each unit's all-gather issued from the CPU as soon as the unit before has its weights,
        # rather than when the CPU reaches the next unit's hook
        for unit, after in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([after])
        self.module = root
        self.tail.wrapped = root
        self.tail.collect()  # fully_shard put new (sharded) parameters in place of the old

    def written(self) -> None:
        """Each unit's gathered weights dropped: where they are kept from a forward to its backward, an
        evaluation's forward (no backward) leaves them gathered, and the next forward would run on them
        rather than on the shards just written."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():  # the units and the root, a few dozen
            if isinstance(m, FSDPModule):
                m.reshard()

    def keep_gathered(self) -> bool:
        """Whether the trained layers' weights in compute precision (2 bytes each
        in bf16, 4 in f32) take at most KEEP_GATHERED_SHARE of the device."""
        size = 2 if self.cdt in (torch.bfloat16, torch.float16) else 4
        need = size * sum(p.numel() for _, p in self.tail.named())
        return need <= KEEP_GATHERED_SHARE * device_bytes(self.device)


#: each kind of `choose_sharding` and the class that runs it
SHARDINGS: dict[str, type[Sharding]] = {"single": Single, "ddp": Ddp, "fsdp": Fsdp}


def adam_state(opt, named) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each trained parameter's Adam state (exp_avg, exp_avg_sq, step) by name,
    made as Adam itself makes it when no step has run yet (so a checkpoint can
    load into it)."""
    out = {}
    for n, p in named:
        st = opt.state[p]
        if not st:
            fused = any(g.get("fused") for g in opt.param_groups if any(q is p for q in g["params"]))
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[n] = (st["exp_avg"], st["exp_avg_sq"], st["step"])
    return out


def prepare(tail, s, device, cdt, compile: bool = False) -> Sharding:
    """The sharding of this process (settings `s.shard`), wrapped; the decoder layers compiled when asked."""
    if compile:
        # each layer compiled before it is wrapped: the order torch's own tests of fully_shard use
        tail.model.compile_layers(tail.running)
    return SHARDINGS[choose_sharding(s.shard, tail, device, s.genesis)](tail, device, cdt, s.genesis).wrap()


# ── one-process checkpoints ─────────────────────────────────────────────

def load_checkpoint(path: Path) -> dict | None:
    """The checkpoint at `path` (tensors and plain values only: never unpickles code), or None
    when it is damaged: it is then set aside as `NAME.damaged`, one line says so, and the
    stage restarts from its beginning rather than failing on every retry."""
    try:
        ck = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(ck, dict):
            raise ValueError(f"holds a {type(ck).__name__}, not a checkpoint table")
        return ck
    except Exception as e:  # noqa: BLE001 (torch raises many kinds on a damaged zip or pickle)
        why = " ".join(str(e).split())[:160]
        os.replace(path, path.with_name(path.name + ".damaged"))
        print(f"cortiq: {path}: a damaged checkpoint ({type(e).__name__}: {why}), set aside as {path.name}.damaged; "
              "the stage restarts from its beginning", file=sys.stderr)
        return None


def save_checkpoint(path: Path, obj: dict) -> None:
    """`obj` (tensors and plain values) at `path`, written to `.partial` and renamed."""
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)
