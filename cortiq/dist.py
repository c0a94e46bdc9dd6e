"""More than one GPU: the one place that knows about torch.distributed.

A stage with `gpus: N > 1` re-runs its own command under torchrun
(`python -m torch.distributed.run --standalone --nproc-per-node N -m cortiq
...`, see `launch`); each of the N processes then calls `init`, which joins
the process group torchrun describes in the environment (RANK, WORLD_SIZE,
LOCAL_RANK; NCCL on CUDA, gloo on the CPU). Every helper here is a no-op in a
plain single process, so stage code calls them unconditionally:

- `rank`/`world`/`is_main`: who this process is; rank 0 writes outputs and
  `meta.json` (`stage_dir`), the others write only their own shards;
- `shard(n, unit)`: this rank's contiguous share of n items (whole units of
  `unit` items, so a pass's batches are the same batches one rank runs);
- `sum_`/`agree`/`barrier`: the few collectives the stages need.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Iterator

from .errors import CortiqError

#: what torchrun puts in each process's environment
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """This process was started by torchrun (or anything that sets its environment)."""
    return all(k in os.environ for k in ENV)


def _dist():
    import torch.distributed as d

    return d if d.is_available() and d.is_initialized() else None


def init() -> bool:
    """Join torchrun's process group (once); False in a plain process. On CUDA
    each rank takes the GPU of its LOCAL_RANK before the group forms (NCCL binds
    a communicator to the current device)."""
    if not under_torchrun():
        return False
    import torch
    import torch.distributed as d

    if d.is_initialized():
        return True
    # torch.distributed.nn.functional binds `group=group.WORLD` into its functions' defaults when
    # first imported: imported after the group forms, the group itself, which `finish` cannot
    # reach (a defaults tuple of a pybind object is invisible to gc). It is imported lazily, and
    # late, by torch._dynamo (through FSDP's modules), which the first `torch.nn.init` call under
    # a `torch.device` context or the first `torch.compiler.disable` loads. Imported here, before
    # the group exists, its defaults are None (the default group, looked up per call).
    import torch.distributed.nn.functional  # noqa: F401

    cuda = torch.cuda.is_available()
    if cuda:
        lr = local_rank()
        if lr >= torch.cuda.device_count():
            raise CortiqError(f"torchrun rank {rank()}: LOCAL_RANK {lr}, but only {torch.cuda.device_count()} CUDA device(s)")
        torch.cuda.set_device(lr)
    kw = {"device_id": torch.device("cuda", local_rank())} if cuda else {}
    d.init_process_group("nccl" if cuda else "gloo", **kw)
    return True


#: the device meshes `mesh` made in this process (weakly: a mesh no one holds may go)
_MESHES: "weakref.WeakSet" = weakref.WeakSet()


def mesh(device_type: str):
    """A one-dimensional device mesh over every rank (what FSDP2 shards over),
    remembered so that `finish` can let go of the group it holds."""
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh(device_type, (world(),))
    _MESHES.add(m)
    return m


def finish() -> None:
    """Leave the process group (the end of a distributed command) so that none
    of its machinery outlives this call.

    `destroy_process_group` only unregisters a group: its C++ object, with its
    worker threads, TCP loop and store, lives on while anything refers to it,
    and a device mesh does, kept by DTensor's process-wide sharding caches long
    after the sharded model is gone. Left so, the group is torn down during
    interpreter finalization, in whatever order modules die, where a gloo
    worker thread that needs the GIL is ended inside C++ code: the rank can abort at
    exit ("terminate called without an active exception") after its work
    succeeded. So the group is destroyed, the meshes' references to it dropped
    and the unreachable wrapped modules (DDP's and FSDP2's hold it too)
    collected, which joins its threads here, while the interpreter is whole.
    There is no barrier: rank 0 may go on alone (scoring, writing) for longer
    than a collective's timeout after the others are done. A model the caller
    still holds keeps its group alive."""
    d = _dist()
    if d is None:
        return
    import gc

    d.destroy_process_group()
    for m in list(_MESHES):
        reg = getattr(m, "_pg_registry", None)  # the mesh's groups by name (absent where a torch keeps names only)
        if isinstance(reg, dict):
            reg.clear()
    _MESHES.clear()
    gc.collect()


def rank() -> int:
    d = _dist()
    return d.get_rank() if d is not None else int(os.environ.get("RANK", 0)) if under_torchrun() else 0


def world() -> int:
    d = _dist()
    return d.get_world_size() if d is not None else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def active() -> bool:
    """More than one process takes part."""
    return world() > 1


def device(dev):
    """The device this rank computes on: a CUDA device named without an index
    (or cuda:0 under torchrun) becomes the rank's own GPU (LOCAL_RANK)."""
    import torch

    dev = torch.device(dev)
    if dev.type == "cuda" and active():
        return torch.device("cuda", local_rank())
    return dev


def shard(n: int, unit: int = 1, r: int | None = None, w: int | None = None) -> range:
    """Rank r's contiguous share of n items among w ranks: whole units of `unit`
    items (the last unit may be short), the units spread as evenly as they go,
    lower ranks first. The shares in rank order are range(n) exactly."""
    r = rank() if r is None else r
    w = world() if w is None else w
    units = -(-n // unit) if n > 0 else 0
    a, b = units * r // w, units * (r + 1) // w
    return range(min(a * unit, n), min(b * unit, n))


def barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def sum_(x):
    """The sum over ranks of a float, or of a tensor (in place, returned)."""
    d = _dist()
    if d is None:
        return x
    import torch

    if isinstance(x, torch.Tensor):
        d.all_reduce(x)
        return x
    t = torch.tensor(float(x), dtype=torch.float64, device=_coll_device())
    d.all_reduce(t)
    return float(t)


def agree(obj):
    """Rank 0's `obj` on every rank (a decision every rank must take alike,
    such as whether a stage's output is already complete)."""
    d = _dist()
    if d is None:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def _coll_device():
    import torch

    d = _dist()
    return torch.device("cuda", torch.cuda.current_device()) if d is not None and d.get_backend() == "nccl" else torch.device("cpu")


@contextlib.contextmanager
def stage_dir(final, meta: dict) -> Iterator[Path]:
    """`store.stage_dir` for every rank: rank 0 creates `FINAL.partial/`, every
    rank fills it with its own files, and once all have, rank 0 writes
    `meta.json` (the dict as it stands then) last and renames the directory.
    Every rank leaves only when the output is complete."""
    from . import store

    final = Path(final)
    if not active():
        with store.stage_dir(final, meta) as part:
            yield part
        return
    part = final.with_name(final.name + ".partial")
    if is_main():
        with store.stage_dir(final, meta) as p:
            barrier()  # the directory exists
            yield p
            barrier()  # every rank's files are in it
        barrier()  # renamed: complete
    else:
        barrier()
        yield part
        barrier()
        barrier()


def shard_name(stem: str, r: int | None = None, w: int | None = None, ext: str = "arrow") -> str:
    """The file of rank r's share: `STEM.arrow` for one rank, `STEM-R-of-W.arrow` for more."""
    r = rank() if r is None else r
    w = world() if w is None else w
    return f"{stem}.{ext}" if w == 1 else f"{stem}-{r:03d}-of-{w:03d}.{ext}"


def shard_names(stem: str, w: int | None = None, ext: str = "arrow") -> list[str]:
    """Every rank's file of `stem`, in rank order (the order the rows go in)."""
    w = world() if w is None else w
    return [shard_name(stem, r, w, ext) for r in range(w)]


#: torchrun (`python -c` this, then torchrun's own arguments), its failure report cut
#: to one line: a rank's own error is on stderr already, and torchrun's report adds
#: a traceback of the launcher and a table per rank to it
_TORCHRUN = """
import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main()
except ChildFailedError as e:
    rank, f = e.get_first_failure()
    how = f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exit status {f.exitcode}"
    others = "; torchrun stopped the others" if len(e.failures) > 1 else ""
    print(f"cortiq: rank {rank} failed first ({how}){others}", file=sys.stderr)
    sys.exit(1)
"""


def launch(argv: list[str], gpus: int, module: str = "cortiq") -> int:
    """Run `python -m MODULE ARGV` as `gpus` processes under torchrun on this
    machine (`--standalone`: a rendezvous of its own on a free local port) and
    return its exit status (a failed rank fails the whole run: torchrun stops
    the others, and says in one line which rank failed first and how)."""
    import torch

    if gpus < 1:
        raise CortiqError(f"gpus {gpus} must be at least 1")
    if torch.cuda.is_available() and gpus > torch.cuda.device_count():
        raise CortiqError(f"gpus {gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not torch.cuda.is_available() and gpus > cores:
        # without CUDA each rank is a gloo process on the CPU: more ranks than cores only thrash
        raise CortiqError(f"gpus {gpus}: no CUDA device here, and the CPU ranks (gloo) are at most one per core: "
                          f"this machine has {cores}")
    cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", f"--nproc-per-node={gpus}", "-m", module, *argv]
    env = dict(os.environ)
    # the processes import the cortiq this one runs (a checkout on PYTHONPATH or the installed one)
    here = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # one thread pool per rank would oversubscribe the cores N times
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))
    return subprocess.run(cmd, env=env).returncode
