"""Several ranks on the CPU: each a spawned process joined to a gloo group on
127.0.0.1 through the environment torchrun would give it (cortiq.dist.init)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path

#: thread names of a torch.distributed group's C++ machinery (gloo's workers and TCP loop, the store's server)
GROUP_THREADS = ("pt_gloo", "gloo_", "pt_tcpstore")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_threads() -> list[str]:
    """The names of this process's threads that belong to a process group (Linux names threads in /proc)."""
    tasks = Path("/proc/self/task")
    names = []
    for t in tasks.iterdir() if tasks.is_dir() else ():
        try:
            names.append((t / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(n for n in names if n.startswith(GROUP_THREADS))


def _entry(fn, rank: int, world: int, port: int, args: tuple, err_path: str, check_group: bool = True) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")  # gloo on the CPU, whatever the machine has
    import torch

    from cortiq import dist

    torch.set_num_threads(1)
    try:
        assert dist.init() and dist.world() == world and dist.rank() == rank
        fn(rank, *args)
        dist.finish()
        # a group alive past finish is torn down at interpreter exit, where its threads can abort the rank
        left = group_threads() if check_group else []
        assert not left, f"rank {rank}: the process group's threads outlive dist.finish: {left}"
    except BaseException:
        with open(f"{err_path}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(fn, world: int, *args, tmp, timeout: float = 180.0, check_group: bool = True) -> None:
    """fn(rank, *args) in `world` processes of one group; fails with a rank's traceback, and
    (check_group) when a rank's group still has threads after dist.finish."""
    ctx = mp.get_context("spawn")
    port = free_port()
    err = str(tmp / "rank-error")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, err, check_group)) for r in range(world)]
    # each rank its own string hashes, as torchrun's processes may have: code that iterates a set in a
    # collective's order then fails here on every run, not only where the seeds happen to differ (seeds
    # 1 and 3 order even a set of the two names of heal's checkpointed weight sets differently)
    seed = os.environ.get("PYTHONHASHSEED")
    try:
        for r, p in enumerate(procs):
            os.environ["PYTHONHASHSEED"] = str(1 + 2 * r)
            p.start()
    finally:
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    msgs = [open(f"{err}.{r}").read() for r in range(world) if os.path.exists(f"{err}.{r}")]
    codes = [p.exitcode for p in procs]
    assert not msgs and codes == [0] * world, f"ranks exited {codes}:\n" + "\n".join(msgs)
